"""ExpertOffload: swaps every MoE block's experts for OffloadedExperts and turns predictions into copies.

Cache size (OffloadConfig.expert_cache_size) -> slots per MoE layer, the same for every layer:
    int n      -> n slots            "50%" -> round(0.5 * E), at least 1
    "12GB"     -> floor(12e9 / (num_moe_layers * bytes per expert)), an error below 1
    None       -> 50%                (always capped at E)
Why per layer and not one global pool: decode visits the layers in a cycle, so a global LRU would
evict exactly the layers that come next; per-layer caches also keep slot tensors stacked per
layer, which is what the experts kernel reads.

Predictions (ExpertPredictor listeners) queue up; a block drains the queue after issuing its own
demand loads, so a layer's misses are never queued behind copies for later layers. Predictions
made from the embeddings or a dense layer, or with the "layer_out" predictor source, are issued at
once (no offloaded block is waiting for its misses then).
"""

from __future__ import annotations

import torch

from moekv.config import parse_expert_cache_size
from moekv.errors import ConfigError
from moekv.layers.experts import LocalExperts
from moekv.moe.prefetch.offload import OffloadedExperts, SlotCopier, to_host
from moekv.moe.prefetch.predictor import ExpertPredictor, moe_layer_ids
from moekv.moe.prefetch.residency import PREDICTED, PREDICTED_FAR, CacheCounters


def expert_bytes(arch, dtype: torch.dtype) -> int:
    """Bytes of one routed expert's weights (gate, up and down projections)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 3 * arch.hidden_size * arch.expert_intermediate_size * element


def resolve_cache_slots(expert_cache_size, num_experts: int, bytes_per_expert: int, num_moe_layers: int) -> int:
    """OffloadConfig.expert_cache_size -> device slots per MoE layer (see the module docstring)."""
    parsed = parse_expert_cache_size(expert_cache_size) or ("share", 0.5)
    kind, value = parsed
    if kind == "slots":
        return min(int(value), num_experts)
    if kind == "share":
        return min(num_experts, max(1, round(value * num_experts)))
    slots = int(value // (max(num_moe_layers, 1) * bytes_per_expert))
    if slots < 1:
        need = num_moe_layers * bytes_per_expert / 1e9
        raise ConfigError(f"expert_cache_size={expert_cache_size!r} holds less than one expert per MoE layer; "
                          f"one slot in each of the {num_moe_layers} layers takes {need:.2f} GB")
    return min(slots, num_experts)


class ExpertOffload:
    """Offloaded experts for every MoE layer of `model`, fed by an optional ExpertPredictor."""

    def __init__(self, model: torch.nn.Module, num_slots: int, eviction: str = "lru",
                 predictor: ExpertPredictor | None = None, device: torch.device | None = None,
                 host_weights=None, time_copies: bool = False):
        """host_weights: optional callable(layer) -> (w_gate_up [E, 2I, H], w_down [E, H, I]) host tensors
        to use instead of copying the block's own weights (benchmarks share one host copy).
        time_copies: measure every copy (SlotCopier.copy_seconds(); benchmarks)."""
        self.model = model
        self.device = torch.device(device) if device is not None else model.device
        self.num_slots = num_slots
        self.predictor: ExpertPredictor | None = None
        self.copier = SlotCopier(self.device, timing=time_copies)
        self.layers: dict[int, OffloadedExperts] = {}
        self.num_experts = model.arch.num_experts
        for index in moe_layer_ids(model):
            block = model.layers[index].mlp
            old = block.experts
            if isinstance(old, OffloadedExperts):            # re-configuring: keep the host copy
                host_gate_up, host_down = old.host_w_gate_up, old.host_w_down
                dtype = old.slot_w_gate_up.dtype
            elif not isinstance(old, LocalExperts):
                raise ConfigError(f"cpu_offload_experts: layer {index}'s experts are {type(old).__name__}; "
                                  f"offloading replaces LocalExperts only (not combinable with expert parallelism)")
            elif host_weights is not None:
                host_gate_up, host_down = host_weights(index)
                dtype = old.w_gate_up.dtype
            else:
                host_gate_up, host_down = to_host(old.w_gate_up), to_host(old.w_down)
                dtype = old.w_gate_up.dtype
            block.experts = OffloadedExperts(index, host_gate_up, host_down, num_slots, self.device, dtype,
                                             self.copier, eviction, on_routed=self._issue)
            block.experts.pending_votes = self._pending_votes
            self.layers[index] = block.experts
            del old
        self._pending: list[tuple[int, int, torch.Tensor]] = []    # (target layer, distance, ids [T, P])
        self._immediate = False
        if predictor is not None:
            self.attach_predictor(predictor)

    def attach_predictor(self, predictor: ExpertPredictor) -> None:
        """Prefetch what `predictor` predicts (replaces a previously attached predictor)."""
        self.close()
        self.predictor = predictor
        self._immediate = predictor.source == "layer_out"
        predictor.listeners.append(self._on_prediction)

    # -- predictions -> copies -------------------------------------------------------------------
    def _on_prediction(self, source: int, target: int, distance: int, ids: torch.Tensor) -> None:
        if target not in self.layers:
            return
        self._pending.append((target, distance, ids))
        if self._immediate or source not in self.layers:  # no offloaded block at `source` would drain the
                                                          # queue (embeddings, a dense layer): issue now
            self._issue(source, torch.stack(self._pending_votes()).tolist())

    def _pending_votes(self) -> list[torch.Tensor]:
        """One [E] float32 score row per queued prediction (read together with a block's routing):
        each token's guess j of P scores P - j, so batches rank by votes and a single token by rank."""
        rows = []
        for _, _, ids in self._pending:                                       # ids [T, P]
            width = ids.shape[1]
            score = torch.arange(width, 0, -1, dtype=torch.float32, device=ids.device).expand(ids.shape)
            row = torch.zeros(self.num_experts, dtype=torch.float32, device=ids.device)
            rows.append(row.index_add_(0, ids.reshape(-1), score.reshape(-1)))   # [E] (bincount syncs on CUDA)
        return rows

    def _issue(self, layer: int, vote_rows: list[list[float]]) -> None:
        """Prefetch the queued predictions, highest score first (at most num_slots per layer)."""
        for (target, distance, _), votes in zip(self._pending, vote_rows):
            if target <= layer:                               # too late to help (a stale prediction)
                continue
            ranked = sorted((e for e in range(self.num_experts) if votes[e] > 0), key=lambda e: (-votes[e], e))
            self.layers[target].prefetch(ranked, PREDICTED if distance == 1 else PREDICTED_FAR)
        self._pending.clear()

    def begin_step(self) -> None:
        """Drop predictions left over from an interrupted forward."""
        self._pending.clear()

    def close(self) -> None:
        """Stop listening to the predictor (the experts stay offloaded)."""
        if self.predictor is not None and self._on_prediction in self.predictor.listeners:
            self.predictor.listeners.remove(self._on_prediction)

    def trace_events(self, enabled: bool = True) -> None:
        """Record ("load" | "prefetch" | "compute", layer, ...) events per layer (tests)."""
        for experts in self.layers.values():
            experts.events = [] if enabled else None

    # -- stats (host-side integers: no device sync) ------------------------------------------------
    def counters(self) -> CacheCounters:
        total = CacheCounters()
        for experts in self.layers.values():
            total.add(experts.cache.counters)
        return total

    def reset_stats(self) -> None:
        for experts in self.layers.values():
            experts.cache.counters = CacheCounters()
        self.copier.reset_counters()

    def stats(self) -> dict:
        first = next(iter(self.layers.values()), None)
        per_expert = first.expert_bytes if first is not None else 0
        return {
            "slots_per_layer": self.num_slots,
            "experts_per_layer": self.num_experts,
            "moe_layers": len(self.layers),
            "expert_bytes": per_expert,
            "device_slot_bytes": per_expert * self.num_slots * len(self.layers),
            "prefetch": self.predictor is not None,
            "copies": self.copier.copies,
            "bytes_copied": self.copier.bytes,
            **self.counters().as_dict(),
            "per_layer": {index: experts.cache.counters.as_dict() for index, experts in self.layers.items()},
        }

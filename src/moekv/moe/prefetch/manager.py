"""ExpertOffload: swaps every MoE block's experts for OffloadedExperts and turns predictions into copies.

Cache size (OffloadConfig.expert_cache_size) -> slots per MoE layer, the same for every layer:
    int n      -> n slots            "50%" -> round(0.5 * E), at least 1
    "12GB"     -> floor(12e9 / (num_moe_layers * bytes per expert)), an error below 1
    None       -> 50%                (always capped at E)
Why per layer and not one global pool: decode visits the layers in a cycle, so a global LRU would
evict exactly the layers that come next; per-layer caches also keep slot tensors stacked per
layer, which is what the experts kernel reads.

Device slots live in one pool for all layers (pool.SlotPool): layer i owns S of them, the staged
policy K staging slots more, and one is a trash slot. Host copies are 16-bit or FP8 (`host_format`).

Predictions (ExpertPredictor listeners) queue up; a block drains the queue after issuing its own
demand loads, so a layer's misses are never queued behind copies for later layers. Two policies:
    prefetch_threshold None   every guess is copied into the slot it evicts (the first prefetch; it
                              loses over PCIe, docs/expert-offload.md). Predictions made from the
                              embeddings or a dense layer, or with the "layer_out" predictor source,
                              are issued at once (no offloaded block is waiting for its misses then).
    a margin, or "auto"       staged guesses (policy.py, staged.py): confident guesses only, in staging
                              slots, chunk by chunk in the copy stream's idle time (measured: gate.py);
                              never evicting
staging="device" replaces the layers by device_staging.DeviceStagedExperts (no host reads).
cpu_compute_fraction > 0 gives every host-staged layer one shared cpu_split.CpuSplit (decode misses split
between the CPU and a partial copy; not made resident).
"""

from __future__ import annotations

import torch

from moekv.config import parse_expert_cache_size
from moekv.errors import ConfigError
from moekv.layers.experts import LocalExperts
from moekv.moe.prefetch.cpu_split import CpuSplit
from moekv.moe.prefetch.offload import OffloadedExperts, SlotCopier
from moekv.moe.prefetch.policy import NOT_GUESSED
from moekv.moe.prefetch.pool import HostExperts, SlotPool
from moekv.moe.prefetch.predictor import ExpertPredictor, moe_layer_ids
from moekv.moe.prefetch.residency import PREDICTED, PREDICTED_FAR, CacheCounters
from moekv.moe.prefetch.staged import StagedPrefetch


def expert_bytes(arch, dtype: torch.dtype, host_format: str = "native") -> int:
    """Bytes of one routed expert's weights (gate, up and down projections); "fp8": e4m3 codes plus one
    fp32 scale per output channel."""
    if host_format == "fp8":
        return 3 * arch.hidden_size * arch.expert_intermediate_size + 4 * (2 * arch.expert_intermediate_size
                                                                           + arch.hidden_size)
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
                 host_weights=None, time_copies: bool = False, host_format: str = "native",
                 prefetch_threshold: float | str | None = None, staging_slots: int = 2, chunks: int = 8,
                 timeline=None, staging: str = "host", prefetch_gate: str = "measured", meter=None,
                 cpu_compute_fraction: float = 0.0, cpu_threads: int | None = None):
        """host_weights: optional callable(layer) -> HostExperts (or (w_gate_up, w_down) host tensors) to use
        instead of copying the block's own weights (benchmarks share host copies).
        time_copies: measure every copy (SlotCopier.copy_seconds(); benchmarks).
        host_format: "native" or "fp8" (pool.py). prefetch_threshold: None (every guess copied), a router
        probability margin or "auto" (the staged policy, with `staging_slots` staging slots and copies in
        `chunks` pieces; `timeline`: a fixed policy.Timeline for tests; `prefetch_gate`: "measured" guess budgets
        (gate.py; `meter`: an injected gate meter for tests) or "estimate"). staging: "host" (one host read per
        layer) or "device" (device_staging.py: no host reads, CUDA-graph capturable).
        cpu_compute_fraction > 0: decode misses are split, that share of each computed on the CPU (cpu_split.py;
        host staging, 16-bit host copies, not with the staged policy); cpu_threads: the CPU worker's torch threads."""
        self.model = model
        self.device = torch.device(device) if device is not None else model.device
        self.num_slots = num_slots
        self.host_format = host_format
        self.staging_mode = staging
        self.predictor: ExpertPredictor | None = None
        self.copier = SlotCopier(self.device, timing=time_copies, chunks=chunks)
        self.layers: dict[int, OffloadedExperts] = {}
        self.num_experts = model.arch.num_experts
        hosts = {index: self._host_copy(model.layers[index].mlp.experts, index, host_weights)
                 for index in moe_layer_ids(model)}
        staged = prefetch_threshold is not None and staging == "host"
        extra = staging_slots if staged else 0
        first = next(iter(hosts.values()), None)
        self.pool = SlotPool(first, len(hosts) * num_slots + extra + 1, self.device) if first is not None else None
        for position, (index, host) in enumerate(hosts.items()):
            block = model.layers[index].mlp
            slots = list(range(position * num_slots, (position + 1) * num_slots))
            block.experts = self._layer(index, host, slots, eviction)
            self.layers[index] = block.experts
        self.split = None
        if cpu_compute_fraction > 0 and self.layers:
            if staging != "host" or staged:
                raise ConfigError("cpu_compute_fraction needs staging='host' and no staged prefetch policy "
                                  "(prefetch_threshold=None)")
            self.split = CpuSplit(cpu_compute_fraction, first, self.device, self.copier, model.arch.top_k,
                                  threads=cpu_threads)
            for experts in self.layers.values():
                self.split.tail(experts.host)           # the pinned down tails, made now, not at the first miss
                experts.split = self.split
        self.staged = None
        if staged and self.layers:
            self.staged = StagedPrefetch(self, list(range(len(hosts) * num_slots, len(hosts) * num_slots + extra)),
                                         prefetch_threshold, timeline, gate=prefetch_gate, meter=meter)
            for experts in self.layers.values():
                experts.staging = self.staged
        self._pending: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []   # (target, distance, ids, margins)
        self._immediate = False
        if predictor is not None:
            self.attach_predictor(predictor)

    def _host_copy(self, old, index: int, host_weights) -> HostExperts:
        if host_weights is not None:
            host = host_weights(index)
            return host if isinstance(host, HostExperts) else HostExperts.from_weights(*host, self.host_format)
        if isinstance(old, OffloadedExperts) or hasattr(old, "host"):   # re-configuring: keep the host copy
            host = old.host
            return host if host.fp8 or self.host_format == "native" else \
                HostExperts.from_weights(host.gate_up, host.down, self.host_format)
        if not isinstance(old, LocalExperts):
            raise ConfigError(f"cpu_offload_experts: layer {index}'s experts are {type(old).__name__}; "
                              f"offloading replaces LocalExperts only (not combinable with expert parallelism)")
        return HostExperts.from_weights(*old.weights(), self.host_format)

    def _layer(self, index: int, host: HostExperts, slots: list[int], eviction: str):
        if self.staging_mode == "device":
            from moekv.moe.prefetch.device_staging import DeviceStagedExperts

            return DeviceStagedExperts(index, host, self.pool, slots, eviction)
        experts = OffloadedExperts(index, host, self.pool, slots, self.copier, eviction, on_routed=self._issue)
        experts.pending_rows = self._pending_rows
        return experts

    @property
    def guessing(self) -> bool:
        """False while the predictor is paused (guard.PrefetchGuard): no guesses come."""
        return self.predictor is None or not self.predictor.paused

    def attach_predictor(self, predictor: ExpertPredictor) -> None:
        """Prefetch what `predictor` predicts (replaces a previously attached predictor)."""
        self.close()
        self.predictor = predictor
        self._immediate = predictor.source == "layer_out" and self.staged is None
        if self.staged is not None:
            predictor.margins = True
        predictor.listeners.append(self._on_prediction)

    # -- predictions -> copies -------------------------------------------------------------------
    def _on_prediction(self, source: int, target: int, distance: int, ids: torch.Tensor,
                       margins: torch.Tensor | None = None) -> None:
        if target not in self.layers:
            return
        self._pending.append((target, distance, ids, margins))
        if self.staged is None and (self._immediate or source not in self.layers):
            # no offloaded block at `source` would drain the queue (embeddings, a dense layer): issue now
            self._issue(source, [], torch.stack(self._pending_rows()).tolist())

    def _pending_rows(self) -> list[torch.Tensor]:
        """One [E] float32 row per queued prediction (read together with a block's routing). Staged policy:
        each expert's largest margin over the tokens (NOT_GUESSED where no token guessed it). Otherwise
        votes: each token's guess j of P scores P - j, so batches rank by votes and a single token by rank."""
        rows = []
        for _, _, ids, margins in self._pending:                             # ids [T, P]
            if self.staged is not None:
                row = torch.full((self.num_experts,), NOT_GUESSED, dtype=torch.float32, device=ids.device)
                rows.append(row.scatter_reduce_(0, ids.reshape(-1), margins.reshape(-1).float(), "amax"))
                continue
            width = ids.shape[1]
            score = torch.arange(width, 0, -1, dtype=torch.float32, device=ids.device).expand(ids.shape)
            row = torch.zeros(self.num_experts, dtype=torch.float32, device=ids.device)
            rows.append(row.index_add_(0, ids.reshape(-1), score.reshape(-1)))   # [E] (bincount syncs on CUDA)
        return rows

    def _issue(self, layer: int, needed: list[int], rows: list[list[float]], missed: bool = False) -> None:
        """The queued predictions, read at `layer`'s decision point: staged, or prefetched highest score
        first (at most num_slots per layer)."""
        pending, self._pending = self._pending, []
        if self.staged is not None:
            self.staged.decide(layer, needed, missed, [(target, row) for (target, *_), row in zip(pending, rows)])
            return
        for (target, distance, _, _), votes in zip(pending, rows):
            if target <= layer:                               # too late to help (a stale prediction)
                continue
            ranked = sorted((e for e in range(self.num_experts) if votes[e] > 0), key=lambda e: (-votes[e], e))
            self.layers[target].prefetch(ranked, PREDICTED if distance == 1 else PREDICTED_FAR)

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
        """Zero the counters (the staged policy's margin calibration and time estimates are kept)."""
        for experts in self.layers.values():
            experts.cache.counters = CacheCounters()
        self.copier.reset_counters()
        if self.split is not None:
            self.split.reset_counters()
        if self.staged is not None:
            self.staged.reset_counters()

    def _copy_counts(self, counters: CacheCounters, per_expert: int) -> dict:
        if self.staging_mode == "device":           # the device copies exactly the misses, whole experts
            return {"copies": counters.misses, "bytes_copied": counters.misses * per_expert}
        return {"copies": self.copier.copies, "bytes_copied": self.copier.bytes}

    def stats(self) -> dict:
        """Counters (reads the device tables with staging='device': call between steps)."""
        first = next(iter(self.layers.values()), None)
        per_expert = first.expert_bytes if first is not None else 0
        counters = self.counters()
        return {
            "host_format": self.host_format, "staging": self.staging_mode,
            "staged": self.staged.stats() if self.staged is not None else None,
            "cpu_split": self.split.stats() if self.split is not None else None,
            "slots_per_layer": self.num_slots,
            "experts_per_layer": self.num_experts,
            "moe_layers": len(self.layers),
            "expert_bytes": per_expert,
            "device_slot_bytes": per_expert * self.num_slots * len(self.layers),
            "prefetch": self.predictor is not None,
            **self._copy_counts(counters, per_expert),
            **counters.as_dict(),
            "per_layer": {index: experts.cache.counters.as_dict() for index, experts in self.layers.items()},
        }

"""Routing traces: record a trained model's routing and predictions, replay them in another model.

A random-weight model routes almost uniformly at random and its predictor guesses no better than
chance, so offloading measured on it says little. `record_trace` runs a trained model (the bundled
one) over text and keeps, per layer and token, the routed top-k ids and the predictor's guesses
1 and 2 layers ahead. `replay_trace` puts `TraceRouter`s into a (larger) model: layer l replays
trace layer (l mod L_trace) shifted by (l div L_trace) * token_stride tokens, so the repeated cycles
of layers see different text; `TracePredictor` hands the offload manager the recorded guesses at
the same point of the forward where the real predictor would make them (with their recorded router
probability margins). A TraceRouter keeps its position in a device tensor, so a replayed step runs
inside a CUDA graph too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moekv.moe.prefetch.predictor import ExpertPredictor, moe_layer_ids


@dataclass
class RoutingTrace:
    """routed [L, N, k]: experts each token was routed to; predicted[(source, d)][layer] [N, P]: the
    guess made d layers earlier by a predictor with that source (most likely first; None for
    layers without one), all int64 on the CPU; margins: the same layout, float32, each guess's router
    probability margin (predictor.probability_margins; None when not recorded)."""

    routed: torch.Tensor
    predicted: dict[tuple[str, int], list[torch.Tensor | None]]
    margins: dict[tuple[str, int], list[torch.Tensor | None]] | None = None

    @property
    def num_layers(self) -> int:
        return self.routed.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.routed.shape[1]

    def recall(self, distance: int, width: int, source: str = "attn") -> float:
        """Share of routed pairs inside the top-`width` guess made `distance` layers ahead."""
        hits = total = 0
        for layer, guess in enumerate(self.predicted[(source, distance)]):
            if guess is None:
                continue
            routed = self.routed[layer]                                          # [N, k]
            hits += int((routed.unsqueeze(-1) == guess[:, :width].unsqueeze(1)).any(-1).sum())
            total += routed.numel()
        return hits / total if total else 0.0


@torch.inference_mode()
def run_windows(model: nn.Module, token_ids: list[int], window: int, max_windows: int | None = None) -> int:
    """Prefill non-overlapping windows of `token_ids` as independent sequences (hooks see every
    token). Returns the number of tokens run."""
    from moekv.core.attention_metadata import AttentionMetadata
    from moekv.kvcache.base import KVCacheSpec
    from moekv.kvcache.formats.full_precision import FullPrecisionKVCache
    from moekv.kvcache.manager import KVCacheManager, pages_needed

    arch, device = model.arch, model.device
    page_size = 16
    num_pages = pages_needed(window, page_size) + 1
    spec = KVCacheSpec(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                       page_size=page_size, dtype=model.embed_tokens.weight.dtype)
    cache = FullPrecisionKVCache(spec, num_pages, device)
    done = 0
    for index, start in enumerate(range(0, len(token_ids) - 1, window)):
        if max_windows is not None and index >= max_windows:
            break
        chunk = token_ids[start:start + window]
        manager = KVCacheManager(num_pages, page_size, on_pages_freed=cache.pages_freed)
        manager.grow("trace", len(chunk))
        meta = AttentionMetadata.build(query_lens=[len(chunk)], context_lens=[0],
                                       block_tables=[manager.block_table("trace")], page_size=page_size,
                                       device=device, request_ids=["trace"])
        positions = torch.arange(len(chunk), device=device)                      # [T]
        model(torch.tensor(chunk, device=device), positions, cache, meta)
        manager.free("trace")
        done += len(chunk)
    return done


def record_trace(model: nn.Module, token_ids: list[int], window: int = 512, extra_candidates: int = 2,
                 sources: tuple[str, ...] = ("attn", "layer_out"), max_windows: int | None = None) -> RoutingTrace:
    """Routing and 1- / 2-ahead guesses (top_k + extra_candidates experts) of `model` on the text."""
    num_layers = model.arch.num_layers
    routed: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    guesses = {(src, d): [[] for _ in range(num_layers)] for src in sources for d in (1, 2)}
    margins = {(src, d): [[] for _ in range(num_layers)] for src in sources for d in (1, 2)}

    def keep(layer, target, d, ids, margin, source):
        guesses[(source, d)][target].append(ids.cpu())
        margins[(source, d)][target].append(margin.cpu())

    predictors = []
    for source in sources:
        predictor = ExpertPredictor(model, lookahead=2, extra_candidates=extra_candidates, source=source,
                                    margins=True)
        predictor.listeners.append(lambda *args, source=source: keep(*args, source))
        predictors.append(predictor)
    handles = [model.layers[i].mlp.router.register_forward_hook(
        lambda module, args, out, i=i: routed[i].append(out[1].cpu())) for i in moe_layer_ids(model)]
    try:
        run_windows(model, token_ids, window, max_windows)
    finally:
        for predictor in predictors:
            predictor.remove()
        for handle in handles:
            handle.remove()
    predicted = {key: [torch.cat(g) if g else None for g in per_layer] for key, per_layer in guesses.items()}
    margin = {key: [torch.cat(g) if g else None for g in per_layer] for key, per_layer in margins.items()}
    return RoutingTrace(torch.stack([torch.cat(r) for r in routed]), predicted, margin)


class TraceRouter(nn.Module):
    """Stands in for a block's Router: returns the trace's routing for the next T tokens.

    Reads rows (offset + cursor + t) mod N of its trace layer; weights are uniform 1/k (they do not
    matter for what is measured). `weight` keeps the original router weight for anything that
    reads it. The cursor is a device tensor advanced in place (no host work: CUDA-graph capturable);
    `cursor` reads or sets it from the host (outside a step).
    """

    def __init__(self, routed: torch.Tensor, predicted: dict[tuple[str, int], torch.Tensor | None], offset: int,
                 weight: torch.Tensor, margins: dict[tuple[str, int], torch.Tensor | None] | None = None):
        super().__init__()
        self.routed = routed                               # [N, k] on the model's device
        self.predicted = predicted                         # (source, distance) -> [N, P] or None
        self.margins = margins or {}                       # (source, distance) -> [N, P] float32 or None
        self.offset = offset
        self.position = torch.zeros(1, dtype=torch.int64, device=routed.device)   # [1] the cursor, on the device
        self.weight = weight
        self.top_k = routed.shape[1]

    @property
    def cursor(self) -> int:
        return int(self.position[0])

    @cursor.setter
    def cursor(self, value: int) -> None:
        self.position.fill_(value)

    def rows(self, table: torch.Tensor, num_tokens: int) -> torch.Tensor:
        index = (self.position + self.offset + torch.arange(num_tokens, device=table.device)) % table.shape[0]  # [T]
        return table.index_select(0, index)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden.shape[0]
        ids = self.rows(self.routed, num_tokens)                                           # [T, k]
        self.position += num_tokens
        weights = torch.full(ids.shape, 1.0 / self.top_k, dtype=torch.float32, device=hidden.device)   # [T, k]
        return weights, ids


def replay_trace(model: nn.Module, trace: RoutingTrace, token_stride: int = 997) -> list[tuple[int, int]]:
    """Install TraceRouters in every MoE block of `model`; returns (trace layer, token offset) per layer."""
    device = model.device
    mapping = []
    for layer in moe_layer_ids(model):
        trace_layer, cycle = layer % trace.num_layers, layer // trace.num_layers
        offset = (cycle * token_stride) % trace.num_tokens
        block = model.layers[layer].mlp
        predicted = {key: (g[trace_layer].to(device) if g[trace_layer] is not None else None)
                     for key, g in trace.predicted.items()}
        margins = {key: (g[trace_layer].to(device) if g[trace_layer] is not None else None)
                   for key, g in (trace.margins or {}).items()}
        block.router = TraceRouter(trace.routed[trace_layer].to(device), predicted, offset, block.router.weight,
                                   margins)
        mapping.append((trace_layer, offset))
    return mapping


class TracePredictor(ExpertPredictor):
    """An ExpertPredictor whose guesses are the recorded ones (for a model with TraceRouters)."""

    def predict(self, layer, target, residual, normed):
        router = self.model.layers[target].mlp.router
        table = router.predicted.get((self.source, target - layer))
        if table is None:
            return None
        return router.rows(table, residual.shape[0])[:, :self.stat_width]               # [T, <= P + 1]

    def confidence(self, layer, target, residual, normed, ids):
        table = self.model.layers[target].mlp.router.margins.get((self.source, target - layer))
        if table is None:
            raise ValueError("the trace holds no margins for this prediction: record it with record_trace")
        return self.model.layers[target].mlp.router.rows(table, residual.shape[0])[:, :ids.shape[1]]   # [T, P]


def simulate_cache(trace: RoutingTrace, num_slots: int, width: int | None = None, source: str = "attn",
                   eviction: str = "lru", num_tokens: int | None = None) -> dict:
    """Batch-1 decode over the trace through each layer's ExpertCache, the way OffloadedExperts and
    ExpertOffload drive it (lookahead 1): prefetch the top-`width` guess (None: no prefetch, loads on
    demand), then load the routed experts that are missing. Returns copies and misses per
    (layer, token) and the hit rate: the numbers that decide speed when copies are bandwidth-bound."""
    from moekv.moe.prefetch.residency import NEEDED, PREDICTED, CacheCounters, ExpertCache

    num_experts = int(trace.routed.max()) + 1 if trace.routed.numel() else 1
    for guesses in trace.predicted.values():
        num_experts = max([num_experts] + [int(g.max()) + 1 for g in guesses if g is not None])
    count = min(num_tokens or trace.num_tokens, trace.num_tokens)
    total = CacheCounters()
    for layer in range(trace.num_layers):
        cache = ExpertCache(num_experts, min(num_slots, num_experts), eviction)
        routed = trace.routed[layer, :count].tolist()
        table = trace.predicted[(source, 1)][layer]
        guesses = table[:count, :width].tolist() if (table is not None and width) else None
        for token in range(count):
            if guesses is not None:
                for expert in guesses[token][:cache.num_slots]:
                    if cache.is_resident(expert):
                        cache.protect(expert, PREDICTED)
                    elif cache.admit(expert, PREDICTED, prefetch=True) is None:
                        break
            needed = sorted(set(routed[token]))
            for expert in needed:
                cache.protect(expert, NEEDED)
            for expert in [e for e in needed if not cache.record_need(e)]:
                cache.admit(expert, NEEDED)
            for expert in needed:
                cache.use(expert)
            cache.end_step()
        total.add(cache.counters)
    steps = trace.num_layers * count
    return {"slots": num_slots, "prefetch_width": width, "source": source, "eviction": eviction,
            "copies_per_layer_token": (total.misses + total.prefetches) / steps,
            "misses_per_layer_token": total.misses / steps, "hit_rate": total.hit_rate,
            "wasted_prefetches_per_layer_token": total.wasted_prefetches / steps}


def simulate_optimal_eviction(trace: RoutingTrace, num_slots: int, num_tokens: int | None = None) -> dict:
    """On-demand loading with clairvoyant eviction (Belady: evict the resident expert whose next use
    is furthest in the future). No real policy can copy less; the bound for any eviction policy or
    eviction hint. Returns copies per (layer, token) and the hit rate."""
    count = min(num_tokens or trace.num_tokens, trace.num_tokens)
    copies = needed_total = 0
    for layer in range(trace.num_layers):
        routed = [sorted(set(r)) for r in trace.routed[layer, :count].tolist()]
        next_use: dict[int, list[int]] = {}                     # expert -> ascending token indices
        for token in range(count - 1, -1, -1):
            for expert in routed[token]:
                next_use.setdefault(expert, []).append(token)  # descending; popped from the end
        resident: set[int] = set()
        for token in range(count):
            for expert in routed[token]:
                next_use[expert].pop()                          # drop this use: the end is the next one
            needed_total += len(routed[token])
            for expert in routed[token]:
                if expert in resident:
                    continue
                copies += 1
                if len(resident) >= num_slots:
                    victims = [e for e in resident if e not in routed[token]] or list(resident)
                    resident.remove(max(victims, key=lambda e: next_use[e][-1] if next_use[e] else count + e))
                resident.add(expert)
    steps = trace.num_layers * count
    return {"slots": num_slots, "copies_per_layer_token": copies / steps,
            "hit_rate": 1 - copies / needed_total if needed_total else 0.0}

"""A copy / compute timeline simulator of batch-1 decode with offloaded experts.

Per token and MoE layer l (every layer of the trace), one compute stream and one FIFO copy stream:

    attention + router (attn_ms)  ->  decision point D_l (the host read of routing)
    misses copied (copy_ms each, after whatever the copy stream still holds)
    [guesses for later layers: policy-dependent]
    expert compute (expert_ms), once every needed expert's copy has finished

Modes, each driving the real bookkeeping (residency.ExpertCache; for "staged" the real
staged.StagedPrefetch.decide on a simulated copier and clock):
    on-demand   misses only
    prefetch    the first prefetch: the top-`width` guess for l+1 copied at D_l into the slots it evicts,
                the block waiting for late ones (layer 0: guessed from the embeddings at the token's start)
    staged      policy.py: guesses in staging slots, chunk by chunk in idle copy time, never evicting; the
                budget measured on simulated time (gate.py) or planned from a Timeline that may be wrong

The staged policy is built so that no step can be slower than on-demand: the caches evolve identically
and guess chunks end before the next decision point. `simulate_decode` measures that (tests assert it
step by step); it also predicts what a GPU run should show from its measured copy and compute times
(bench_offload.py timeline).
"""

from __future__ import annotations

from moekv.moe.prefetch.policy import NOT_GUESSED, Timeline
from moekv.moe.prefetch.residency import NEEDED, PREDICTED, ExpertCache


class _SimCopier:
    """The SlotCopier interface StagedPrefetch uses, on simulated time (seconds)."""

    stream = "simulated"

    def __init__(self, copy_s: float, chunks: int, call_s: float = 0.0):
        self.copy_s, self.chunks, self.call_s = copy_s, chunks, call_s
        self.busy_until = 0.0
        self.now = 0.0
        self.copies = 0
        self.chunk_copies = 0
        self.bytes = 0.0                              # a simulated expert is 1 byte (_SimLayer)

    def enqueue(self, seconds: float) -> float:
        self.busy_until = max(self.busy_until, self.now) + seconds
        self.bytes += seconds / self.copy_s
        return self.busy_until

    def copy(self, host, expert, pool, index, chunks=None, new=True) -> int:
        count = self.chunks if chunks is None else len(chunks)
        self.copies += int(new)
        self.chunk_copies += count
        self.enqueue(self.copy_s * count / self.chunks + self.call_s)
        return count / self.chunks                   # bytes

    def mark(self) -> float:
        return self.busy_until

    def passed(self, marker: float) -> bool:
        return marker <= self.now + 1e-12

    # -- the measured gate's meter (gate.py), on simulated time: a mark is the time it completes ------------
    def make_meter(self) -> "_SimCopier":
        return self

    def now_mark(self) -> float:
        return self.now

    def copy_mark(self) -> float:
        return max(self.now, self.busy_until)

    def done(self, mark: float) -> bool:
        return self.passed(mark)

    def elapsed_ms(self, a: float, b: float) -> float | None:
        return (b - a) * 1e3 if self.done(a) and self.done(b) else None


class _SimLayer:
    def __init__(self, num_experts: int, num_slots: int, eviction: str, first_index: int):
        self.cache = ExpertCache(num_experts, num_slots, eviction)
        self.slot_pool = list(range(first_index, first_index + num_slots))
        self.host = self.pool = None
        self.expert_bytes = 1
        self.ready: dict[int, float] = {}            # expert -> when its latest copy ends
        self.guess_ready: dict[int, float] = {}      # staged expert -> when its last issued chunk ends


class _SimOffload:
    def __init__(self, layers: dict[int, _SimLayer], copier: _SimCopier):
        self.layers, self.copier = layers, copier


def simulate_decode(trace, num_slots: int, mode: str, copy_ms: float, attn_ms: float, expert_ms: float,
                    num_tokens: int | None = None, eviction: str = "lru", width: int | None = None,
                    threshold: float | str = "auto", staging_slots: int = 2, chunks: int = 8,
                    source: str = "attn", gate: str = "measured", estimated_copy_ms: float | None = None,
                    estimated_window_ms: float | None = None, copy_call_ms: float = 0.0) -> dict:
    """Batch-1 decode over `trace` (moe.prefetch.trace.RoutingTrace). Returns per-token step times (ms),
    their mean, the cache counters and, for "staged", the staging counters.

    "staged": the policy's Timeline (its estimate) is exact unless `estimated_copy_ms` / `estimated_window_ms`
    say otherwise; gate "measured" learns the budgets from the simulated copier (a meter on simulated time),
    "estimate" plans with the Timeline alone. copy_call_ms: copy-stream time each guess copy call costs on top
    of its bytes (setup, small planes), which neither the estimate nor whole-expert copies show."""
    from moekv.moe.prefetch.staged import StagedPrefetch

    assert mode in ("on-demand", "prefetch", "staged"), mode
    num_experts = int(trace.routed.max()) + 1
    top_k = trace.routed.shape[2]
    assert num_slots >= top_k, "the simulator needs at least top_k slots (one pass per layer)"
    count = min(num_tokens or trace.num_tokens, trace.num_tokens)
    num_layers = trace.num_layers
    layers = {l: _SimLayer(num_experts, num_slots, eviction, l * num_slots) for l in range(num_layers)}
    copier = _SimCopier(copy_ms / 1e3, chunks, copy_call_ms / 1e3)
    width = width or top_k
    routed = [trace.routed[l, :count].tolist() for l in range(num_layers)]
    guesses = [trace.predicted[(source, 1)][l] for l in range(num_layers)]
    guesses = [g[:count, :width].tolist() if g is not None else None for g in guesses]
    staged = None
    if mode == "staged":
        margins = [trace.margins[(source, 1)][l] for l in range(num_layers)]
        margins = [m[:count, :width].tolist() if m is not None else None for m in margins]
        window = attn_ms + expert_ms if estimated_window_ms is None else estimated_window_ms
        estimate = Timeline(copy_ms=copy_ms if estimated_copy_ms is None else estimated_copy_ms,
                            default_window_ms=window)
        staged = StagedPrefetch(_SimOffload(layers, copier), list(range(num_layers * num_slots,
                                                                      num_layers * num_slots + staging_slots)),
                                threshold, estimate, gate=gate)
    t, steps = 0.0, []
    attn_s, expert_s = attn_ms / 1e3, expert_ms / 1e3
    for token in range(count):
        began = t
        if mode == "prefetch" and guesses[0] is not None:          # layer 0's guess, from the embeddings
            copier.now = t
            _prefetch(layers[0], guesses[0][token], copier)
        for l in range(num_layers):
            layer, cache = layers[l], layers[l].cache
            t += attn_s
            copier.now = t                                          # the decision point D_l
            if staged is not None:
                staged.mark_decision(l)
            needed = sorted(set(routed[l][token]))
            missing = [e for e in needed if not cache.record_need(e)]
            for e in needed:
                cache.protect(e, NEEDED)
            for e in missing:
                slot, _ = cache.admit(e, NEEDED)
                taken = staged.take(l, e) if staged is not None else None
                if taken is not None:                               # a staged guess: copy what is left
                    index, done = taken
                    staged.release(layer.slot_pool[slot])
                    layer.slot_pool[slot] = index
                    cache.counters.staged_hits += 1
                    layer.ready[e] = copier.enqueue(copier.copy_s * (chunks - done) / chunks) if done < chunks \
                        else max(copier.now, layer.guess_ready.pop(e, 0.0))
                else:
                    layer.ready[e] = copier.enqueue(copier.copy_s)
                    copier.copies += 1
            nxt = l + 1
            if mode == "prefetch" and nxt < num_layers and guesses[nxt] is not None:
                _prefetch(layers[nxt], guesses[nxt][token], copier)
            if staged is not None:
                rows = []
                if nxt < num_layers and guesses[nxt] is not None:
                    row = [NOT_GUESSED] * num_experts
                    for e, m in zip(guesses[nxt][token], margins[nxt][token]):
                        row[e] = max(row[e], m)
                    rows.append((nxt, row))
                before = {(g.target, g.expert): g.issued for g in staged.stager.staged.values()}
                staged.decide(l, needed, bool(missing), rows, now=t)
                for g in staged.stager.staged.values():             # where each guess's last chunk ends
                    if g.issued != before.get((g.target, g.expert), 0):
                        layers[g.target].guess_ready[g.expert] = copier.busy_until
            start = max([t] + [layer.ready.get(e, 0.0) for e in needed])
            for e in needed:
                cache.use(e)
            cache.end_step()
            t = start + expert_s
        steps.append((t - began) * 1e3)
    hits = sum(layers[l].cache.counters.hits for l in range(num_layers))
    misses = sum(layers[l].cache.counters.misses for l in range(num_layers))
    return {"mode": mode, "slots": num_slots, "copy_ms": copy_ms, "attn_ms": attn_ms, "expert_ms": expert_ms,
            "step_ms": steps, "ms_per_token": sum(steps) / len(steps), "hits": hits, "misses": misses,
            "copies_per_token": copier.copies / count,
            "staged": staged.stats() if staged is not None else None}


def _prefetch(layer: _SimLayer, guess: list[int], copier: _SimCopier) -> None:
    """The first prefetch (OffloadedExperts.prefetch): copy the guess into the slots it evicts."""
    cache = layer.cache
    for expert in guess[:cache.num_slots]:
        if cache.is_resident(expert):
            cache.protect(expert, PREDICTED)
        elif cache.admit(expert, PREDICTED, prefetch=True) is None:
            break
        else:
            layer.ready[expert] = copier.enqueue(copier.copy_s)
            copier.copies += 1

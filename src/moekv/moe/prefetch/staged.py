"""StagedPrefetch: the staged prefetch policy (policy.py) driving real copies at each decision point.

A decision point is an offloaded layer's one host read (OffloadedExperts.forward). Right after the read,
before the layer's misses are issued, `mark_decision` checks for an overrun: were the guess chunks issued
at the previous decision point done by now (an event query)? Then the misses are issued, the layer's
compute is launched, and `decide` runs, in this order:

    1. calibration: the margins of the guesses made for this layer against what it routed to
    2. guesses for this layer that its misses did not take over are dropped (their staging slot is free)
    3. the budget: how much copy time guesses may take before the next decision point. prefetch_gate
       "measured" (gate.py): learned per layer from CUDA events (the copy stream's measured window, the
       measured cost per byte of guess chunks, halved on overruns); "estimate": the host clock below
    4. new guesses for later layers (the margin rows read with the routing) above the threshold take
       free staging slots, when at least one chunk fits the budget
    5. as many chunks as fit the budget are issued, nearest layer and most confident guess first

The guesses are issued after the compute launch so that their host time overlaps the GPU's work instead
of delaying the compute's launch after the host read (the step's critical path at batch 1).

The host clock (`HostClock`, CUDA) estimates the copy time of an expert (bandwidth measured once) and
each layer's window (an average of the measured time from a layer's compute start to the next
decision point); with the measured gate it only prices the first probe. Tests and the simulator pass a
fixed `Timeline` instead (and the simulator's copier measures on simulated time).
"""

from __future__ import annotations

import math
import time

from moekv.errors import ConfigError
from moekv.moe.prefetch.gate import GATES, PROBE_CHUNKS, GuessGate
from moekv.moe.prefetch.policy import NOT_GUESSED, Stager, StagingPolicy, Timeline

WINDOW_DECAY = 0.8          # weight of the old estimate in the per-layer window average
OVERRUN_PRIOR_WEIGHT = 16   # pseudo-decisions of the prior in the measured overrun rate


class HostClock:
    """Timeline estimates from host time at the decision points (CUDA; perf_counter seconds)."""

    def __init__(self, copy_ms: float):
        self.timeline = Timeline(copy_ms=copy_ms)
        self._last: tuple[int, float] | None = None       # (layer, its compute start) of the last decision

    def observe(self, layer: int, now: float, compute_start: float) -> None:
        if self._last is not None:
            previous, started = self._last
            sample = max(0.0, (now - started) * 1e3)
            old = self.timeline.window_ms.get(previous)
            self.timeline.window_ms[previous] = sample if old is None else WINDOW_DECAY * old + (1 - WINDOW_DECAY) * sample
        self._last = (layer, compute_start)


class StagedPrefetch:
    """Staged guesses for the layers of one ExpertOffload (the OffloadedExperts.staging interface too).

    gate: "measured" (gate.GuessGate from `meter`, else the copier's own meter) or "estimate" (the timeline)."""

    def __init__(self, offload, indices: list[int], threshold: float | str, timeline: Timeline | None = None,
                 gate: str = "measured", meter=None):
        if gate not in GATES:
            raise ConfigError(f"prefetch_gate must be one of {GATES}, got {gate!r}")
        self.offload = offload
        self.copier = offload.copier
        self.stager = Stager(indices, self.copier.chunks)
        self.policy = StagingPolicy(threshold, self.copier.chunks)
        self.fixed = timeline                          # tests / simulations; else the host clock (CUDA)
        self.clock = None
        self.gate_mode = gate
        self.meter = meter
        self.gate: GuessGate | None = None
        self._no_meter = False
        self.expected: dict[int, dict[int, float]] = {}   # target layer -> {expert: margin} of its last guess
        self._guess_mark = None                        # copier.mark() after the last guess chunks ("estimate")
        self._marked: int | None = None                # the layer whose host read mark_decision saw last
        self._decision_time = 0.0                      # ... and when (perf_counter)
        self.last_threshold: float | None = None
        self.host_seconds = 0.0                        # host time spent in mark_decision + decide

    # -- OffloadedExperts.staging ------------------------------------------------------------------
    def engaged(self) -> bool:
        """Whether a decision point needs this policy: guesses may come (ExpertOffload.guessing: the predictor
        runs) or some are still staged or awaiting calibration. A block skips mark_decision / decide otherwise, so
        a step with prediction paused (guard.PrefetchGuard) is on-demand loading, bookkeeping included."""
        return self.offload.guessing or bool(self.stager.staged) or bool(self.expected)

    def take(self, layer: int, expert: int):
        return self.stager.take(layer, expert)

    def release(self, index: int) -> None:
        self.stager.release(index)

    # -- time ----------------------------------------------------------------------------------------
    def timeline(self) -> Timeline | None:
        if self.fixed is not None:
            return self.fixed
        if self.copier.stream is None:
            return None                                # CPU: copies are synchronous, no idle copy time
        if self.clock is None:
            first = next(iter(self.offload.layers.values()))
            bandwidth = self.copier.bandwidth or self.copier.measure_bandwidth(first.host, first.pool,
                                                                               self.stager.free[0])
            self.clock = HostClock(1e3 * first.expert_bytes / bandwidth)
        return self.clock.timeline

    def measuring(self) -> GuessGate | None:
        """The measured gate (built at the first decision; None with gate "estimate" or no meter)."""
        if self.gate is None and self.gate_mode == "measured" and not self._no_meter:
            make = getattr(self.copier, "make_meter", None)
            meter = self.meter if self.meter is not None else (make() if make is not None else None)
            if meter is None:
                self._no_meter = True                  # CPU copies: nothing to measure, the estimate decides
                return None
            timeline = self.timeline()
            first = next(iter(self.offload.layers.values()))
            prior = timeline.copy_ms / first.expert_bytes if timeline is not None and first.expert_bytes else None
            self.gate = GuessGate(meter, prior)
        return self.gate

    def _chunk_ms(self, layer: int, timeline: Timeline | None) -> float | None:
        """One guess chunk's copy time for `layer`'s experts: its bytes at the measured cost (measured gate),
        else the estimate's copy time / chunks."""
        if self.gate is not None:
            return self.gate.chunk_ms(self.offload.layers[layer].expert_bytes / self.stager.chunks)
        return timeline.copy_ms / self.stager.chunks if timeline is not None else None

    def overrun_rate(self) -> float:
        """Share of decision points that found guess chunks still in flight, smoothed towards the policy's
        prior by OVERRUN_PRIOR_WEIGHT pseudo-decisions (never exactly 0: a guess that is never right is not
        worth its copy)."""
        counters = self.stager.counters
        weight = OVERRUN_PRIOR_WEIGHT
        return (counters.overruns + weight * self.policy.overrun_prior) / (counters.decisions + weight)

    # -- one decision point ---------------------------------------------------------------------------
    def mark_decision(self, layer: int) -> None:
        """`layer`'s host read, before its misses are issued: were the last guess chunks done (overrun)?"""
        started = time.perf_counter()
        self._marked, self._decision_time = layer, started
        counters = self.stager.counters
        counters.decisions += 1
        gate = self.measuring()
        if gate is not None:
            overrun = gate.at_decision(self.copier.bytes)
        else:
            overrun = self._guess_mark is not None and not self.copier.passed(self._guess_mark)
        self._guess_mark = None
        counters.overruns += int(overrun)             # guess chunks still in flight: this layer's misses wait
        self.host_seconds += time.perf_counter() - started

    def decide(self, layer: int, needed: list[int], missed: bool, guesses: list[tuple[int, list[float]]],
               now: float | None = None) -> None:
        """After `layer`'s misses were issued (`missed`: any). guesses: (target layer, [E] margins,
        NOT_GUESSED where an expert was not guessed) read with the routing. now: host seconds (perf_counter;
        the simulator passes its own clock)."""
        started = time.perf_counter()
        if self._marked != layer:
            self.mark_decision(layer)                  # a caller without the separate host-read hook
        self._marked = None
        now = self._decision_time if now is None else now
        if layer in self.expected:
            self.policy.calibration.observe(self.expected.pop(layer), set(needed))
        self.stager.drop_before(layer)
        timeline = self.timeline()
        ready_at = max(now, self.copier.busy_until) if missed else now
        if self.clock is not None and timeline is self.clock.timeline:
            self.clock.observe(layer, now, ready_at)
        for target, row in guesses:
            if target > layer:
                self.expected[target] = {e: m for e, m in enumerate(row) if m > NOT_GUESSED}
        try:
            self._stage(layer, guesses, timeline, now, ready_at)
        finally:
            self.host_seconds += time.perf_counter() - started

    def _stage(self, layer, guesses, timeline, now, ready_at) -> None:
        gate = self.gate
        if timeline is None and gate is None:
            return
        chunks = self.stager.chunks
        chunk_ms = self._chunk_ms(layer, timeline)
        if gate is not None:
            gate.begin(layer, chunk_ms, self.copier.bytes)
            budget_ms = gate.budget_ms(layer)
            limit = None if gate.measured else PROBE_CHUNKS
            view = Timeline(copy_ms=math.inf if chunk_ms is None else chunk_ms * chunks,
                            window_ms={layer: budget_ms})
        else:      # the estimate: the copy stream may work until ~window after this layer's compute starts
            budget_ms = (ready_at - max(now, self.copier.busy_until)) * 1e3 + timeline.window(layer)
            limit, view = None, timeline
        threshold = self.policy.margin_threshold(view, layer, self.overrun_rate())
        self.last_threshold = threshold
        for target in sorted({t for t, _ in guesses if t > layer}):
            price = self._chunk_ms(target, timeline)
            if price is None or budget_ms + 1e-9 < price:
                continue                               # not one chunk fits: start nothing
            cache = self.offload.layers[target].cache
            ranked = sorted(self.expected[target].items(), key=lambda em: (-em[1], em[0]))
            for expert, margin in ranked:
                if margin >= threshold and not cache.is_resident(expert):
                    self.stager.start(target, expert, margin)
        counters, moved, issued = self.stager.counters, 0.0, 0
        for guess in self.stager.active():
            price = self._chunk_ms(guess.target, timeline)
            count = 0 if not price or price <= 0 else int(math.floor(budget_ms / price + 1e-9))
            count = min(chunks - guess.issued, count if limit is None else min(count, limit - issued))
            if count <= 0:
                break
            experts = self.offload.layers[guess.target]
            moved += self.copier.copy(experts.host, guess.expert, experts.pool, guess.index,
                                      range(guess.issued, guess.issued + count), new=guess.issued == 0)
            counters.issued += int(guess.issued == 0)
            guess.issued += count
            budget_ms -= count * price
            issued += count
            counters.chunks += count
            self._guess_mark = self.copier.mark()
        if gate is not None:
            gate.issued(moved)

    def reset_counters(self) -> None:
        self.stager.counters = type(self.stager.counters)()
        self.host_seconds = 0.0

    def stats(self) -> dict:
        return {**self.stager.counters.as_dict(), "threshold": self.policy.threshold,
                "margin_threshold_now": self.last_threshold, "calibration": self.policy.calibration.as_dict(),
                "gate": self.gate_mode, "measuring": self.gate is not None,
                "learned": self.gate.as_dict() if self.gate is not None else None,
                "host_ms": 1e3 * self.host_seconds, "chunks_per_expert": self.stager.chunks,
                "window_ms": dict(self.clock.timeline.window_ms) if self.clock is not None else None,
                "copy_ms": self.clock.timeline.copy_ms if self.clock is not None else None}

"""StagedPrefetch: the staged prefetch policy (policy.py) driving real copies at each decision point.

A decision point is an offloaded layer's one host read (OffloadedExperts.forward), right after its
misses were issued. There, in this order:

    1. overrun check: were the chunks issued at the previous decision point done by now? (an event query)
    2. calibration: the margins of the guesses made for this layer against what it routed to
    3. guesses for this layer that its misses did not take over are dropped (their staging slot is free)
    4. new guesses for later layers (the margin rows read with the routing) above the threshold take
       free staging slots
    5. as many chunks as the copy stream can finish before the next decision point are issued, nearest
       layer and most confident guess first

The host clock (`HostClock`, CUDA) estimates the copy time of an expert (bandwidth measured once) and
each layer's window (an average of the measured time from a layer's compute start to the next
decision point). Tests and the simulator pass a fixed `Timeline` instead.
"""

from __future__ import annotations

import time

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
    """Staged guesses for the layers of one ExpertOffload (the OffloadedExperts.staging interface too)."""

    def __init__(self, offload, indices: list[int], threshold: float | str, timeline: Timeline | None = None):
        self.offload = offload
        self.copier = offload.copier
        self.stager = Stager(indices, self.copier.chunks)
        self.policy = StagingPolicy(threshold, self.copier.chunks)
        self.fixed = timeline                          # tests / simulations; else the host clock (CUDA)
        self.clock = None
        self.expected: dict[int, dict[int, float]] = {}   # target layer -> {expert: margin} of its last guess
        self._guess_mark = None                        # copier.mark() after the last guess chunks issued
        self.last_threshold: float | None = None

    # -- OffloadedExperts.staging ------------------------------------------------------------------
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

    def overrun_rate(self) -> float:
        """Share of decision points that found guess chunks still in flight, smoothed towards the policy's
        prior by OVERRUN_PRIOR_WEIGHT pseudo-decisions (never exactly 0: a guess that is never right is not
        worth its copy)."""
        counters = self.stager.counters
        weight = OVERRUN_PRIOR_WEIGHT
        return (counters.overruns + weight * self.policy.overrun_prior) / (counters.decisions + weight)

    # -- one decision point ---------------------------------------------------------------------------
    def decide(self, layer: int, needed: list[int], missed: bool, guesses: list[tuple[int, list[float]]],
               now: float | None = None) -> None:
        """After `layer`'s misses were issued (`missed`: any). guesses: (target layer, [E] margins,
        NOT_GUESSED where an expert was not guessed) read with the routing. now: host seconds (perf_counter;
        the simulator passes its own clock)."""
        now = time.perf_counter() if now is None else now
        counters = self.stager.counters
        counters.decisions += 1
        if self._guess_mark is not None and not self.copier.passed(self._guess_mark):
            counters.overruns += 1                     # guess chunks still in flight: this layer's misses wait
        self._guess_mark = None
        routed = set(needed)
        if layer in self.expected:
            self.policy.calibration.observe(self.expected.pop(layer), routed)
        self.stager.drop_before(layer)
        timeline = self.timeline()
        ready_at = max(now, self.copier.busy_until) if missed else now
        if self.clock is not None and timeline is self.clock.timeline:
            self.clock.observe(layer, now, ready_at)
        for target, row in guesses:
            if target > layer:
                self.expected[target] = {e: m for e, m in enumerate(row) if m > NOT_GUESSED}
        if timeline is None:
            return
        threshold = self.policy.margin_threshold(timeline, layer, self.overrun_rate())
        self.last_threshold = threshold
        for target in sorted({t for t, _ in guesses if t > layer}):
            cache = self.offload.layers[target].cache
            ranked = sorted(self.expected[target].items(), key=lambda em: (-em[1], em[0]))
            for expert, margin in ranked:
                if margin >= threshold and not cache.is_resident(expert):
                    self.stager.start(target, expert, margin)
        # the copy stream may work until the next decision point, ~window after this layer's compute starts
        idle_ms = (ready_at - max(now, self.copier.busy_until)) * 1e3 + timeline.window(layer)
        budget = self.policy.budget_chunks(timeline, idle_ms)
        for guess in self.stager.active():
            if budget <= 0:
                break
            count = min(self.stager.chunks - guess.issued, budget)
            experts = self.offload.layers[guess.target]
            self.copier.copy(experts.host, guess.expert, experts.pool, guess.index,
                             range(guess.issued, guess.issued + count), new=guess.issued == 0)
            guess.issued += count
            budget -= count
            counters.chunks += count
            self._guess_mark = self.copier.mark()

    def reset_counters(self) -> None:
        self.stager.counters = type(self.stager.counters)()

    def stats(self) -> dict:
        return {**self.stager.counters.as_dict(), "threshold": self.policy.threshold,
                "margin_threshold_now": self.last_threshold, "calibration": self.policy.calibration.as_dict(),
                "window_ms": dict(self.clock.timeline.window_ms) if self.clock is not None else None,
                "copy_ms": self.clock.timeline.copy_ms if self.clock is not None else None}

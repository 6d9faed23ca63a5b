"""Staged prefetch: guesses that cannot make a step slower than loading on demand.

Today's prefetch (`prefetch_threshold=None`) copies every guess into the slot of the expert it evicts,
on the copy stream the misses use. Over PCIe that loses (docs/expert-offload.md): a wrong guess costs a
whole copy that the next layer's misses queue behind, and it evicts an expert that may be needed.

The staged policy changes three things:

1. **Guesses never evict.** A guess is copied into one of K staging slots of the pool (pool.py). When
   its layer routes to it, the miss takes the staging slot over (copying only the chunks still missing)
   and the slot the miss evicts -- the one on-demand loading would have evicted -- becomes a staging
   slot. A wrong guess is dropped. Every layer's cache therefore holds exactly what it holds when
   loading on demand: the same hits, the same misses; staging only starts some misses' copies earlier.
2. **Guesses use only idle copy time, misses first.** At a layer's decision point (its one host read)
   its misses are issued first. Guesses are issued in chunks (1/C of an expert each), and only as many
   as the copy stream can finish before the next layer's decision point: a budget measured per layer
   (gate.py, prefetch_gate "measured") or the host's estimate (`Timeline`, "estimate"). A guess that is
   not done by then is not waited for: if its layer routes to it, the rest is copied as that layer's
   miss, else it is dropped, and no miss ever queues behind its chunks (up to the budget's error,
   counted as `overruns`).
3. **Only confident guesses.** A guess is staged only when its router probability margin
   (predictor.probability_margins) clears a threshold: a number, or "auto". `MarginCalibration` learns,
   from every guess and the routing that follows (staged or not), how often guesses in each margin
   bucket are right. "auto" stages a guess when that precision clears the break-even point of the
   copy/compute ratio: p >= risk / (gain + risk), gain = min(window, copy) (the copy time a right guess
   saves), risk = one chunk times the measured overrun rate (what a wrong one can cost; smoothed towards a
   prior of 0.5, so never 0 and a bucket that is never right is never staged). Until a bucket
   has MIN_SAMPLES guesses it stages nothing from it (on-demand behaviour: cannot lose).

`Timeline` is the policy's estimate of time; the offload's host clock fills it in (copy bandwidth
measured once, window per layer an average of the measured gaps between decision points), the timeline
simulator (timeline.py) passes exact values (or wrong ones, to test the measured gate). The measured gate
builds a Timeline view of its measurements for the "auto" threshold. On the CPU copies are synchronous:
there is no idle copy time, and the policy stages nothing unless a test passes a timeline.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

NOT_GUESSED = -2.0          # the margin row value of an expert no token guessed (margins lie in [-1, 1])
MARGIN_EDGES = (-1.0, -0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
MIN_SAMPLES = 16


class MarginCalibration:
    """Precision of guesses by router probability margin bucket ([MARGIN_EDGES[i], MARGIN_EDGES[i+1]))."""

    def __init__(self, edges: tuple[float, ...] = MARGIN_EDGES, min_samples: int = MIN_SAMPLES):
        self.edges = edges
        self.min_samples = min_samples
        self.hits = [0] * (len(edges) - 1)
        self.total = [0] * (len(edges) - 1)

    def bucket(self, margin: float) -> int:
        return min(max(bisect.bisect_right(self.edges, margin) - 1, 0), len(self.total) - 1)

    def observe(self, margins: dict[int, float], routed: set[int]) -> None:
        """The guesses {expert: margin} made for a layer, and the experts the layer then routed to."""
        for expert, margin in margins.items():
            index = self.bucket(margin)
            self.total[index] += 1
            self.hits[index] += int(expert in routed)

    def precision(self, margin: float) -> float | None:
        """Measured precision of guesses with this margin's bucket (None: too few samples)."""
        index = self.bucket(margin)
        return self.hits[index] / self.total[index] if self.total[index] >= self.min_samples else None

    def threshold_for(self, needed: float) -> float:
        """The lowest bucket edge from which every bucket with enough samples reaches `needed` precision
        (inf when none does)."""
        threshold = math.inf
        for index in range(len(self.total) - 1, -1, -1):
            if self.total[index] < self.min_samples:
                continue
            if self.hits[index] / self.total[index] < needed:
                break
            threshold = self.edges[index]
        return threshold

    def as_dict(self) -> dict:
        return {"edges": list(self.edges), "hits": list(self.hits), "total": list(self.total)}


@dataclass
class Timeline:
    """The policy's view of time, in ms: one expert's copy, and per layer the time from its expert compute
    starting to the next MoE layer's decision point (`window`)."""

    copy_ms: float
    window_ms: dict[int, float] = field(default_factory=dict)
    default_window_ms: float = 0.0

    def window(self, layer: int) -> float:
        return self.window_ms.get(layer, self.default_window_ms)


@dataclass
class StagedGuess:
    target: int           # the layer the guess is for
    expert: int
    index: int            # its staging slot (pool index)
    margin: float
    issued: int = 0       # chunks issued so far


@dataclass
class StagingCounters:
    guesses: int = 0          # guesses staged (a staging slot taken)
    issued: int = 0           # ... that got at least one chunk copied
    chunks: int = 0           # chunks issued for guesses
    promoted: int = 0         # staged guesses their layer routed to (its miss takes the staging slot over)
    used: int = 0             # ... with at least one chunk done: a miss that had a head start
    promoted_chunks: int = 0  # the chunks those misses did not have to copy
    dropped: int = 0          # staged guesses their layer did not route to
    wasted: int = 0           # ... with at least one chunk copied
    dropped_chunks: int = 0   # ... and their chunks (copy time spent on nothing, idle time by construction)
    overruns: int = 0         # decision points where guess chunks were still in flight (a budget's error)
    decisions: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class StagingPolicy:
    """Which guesses to stage, and how many chunks of them, at one decision point."""

    def __init__(self, threshold: float | str, chunks: int, calibration: MarginCalibration | None = None,
                 overrun_prior: float = 0.5):
        self.threshold = threshold
        self.chunks = chunks
        self.calibration = calibration or MarginCalibration()
        self.overrun_prior = overrun_prior

    def needed_precision(self, timeline: Timeline, layer: int, overrun_rate: float | None) -> float:
        """The break-even precision of a staged guess for the layer after `layer` ("auto")."""
        chunk_ms = timeline.copy_ms / self.chunks
        gain = min(timeline.window(layer), timeline.copy_ms)
        risk = chunk_ms * (self.overrun_prior if overrun_rate is None else overrun_rate)
        return risk / (gain + risk) if gain + risk > 0 else 1.0

    def margin_threshold(self, timeline: Timeline, layer: int, overrun_rate: float | None = None) -> float:
        if self.threshold != "auto":
            return float(self.threshold)
        return self.calibration.threshold_for(self.needed_precision(timeline, layer, overrun_rate))

    def budget_chunks(self, timeline: Timeline, idle_ms: float) -> int:
        """Whole chunks the copy stream can finish in `idle_ms`."""
        chunk_ms = timeline.copy_ms / self.chunks
        if chunk_ms <= 0 or idle_ms <= 0:
            return 0
        return int(math.floor(idle_ms / chunk_ms + 1e-9))


class Stager:
    """The staging slots and the guesses in them (host bookkeeping shared by the offload and the simulator)."""

    def __init__(self, indices: list[int], chunks: int):
        self.free = list(indices)
        self.chunks = chunks
        self.staged: dict[tuple[int, int], StagedGuess] = {}
        self.counters = StagingCounters()

    def start(self, target: int, expert: int, margin: float) -> StagedGuess | None:
        """Take a staging slot for a new guess (None when none is free or it is staged already)."""
        if (target, expert) in self.staged or not self.free:
            return None
        guess = StagedGuess(target, expert, self.free.pop(0), margin)
        self.staged[(target, expert)] = guess
        self.counters.guesses += 1
        return guess

    def take(self, target: int, expert: int) -> tuple[int, int] | None:
        """A miss of `target`: (its staging slot, chunks issued) if the expert was staged for it."""
        guess = self.staged.pop((target, expert), None)
        if guess is None:
            return None
        self.counters.promoted += 1
        self.counters.used += int(guess.issued > 0)
        self.counters.promoted_chunks += guess.issued
        return guess.index, guess.issued

    def release(self, index: int) -> None:
        """A pool slot becomes a staging slot (the slot a promoted guess's miss evicted)."""
        self.free.append(index)

    def drop_before(self, layer: int) -> None:
        """Guesses for `layer` or earlier that were not taken: their layer has decided."""
        for key in [k for k in self.staged if k[0] <= layer]:
            guess = self.staged.pop(key)
            self.counters.dropped += 1
            self.counters.wasted += int(guess.issued > 0)
            self.counters.dropped_chunks += guess.issued
            self.free.append(guess.index)

    def active(self) -> list[StagedGuess]:
        """Guesses with chunks left to issue, nearest layer first, then most confident."""
        return sorted((g for g in self.staged.values() if g.issued < self.chunks),
                      key=lambda g: (g.target, -g.margin, g.expert))

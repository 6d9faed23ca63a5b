"""PrefetchGuard: prefetch stays on only while it measures faster than loading on demand.

Whether guesses pay depends on the machine (link bandwidth against compute), the cache size and the routing,
and on the H200 they often do not (docs/expert-offload.md: at 50% and 75% cache both prefetch policies were
slower than on-demand loading). Instead of predicting that, the guard measures it while decoding: the same
decode steps are timed with the predictor running and its guesses copied ("on") and with the predictor paused
("off": exactly on-demand loading), in alternating windows, and the faster side is kept.

Per decode regime (the number of sequences in the step: a batch of 1 and a batch of 8 are decided apart):

    explore   windows of `window` timed steps alternate on, off, on, off, ... until each side has `rounds`
    hold      the faster side (by the median of its recent window medians; "on" must be strictly faster)
              runs `hold` windows, then
    probe     one window of the other side; the decision is made again from the newest windows. A probe that
              confirms the decision doubles the hold (up to `max_hold`); one that reverses it resets the hold.

A step is timed from its start to the next step's start (host clock): that span holds everything the step
waited for, including the last layer's copies and compute that the sampling's read of the logits waits for;
scheduling and sampling cost the same on either side. Only a decode step followed by another step is timed; a
span longer than OUTLIER_FACTOR x the regime's last window median (the engine idled between requests) is
dropped. Steps that are not pure decode are not timed and run the last decided side. Exploration costs at most
`rounds` windows of the slower side per regime, then one window in `hold + 1` (fewer as the hold doubles).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

MAX_REGIMES = 16            # decode regimes (batch sizes) remembered; the least recently used is forgotten
OUTLIER_FACTOR = 10.0       # a step span this many times the regime's last window median is an idle gap


@dataclass
class _Regime:
    """The guard's state for one decode regime."""

    rounds: int
    on: bool = True                                       # the side the current window runs
    phase: str = "explore"                                # explore | hold | probe
    decided: bool | None = None                           # the kept side once explored
    hold: int = 0                                         # windows to hold the decided side
    held: int = 0                                         # windows held so far
    samples: list[float] = field(default_factory=list)    # step seconds of the current window
    windows: dict = field(default_factory=dict)           # side -> deque of window medians (seconds)
    counts: dict = field(default_factory=lambda: {True: 0, False: 0})   # windows run per side
    switches: int = 0                                     # decisions that changed the kept side

    def __post_init__(self) -> None:
        self.windows = {True: deque(maxlen=self.rounds), False: deque(maxlen=self.rounds)}


class PrefetchGuard:
    """Chooses, per decode step, whether prefetch runs ("on") or experts load on demand ("off").

    Usage: at the start of every step `on = guard.begin(key)` (key: the decode regime, None for a step not
    timed), then run the step with prefetch `on`. `clock` returns seconds (tests inject one)."""

    def __init__(self, window: int = 8, rounds: int = 2, hold: int = 16, max_hold: int = 128, clock=None):
        if window < 1 or rounds < 1 or hold < 1 or max_hold < hold:
            raise ValueError(f"PrefetchGuard needs window, rounds, hold >= 1 and max_hold >= hold; got "
                             f"window={window}, rounds={rounds}, hold={hold}, max_hold={max_hold}")
        self.window, self.rounds, self.base_hold, self.max_hold = window, rounds, hold, max_hold
        self.clock = clock or time.perf_counter
        self.regimes: dict = {}
        self.last_on = True                               # the side of untimed steps: the last decision made
        self._open: tuple | None = None                   # (key, side, start) of the step in progress

    # -- per step ---------------------------------------------------------------------------------
    def begin(self, key) -> bool:
        """A step of regime `key` starts (None: not timed); the step before it has ended -> whether prefetch
        runs in this step."""
        now = self.clock()
        self._record(now)
        if key is None:
            return self.last_on
        regime = self.regimes.pop(key, None) or _Regime(self.rounds)
        self.regimes[key] = regime                        # most recently used last
        while len(self.regimes) > MAX_REGIMES:
            self.regimes.pop(next(iter(self.regimes)))
        self._open = (key, regime.on, now)
        return regime.on

    def abort(self) -> None:
        """The step begun last failed: it is not timed."""
        self._open = None

    def _record(self, now: float) -> None:
        if self._open is None:
            return
        key, side, start = self._open
        self._open = None
        regime = self.regimes.get(key)
        if regime is None or regime.on != side:
            return
        seconds = now - start
        last = regime.windows[side][-1] if regime.windows[side] else None
        if last is not None and seconds > OUTLIER_FACTOR * last:
            return
        regime.samples.append(seconds)
        if len(regime.samples) >= self.window:
            self._close_window(regime)

    # -- windows and decisions --------------------------------------------------------------------
    def _close_window(self, regime: _Regime) -> None:
        side = regime.on
        regime.windows[side].append(statistics.median(regime.samples))
        regime.counts[side] += 1
        regime.samples = []
        if regime.phase == "explore":
            if all(len(regime.windows[s]) >= self.rounds for s in (True, False)):
                self._decide(regime, confirm=None)
            else:
                regime.on = not side
        elif regime.phase == "hold":
            regime.held += 1
            if regime.held >= regime.hold:
                regime.phase, regime.on = "probe", not regime.decided
        else:                                             # probe window done
            self._decide(regime, confirm=regime.decided)

    def _decide(self, regime: _Regime, confirm: bool | None) -> None:
        on_time = statistics.median(regime.windows[True])
        off_time = statistics.median(regime.windows[False])
        decided = on_time < off_time
        if confirm is None:
            regime.hold = self.base_hold
        elif decided == confirm:
            regime.hold = min(2 * regime.hold, self.max_hold)
        else:
            regime.hold = self.base_hold
            regime.switches += 1
        regime.decided, regime.on, regime.phase, regime.held = decided, decided, "hold", 0
        self.last_on = decided

    # -- report -------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per regime: the kept side, the phase, windows run per side and their recent medians (ms)."""
        out = {}
        for key, regime in self.regimes.items():
            out[str(key)] = {
                "prefetch": regime.decided, "phase": regime.phase, "switches": regime.switches,
                "windows_on": regime.counts[True], "windows_off": regime.counts[False],
                "median_ms_on": _ms(regime.windows[True]), "median_ms_off": _ms(regime.windows[False]),
            }
        return {"window": self.window, "rounds": self.rounds, "hold": self.base_hold, "regimes": out}


def _ms(windows) -> float | None:
    return round(statistics.median(windows) * 1e3, 4) if windows else None

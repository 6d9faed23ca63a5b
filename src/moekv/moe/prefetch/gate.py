"""Guess gating from measurement: how much copy time a layer's staged guesses may take, learned from what the
copies actually took (prefetch_gate="measured", the default; "estimate" is session 19's host estimate).

The staged policy (policy.py, staged.py) issues guess chunks only into copy time that is idle before the next
decision point, so that no miss queues behind a guess. Session 19 estimated that idle time on the host (one
expert's copy measured once, host time between decision points), and on the H200 the estimate was wrong:
guesses overran into the next layer's misses (docs/expert-offload.md). The gate measures instead. At every
decision point k (layer l) it takes three marks:

    D_k   compute side, "now"      (CUDA: an event on the current stream right after the layer's host read)
    P_k   copy stream, then, before l's misses
    S_k   copy stream, after l's misses, before its guess chunks
    G_k   copy stream, after l's guess chunks (when any were issued)

and, once the marks have completed (event queries, never a wait), it learns
    window_l     S_k -> D_{k+1}: the copy stream's time between l's misses and the next decision point
    chunk cost   (S_k -> G_k) / bytes issued: ms per byte of guess copies, so a chunk's price follows its
                 actual bytes (an FP8 host expert's chunk costs half a bf16 one's); until a guess has been
                 measured, the misses' (P_k -> S_k) / their bytes
    overrun      G_k not done at D_{k+1}: the next layer's misses queue behind guess chunks

Layer l's budget = scale_l x SAFETY x min(its last HISTORY windows). scale_l halves on each overrun at l and
grows by GROW after a decision that had at least one chunk of idle copy time left. Before l has a measured
window its budget is 0, and until a copy cost is measured a decision issues at most PROBE_CHUNKS chunks,
priced by the estimate. A run whose estimate is wrong therefore pays a few probes and then stages only what
the measurements say fits: nothing, when no chunk fits.

Meters (duck-typed): `now_mark()`, `copy_mark()`, `done(mark)`, `elapsed_ms(a, b)` (None until both marks have
completed). `EventMeter` uses CUDA timing events; the timeline simulator's copier is a meter on simulated
time; tests inject fake clocks. Without a meter (CPU copies: synchronous, nothing to measure) the policy falls
back to its estimate (a fixed Timeline in tests).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from moekv.offload_config import PREFETCH_GATES as GATES  # noqa: F401  (StagedPrefetch checks its gate)
SAFETY = 0.9            # share of the smallest recent window a layer's guesses may take
HISTORY = 8             # windows per layer the minimum runs over
SHRINK = 0.5            # scale factor on an overrun
GROW = 1.0 / 16         # scale step after a decision with a chunk of idle copy time left
PROBE_CHUNKS = 1        # chunks per decision until a chunk cost is measured
COST_DECAY = 0.7        # weight of the old ms-per-byte estimate
MAX_AGE = 32            # decisions a record waits for its marks before it is given up


class EventMeter:
    """Marks as CUDA timing events: on the copy stream (`copy_mark`) or the current stream (`now_mark`). Events
    of resolved records are reused (`release`), so a decision point costs event records, not creations."""

    def __init__(self, copy_stream: torch.cuda.Stream, device: torch.device):
        self.copy_stream = copy_stream
        self.device = torch.device(device)
        self._free: list[torch.cuda.Event] = []

    def _record(self, stream) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def release(self, *marks) -> None:
        self._free += [mark for mark in marks if mark is not None]

    def now_mark(self) -> torch.cuda.Event:
        return self._record(torch.cuda.current_stream(self.device))

    def copy_mark(self) -> torch.cuda.Event:
        return self._record(self.copy_stream)

    def done(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def elapsed_ms(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float | None:
        return a.elapsed_time(b) if a.query() and b.query() else None


@dataclass
class _Record:
    layer: int
    start: object                 # S_k
    pre: object | None = None     # P_k
    miss_bytes: float = 0.0       # bytes copied between P_k and S_k
    end: object | None = None     # G_k (None: no guess chunk issued)
    chunk_ms: float | None = None    # one chunk's price at this decision
    nbytes: float = 0.0
    decision: object | None = None   # D_{k+1}
    overran: bool = False
    age: int = 0


@dataclass
class LayerBudget:
    windows: deque
    scale: float = 1.0
    overruns: int = 0

    def budget_ms(self) -> float:
        return self.scale * SAFETY * min(self.windows) if self.windows else 0.0


class GuessGate:
    """Per-layer guess budgets (ms of copy time) learned from a meter's marks; see the module docstring."""

    def __init__(self, meter, prior_ms_per_byte: float | None = None):
        self.meter = meter
        self.prior_ms_per_byte = prior_ms_per_byte
        self.ms_per_byte: float | None = None       # measured cost of guess copies
        self.miss_ms_per_byte: float | None = None  # ... of miss copies (the price until a guess is measured)
        self._pre: tuple[object, float] | None = None   # (P_k, the copier's byte count then)
        self.layers: dict[int, LayerBudget] = {}
        self._open: _Record | None = None           # this decision's record (closed by the next decision)
        self._pending: list[_Record] = []           # closed, marks not all completed yet
        self.samples = 0                            # guess batches measured
        self.given_up = 0                           # records whose marks never completed in MAX_AGE decisions

    def layer(self, layer: int) -> LayerBudget:
        if layer not in self.layers:
            self.layers[layer] = LayerBudget(deque(maxlen=HISTORY))
        return self.layers[layer]

    # -- at a decision point ---------------------------------------------------------------------------
    def at_decision(self, copied_bytes: float = 0.0) -> bool:
        """The host read of a layer (before its misses; `copied_bytes`: the copier's byte count): closes the
        previous decision's record. Returns whether that decision's guess chunks were still in flight (an
        overrun). Two marks and one query: the misses wait for this."""
        mark = self.meter.now_mark()
        self._pre = (self.meter.copy_mark(), copied_bytes)
        overrun = False
        record, self._open = self._open, None
        if record is not None:
            record.decision = mark
            if record.end is not None and not self.meter.done(record.end):
                record.overran = overrun = True
                budget = self.layer(record.layer)
                budget.scale *= SHRINK
                budget.overruns += 1
            self._pending.append(record)
        return overrun

    def begin(self, layer: int, chunk_ms: float | None, copied_bytes: float = 0.0) -> None:
        """After `layer`'s misses were issued, before its guess chunks (`chunk_ms`: one chunk's price now).
        Learns from the records whose marks have completed first."""
        self._resolve()
        record = self._open = _Record(layer, self.meter.copy_mark(), chunk_ms=chunk_ms)
        if self._pre is not None:
            record.pre, record.miss_bytes = self._pre[0], copied_bytes - self._pre[1]
        self._pre = None

    def issued(self, nbytes: float) -> None:
        """Guess chunks of `nbytes` were issued at this decision (after all of them: one end mark)."""
        if self._open is not None and nbytes > 0:
            self._open.nbytes += nbytes
            self._open.end = self.meter.copy_mark()

    def _resolve(self) -> None:
        keep = []
        for record in self._pending:
            window = self.meter.elapsed_ms(record.start, record.decision)
            spent = self.meter.elapsed_ms(record.start, record.end) if record.end is not None else 0.0
            if window is None or spent is None:
                record.age += 1
                if record.age < MAX_AGE:
                    keep.append(record)
                else:
                    self.given_up += 1
                continue
            release = getattr(self.meter, "release", None)
            if release is not None:
                release(record.pre, record.start, record.end, record.decision)
            window, spent = max(window, 0.0), max(spent, 0.0)
            budget = self.layer(record.layer)
            budget.windows.append(window)
            if record.end is not None and spent > 0:
                self.ms_per_byte = _blend(self.ms_per_byte, spent / record.nbytes)
                self.samples += 1
            missed = self.meter.elapsed_ms(record.pre, record.start) if record.miss_bytes > 0 else None
            if missed is not None and missed > 0:
                self.miss_ms_per_byte = _blend(self.miss_ms_per_byte, missed / record.miss_bytes)
            if not record.overran and record.chunk_ms is not None and window - spent >= record.chunk_ms:
                budget.scale = min(1.0, budget.scale + GROW)     # idle time for one more chunk was left
        self._pending = keep

    # -- what the policy asks -----------------------------------------------------------------------------
    @property
    def measured(self) -> bool:
        return self.ms_per_byte is not None or self.miss_ms_per_byte is not None

    def chunk_ms(self, nbytes: float) -> float | None:
        """The cost of copying `nbytes` of guess chunks: measured on guesses, else on misses, else the prior
        (None: none of them)."""
        rate = next((r for r in (self.ms_per_byte, self.miss_ms_per_byte, self.prior_ms_per_byte) if r is not None),
                    None)
        return None if rate is None else rate * nbytes

    def budget_ms(self, layer: int) -> float:
        return self.layer(layer).budget_ms()

    def as_dict(self) -> dict:
        return {"ms_per_byte": self.ms_per_byte, "miss_ms_per_byte": self.miss_ms_per_byte,
                "prior_ms_per_byte": self.prior_ms_per_byte,
                "samples": self.samples, "given_up": self.given_up,
                "layers": {layer: {"window_ms": min(b.windows) if b.windows else None, "scale": b.scale,
                                   "budget_ms": b.budget_ms(), "overruns": b.overruns}
                           for layer, b in sorted(self.layers.items())}}


def _blend(old: float | None, sample: float) -> float:
    return sample if old is None else COST_DECAY * old + (1 - COST_DECAY) * sample

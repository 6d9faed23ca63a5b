"""Overlapped decode steps (DeviceConfig.overlap_decode): while the GPU runs decode step n, the host schedules
and launches step n+1, and only then reads step n's tokens.

Each `Engine.step()` call launches one CUDA-graph decode step and returns the outputs of the one before it:
schedule step n+1 (`Scheduler.schedule_ahead`), launch it (`ModelRunner.launch_graph`: bucket fill, the cache's
begin_step, the one upload, the replay; non-greedy rows drawn on the device right after), then wait for step
n's status copy and turn its tokens into outputs (append, stop tokens and strings, max_tokens, streaming),
exactly as a synchronous step does. The input tokens of step n+1 never visit the host: step n's graph wrote
its tokens into the runner's device feed, and step n+1's graph reads each sequence's token from its row there
(`GraphBucket.fill(rows, feed)`). Between the launch and the read a request holds its drawn token as
`num_pending_tokens` (counted in `num_tokens`, absent from `output_token_ids`).

What stays the same as synchronous steps. A step overlaps only when it is what `Scheduler.schedule()` would
decide once step n is read: every running request decodes (none waits, none prefills), the free pages cover
every next token (no preemption, no eviction), and every request is overlap-safe (`SamplingStep.overlap_safe`:
its draw needs nothing of its last token on the host). Requests that will end with step n for a reason known
in advance (max_tokens, max_model_len) are left out of step n+1. Otherwise the engine drains: it reads step n,
and the next call schedules as a synchronous engine would (a prefill, an admission, a preemption). The token
draw is the same ops on the same logits (seeded requests draw the same), so greedy and seeded outputs equal the
synchronous ones.

What differs. A request that ends at step n on its token (EOS, a stop token or string, non-finite logits) or
is aborted while a step holding it is in flight has one extra row in step n+1: it is computed and discarded,
never emitted (`forget` takes its pending token and its computed position back). That row writes its own KV
pages (freed right after), counts in `model.expert_load` and, for the low-bit cache, in the quantizer
statistics when it fills a page. A low-bit step's successor returns the staging blocks of the pages it filled
before planning (`KVCache.begin_step(meta, overlapped=True)`), so a step found non-finite afterwards was
committed in that respect; its requests are all ended or recomputed, as in a synchronous step.

Host waits: a synchronous graph step waits on its own status read with nothing else queued, so the GPU idles
while the host finishes the step and prepares the next one; an overlapped step's one wait is on step n while
step n+1 is queued behind it (`stats`: "idle_waits" counts reads made with no later step queued).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from moekv.core.request import Request, RequestOutput
from moekv.engine.graph_replay import GraphStep
from moekv.errors import KVCacheCorruptionError
from moekv.scheduler.output import SchedulerOutput


@dataclass
class LaunchedStep:
    """A decode step launched and not read yet."""

    sched: SchedulerOutput
    graph: GraphStep
    requests: list[Request | None]          # per row; None once its request ended (the row is discarded)
    rows: dict[int, int] = field(default_factory=dict)   # id(request) -> row, for the live rows


class OverlappedSteps:
    """The engine's step loop with overlapped decode steps (see the module docstring)."""

    def __init__(self, engine):
        # the engine owns this object: a weak proxy back, so no engine <-> steps cycle keeps a dropped engine (its
        # KV pool, graphs and buckets) alive until the next cyclic collection
        self.engine = weakref.proxy(engine)
        self.runner = engine.runner
        self.in_flight: LaunchedStep | None = None    # the last step launched, not read yet
        self._reading: LaunchedStep | None = None     # the step being read back now
        self.stats = {"launched": 0, "overlapped": 0, "drained": 0, "discarded_rows": 0, "idle_waits": 0}

    # -- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        engine = self.engine
        previous = self.in_flight
        try:
            if previous is None:
                sched = engine.scheduler.schedule()
                if sched.is_empty:
                    return []
                if not self._may_launch(sched.chunks):
                    return engine._run_step(sched)
                self.in_flight = self._launch(sched, None)
                return []
            sched = self._schedule_ahead(previous)
            if sched is None:                           # drain: the next call schedules synchronously
                self.in_flight = None
                self.stats["drained"] += 1
                return self._read(previous, None)
            self.in_flight = self._launch(sched, previous)
            self.stats["overlapped"] += 1
            return self._read(previous, self.in_flight)
        except BaseException:
            self._abandon()
            raise
        finally:
            self.drop_if_dead()

    def _may_launch(self, chunks) -> bool:
        """A step of these chunks can run as a launched graph step: decode-only, its bucket there, every
        request overlap-safe."""
        runner = self.runner
        return (runner.graph_mode is not None and runner.coordinator is None and runner.token_feed is not None
                and bool(chunks) and len(chunks) <= runner.buckets[-1] and runner.has_bucket(len(chunks))
                and all(c.num_new_tokens == 1 and c.sample for c in chunks)
                and all(self.engine.sampling.overlap_safe(c.request.params) and c.request.grammar is None
                        for c in chunks))

    def _schedule_ahead(self, previous: LaunchedStep) -> SchedulerOutput | None:
        """The next step behind `previous`, or None (drain). Its requests are previous's live ones (checked
        overlap-safe when the first of these steps was launched): a running request outside it drains."""
        running = self.engine.scheduler.running
        if len(running) != len(previous.rows) or not all(id(r) in previous.rows for r in running):
            return None
        finishing = {r.request_id for r in running if self._ends_after_pending(r)}
        count = len(running) - len(finishing)
        if not count or not self.runner.has_bucket(count):
            return None
        return self.engine.scheduler.schedule_ahead(finishing)

    def _ends_after_pending(self, request: Request) -> bool:
        """Whether the request ends with its pending token whatever that token is (max_tokens, max_model_len)."""
        count = len(request.output_token_ids) + request.num_pending_tokens
        return count >= request.params.max_tokens or request.num_tokens >= self.engine.max_model_len

    def _launch(self, sched: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        engine = self.engine
        if engine._cpu_threads is not None:
            engine._cpu_threads.for_step(sched.num_tokens)
        rows, feed = [], []
        for chunk in sched.chunks:
            request, position = chunk.request, chunk.start
            source = previous.rows.get(id(request), -1) if previous is not None else -1
            token = request.token_ids(position, position + 1)[0] if source < 0 else 0   # fed rows: from the device
            rows.append((token, position, engine.kv_manager.block_table(request.request_id), request.request_id))
            feed.append(source)
        requests = [c.request for c in sched.chunks]
        greedy = all(r.params.greedy for r in requests)            # the graph's argmax is every row's token
        sample = None if greedy else lambda logits: engine.sampling.draw_tokens(logits, requests)
        graph = self.runner.launch_graph(rows, feed if previous is not None else None, sample)
        engine.counters["steps"] += 1
        self.stats["launched"] += 1
        for request in requests:
            request.num_computed_tokens += 1
            request.num_pending_tokens += 1
        return LaunchedStep(sched, graph, list(requests), {id(r): i for i, r in enumerate(requests)})

    def _read(self, launched: LaunchedStep, after: LaunchedStep | None) -> list[RequestOutput]:
        """Read a launched step back into outputs; `after` is the step launched behind it (None: nothing is
        queued behind it, so the GPU idles from its end until the host launches again)."""
        engine = self.engine
        if after is None:
            self.stats["idle_waits"] += 1
        self._reading = launched
        try:
            result = self.runner.collect_graph(launched.graph)
        except KVCacheCorruptionError as exc:
            self._reading = None
            if after is not None:                       # drain the step behind it too, then recover as usual
                self.in_flight = None
                self._discard(after)
            self._take_back(launched)
            return engine._recover_from_corruption(launched.sched, exc)
        requests = launched.requests
        for request in requests:
            if request is not None:
                request.num_pending_tokens -= 1         # its token is read now (appended below)
        launched.rows.clear()
        self._reading = None
        return engine._token_outputs(requests, result.greedy_tokens, result.finite)

    # -- requests that end while a step holding them is in flight --------------------------------------------
    def forget(self, request: Request) -> None:
        """The request ends (finished on its last token, aborted): its row in the launched step is discarded,
        and the position that row computes and the token it draws are taken back."""
        launched = self.in_flight
        row = launched.rows.pop(id(request), None) if launched is not None else None
        if row is None:
            return
        launched.requests[row] = None
        request.num_pending_tokens -= 1
        request.num_computed_tokens -= 1
        self.stats["discarded_rows"] += 1

    def drop_if_dead(self) -> None:
        """A launched step left without a live row is read now and dropped (its cache plan ends with it)."""
        launched = self.in_flight
        if launched is not None and not launched.rows:
            self.in_flight = None
            self._discard(launched)

    def _discard(self, launched: LaunchedStep) -> None:
        """Read a launched step and drop its outputs: live rows are taken back; a non-finite report is moot
        (its requests are ended or recomputed by the caller)."""
        try:
            self.runner.collect_graph(launched.graph)
        except KVCacheCorruptionError:
            pass
        self._take_back(launched)

    def _take_back(self, launched: LaunchedStep) -> None:
        """Undo a launched step's advance of its live rows (its outputs are not used)."""
        for row in list(launched.rows.values()):
            request = launched.requests[row]
            request.num_pending_tokens -= 1
            request.num_computed_tokens -= 1
            launched.requests[row] = None
        launched.rows.clear()

    def _abandon(self) -> None:
        """After an error: every launched step is read where it can be, and undone, oldest first."""
        steps = [s for s in (self._reading, self.in_flight) if s is not None]
        self._reading = self.in_flight = None
        for step in steps:
            try:
                self._discard(step)
            except Exception:  # noqa: BLE001 - the original error is what the caller sees
                self._take_back(step)
        self.runner.drop_launched()

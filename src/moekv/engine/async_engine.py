"""The synchronous Engine behind an asyncio server: one background thread runs the step loop.

Flow of one request:
1. `await AsyncEngine.add(...)` puts an add command on a thread-safe queue and waits for the engine
   thread to validate it (`Engine.add_request`); a bad request raises InvalidRequestError here and
   leaves nothing behind.
2. The engine thread steps while there is work. After each step it turns every changed request into a
   `StreamDelta` (new tokens, new visible text, finished?) computed from the request's cumulative
   state, and hands the deltas to the request's asyncio queue with `loop.call_soon_threadsafe`.
3. `RequestStream.abort()` (a client that went away) puts an abort command; the engine thread aborts
   the request before its next step, which frees its KV pages.

Failures: an exception from `Engine.step()` never ends the loop. It ends the requests it names
(`exc.request_ids`) or, when it names none, the one request of the failed step when it ran alone;
otherwise every request in the scheduler is parked (pages freed, to be recomputed) and re-admitted
one per step, so the next failure points at the request admitted last (engine/step_recovery.py). If the
loop itself dies, every open stream ends with an error and `is_alive` turns False (`/health` -> 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence

from moekv.engine.engine import Engine
from moekv.core.request import Request, RequestStatus
from moekv.engine.step_recovery import StepRecovery
from moekv.engine.streams import AddCommand, EngineDeadError, RequestStream, StreamDelta, Tracked
from moekv.errors import InvalidRequestError
from moekv.metrics import EngineStats, RequestTimings, ServerMetrics
from moekv.sampling import SamplingParams

logger = logging.getLogger("moekv.async_engine")


class AsyncEngine:
    """Owns the engine thread. Every method is safe to call from the event loop (or any thread)."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, idle_wait_s: float = 0.05):
        self.engine = engine
        self.metrics = metrics
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, Tracked] = {}          # engine thread only
        self._unscheduled: set[str] = set()               # tracked, not yet run by a step (engine thread)
        self._recovery = StepRecovery(self.engine, self.fail)  # engine thread only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead_reason: str | None = None
        self.stats = EngineStats()                         # swapped by the engine thread
        if metrics is not None:
            metrics.bind(lambda: self.stats, self._expert_load, self._kv_stats, self._routing_stats)
            cache = engine.cache_config
            metrics.set_cache_info(block_size=engine.kv_manager.page_size, cache_dtype=cache.kv_cache_dtype,
                                   num_gpu_blocks=engine.kv_manager.pool.num_pages, num_cpu_blocks=0,
                                   gpu_memory_utilization=cache.memory_fraction, swap_space_bytes=0,
                                   enable_prefix_caching=cache.enable_prefix_caching)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="moekv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; open streams end with an error. Waits for the thread up to `timeout_s`."""
        self._stop.set()
        self._commands.put(None)   # wake the thread if it is idle
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        if self._dead_reason is None and self._thread is not None and not self._thread.is_alive():
            return "the engine loop is not running"
        return self._dead_reason

    # -- requests -----------------------------------------------------------------------------------
    async def add(self, requests: Sequence[tuple[str, list[int] | str, SamplingParams]]) -> RequestStream:
        """Queue (request_id, prompt, params) triples, all or none; returns their shared stream.

        Raises InvalidRequestError (nothing is kept) or EngineDeadError.
        """
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine loop is not running")
        loop = asyncio.get_running_loop()
        out_queue: asyncio.Queue = asyncio.Queue()
        command = AddCommand(list(requests), out_queue, loop, loop.create_future())
        self._commands.put(command)
        request_ids = [r[0] for r in command.requests]
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(command.done), timeout=1.0)
                    break
                except asyncio.TimeoutError:
                    if not self.is_alive:   # the loop stopped before it saw this command
                        raise EngineDeadError(self.dead_reason or "the engine loop is not running") from None
        except asyncio.CancelledError:
            self.abort(request_ids)   # queued after the add, so the engine thread sees them in order
            raise
        return RequestStream(self, request_ids, out_queue)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (their pages are freed before the next step). Unknown ids are ignored."""
        self._commands.put(("abort", list(request_ids)))

    # -- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not (self.engine.has_unfinished() or self._recovery.parked))
                if self._stop.is_set():
                    break
                self._recovery.before_step()
                if self.engine.has_unfinished():
                    self._step()
                self._publish_stats()
            self._dead_reason = "the server is shutting down"
            self._end_all(self._dead_reason, finish_reason="abort")
        except BaseException as exc:  # the loop itself broke: report it and end every stream
            self._dead_reason = f"the engine loop died: {type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
            try:
                self._end_all(self._dead_reason)
            except Exception:
                logger.exception("could not end the open streams")
        self._reject_pending()

    def _reject_pending(self) -> None:
        """Answer adds that will never be handled (the loop has stopped)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddCommand):
                _call_soon(command.loop, _settle, command.done, EngineDeadError(self.dead_reason or "stopped"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command) -> None:
        if command is None:
            return
        if isinstance(command, AddCommand):
            self._handle_add(command)
            return
        _, request_ids = command
        for request_id in request_ids:
            self._recovery.forget(request_id)
            if self.engine.abort(request_id):
                self._deliver([request_id])
            else:
                self._untrack(request_id)

    def _handle_add(self, command: AddCommand) -> None:
        added: list[str] = []
        try:
            for request_id, prompt, params in command.requests:
                self.engine.add_request(prompt, params, request_id=request_id)
                added.append(request_id)
        except Exception as exc:
            for request_id in added:
                self.engine.abort(request_id)
                self.engine.release(request_id)
            if not isinstance(exc, InvalidRequestError):
                logger.exception("adding a request failed")
            _call_soon(command.loop, _settle, command.done, exc)
            return
        for request_id in added:
            self._tracked[request_id] = Tracked(request_id, command.out_queue, command.loop, command.submit_time)
            self._unscheduled.add(request_id)
            self._recovery.admitted(self.engine.requests[request_id])
        _call_soon(command.loop, _settle, command.done, None)

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; isolating the request that caused it")
            self._recovery.step_failed(exc)
            # Requests that finished inside the failed step, or were ended by recovery, still owe a delta.
            self._publish_stats()
            self._deliver([rid for rid in self._tracked if self._is_finished(rid)])
            return
        self._recovery.step_succeeded()
        self._mark_scheduled(started)
        self._publish_stats()   # before the deltas: a client that scrapes after its last chunk sees this step
        self._deliver([out.request_id for out in outputs])

    def _mark_scheduled(self, step_start: float) -> None:
        """Requests the step just ran for the first time left the queue when it started."""
        for request_id in list(self._unscheduled):
            request, tracked = self.engine.requests.get(request_id), self._tracked.get(request_id)
            if tracked is None or request is None:
                self._unscheduled.discard(request_id)
            elif request.num_computed_tokens > 0 or request.status is not RequestStatus.WAITING:
                tracked.scheduled_time = step_start
                self._unscheduled.discard(request_id)

    def _is_finished(self, request_id: str) -> bool:
        request = self.engine.requests.get(request_id)
        return request is None or request.status.is_finished

    def _deliver(self, request_ids: Sequence[str]) -> None:
        """Send each request's delta since the last one to its queue (one hop per event loop)."""
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamDelta]]] = {}
        for request_id in dict.fromkeys(request_ids):
            tracked = self._tracked.get(request_id)
            request = self.engine.requests.get(request_id)
            if tracked is None:
                continue
            delta = self._make_delta(tracked, request, now)
            if delta is None:
                continue
            batches.setdefault(tracked.loop, []).append((tracked.out_queue, delta))
            if delta.finished:
                self._untrack(request_id)
        for loop, items in batches.items():
            _call_soon(loop, _put_all, items)

    def _make_delta(self, tracked: Tracked, request: Request | None, now: float) -> StreamDelta | None:
        if request is None:   # released behind our back: report it as an error rather than hang
            return StreamDelta(tracked.request_id, [], "", None, True, "error", "the request was lost",
                               0, tracked.sent_tokens)
        finished = request.status is RequestStatus.FINISHED
        new_tokens = request.output_token_ids[tracked.sent_tokens:]
        text = request.output_text
        visible = len(text)
        stop = request.params.stop
        if stop and not finished:   # a stop string may still match: hold back its possible start
            visible = max(tracked.sent_chars, len(text) - max(len(s) for s in stop) + 1)
        new_text = text[tracked.sent_chars:visible]
        if not new_tokens and not new_text and not finished:
            return None
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = list(request.output_logprobs[tracked.sent_tokens:tracked.sent_tokens + len(new_tokens)])
        tracked.sent_tokens += len(new_tokens)
        tracked.sent_chars = max(tracked.sent_chars, visible)
        self._observe(tracked, request, len(new_tokens), finished, now)
        return StreamDelta(request.request_id, list(new_tokens), new_text, logprobs, finished,
                           request.finish_reason if finished else None, request.error if finished else None,
                           request.num_prompt_tokens, len(request.output_token_ids),
                           request.cumulative_logprob if request.params.num_sequences > request.params.n else None)

    def _observe(self, tracked: Tracked, request: Request, num_new: int, finished: bool, now: float) -> None:
        metrics = self.metrics
        if num_new:
            if tracked.first_token_time is None:
                tracked.first_token_time = now
                if metrics is not None:
                    metrics.observe_first_token(now - tracked.submit_time, request.num_prompt_tokens)
                    metrics.observe_tokens(num_new, None)
            elif metrics is not None:
                metrics.observe_tokens(num_new, (now - tracked.last_token_time) / num_new)
            tracked.last_token_time = now
        if finished and metrics is not None:
            metrics.observe_finished(now - tracked.submit_time, request.finish_reason)
            metrics.observe_request(_request_timings(tracked, request, now))

    def _untrack(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self.engine.release(request_id)

    def _end_all(self, reason: str, finish_reason: str = "error") -> None:
        """End every open request: "abort" at shutdown (the server answers 503 `aborted`), "error" when
        the loop died. One log line per request ended."""
        for request_id in list(self._tracked):
            self._recovery.forget(request_id)
            self.engine.abort(request_id)
            request = self.engine.requests.get(request_id)
            if request is not None:
                request.finish_reason, request.error = finish_reason, reason
                logger.warning("request %s ended unfinished (%s) after %d generated tokens: %s", request_id,
                               finish_reason, len(request.output_token_ids), reason)
        self._deliver(list(self._tracked))
        self._publish_stats()

    def fail(self, request: Request, message: str) -> None:
        """End one request with an error (engine thread only)."""
        self.engine.abort(request.request_id)
        request.finish_reason, request.error = "error", message
        self.engine.counters["errors"] += 1

    def _publish_stats(self) -> None:
        """Swap in a fresh snapshot (cheap host-side numbers only: no device sync on the step path)."""
        engine = self.engine
        bits, share = self.stats.kv_bits_per_value, self.stats.kv_full_precision_token_share
        if bits == 0.0:         # the low-bit pages' all-in bits: fixed by the format
            try:
                bits = float(engine.kv_cache.page_bits_per_value())
            except Exception:
                logger.debug("kv_cache.page_bits_per_value failed", exc_info=True)
        try:                    # host arithmetic over the running lengths: cheap enough for every step
            share = float(engine.kv_cache.full_precision_token_share(
                [r.num_computed_tokens for r in engine.scheduler.running]))
        except Exception:       # a format without an answer keeps the last value
            logger.debug("full_precision_token_share failed", exc_info=True)
        prefix = engine.kv_manager.prefix_cache
        self.stats = EngineStats(
            num_running=engine.scheduler.num_running, num_waiting=engine.scheduler.num_waiting,
            kv_cache_usage=float(engine.kv_manager.usage), num_preemptions=engine.scheduler.num_preemptions,
            kv_bits_per_value=bits, kv_full_precision_token_share=share,
            prefix_cache_queries=prefix.queries if prefix is not None else 0,
            prefix_cache_hits=prefix.hits if prefix is not None else 0)

    # -- read at scrape time, from the scrape's thread (device reads never stall the engine thread) --
    def _kv_stats(self) -> dict[str, float]:
        try:
            stats = dict(self.engine.kv_cache.stats())
        except Exception:
            logger.debug("kv_cache.stats() failed", exc_info=True)
            return {}
        if stats:
            stats["page_heads_per_page"] = float(self.engine.arch.num_layers * self.engine.arch.num_kv_heads)
        return stats

    def _routing_stats(self):
        try:
            return self.engine.routing_stats()
        except Exception:
            logger.debug("routing_stats() failed", exc_info=True)
            return None

    def _expert_load(self):
        try:
            return self.engine.expert_load()
        except Exception:
            return None


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _put_all(items: list[tuple[asyncio.Queue, StreamDelta]]) -> None:
    for out_queue, delta in items:
        out_queue.put_nowait(delta)


def _request_timings(tracked: Tracked, request: Request, now: float) -> RequestTimings:
    """A finished request's phases (vLLM's request_* histograms); a phase it never reached is None."""
    scheduled, first = tracked.scheduled_time, tracked.first_token_time
    num_generated = len(request.output_token_ids)
    return RequestTimings(
        queue=None if scheduled is None else scheduled - tracked.submit_time,
        prefill=None if scheduled is None or first is None else first - scheduled,
        decode=None if first is None else now - first,
        inference=None if scheduled is None else now - scheduled,
        time_per_output_token=(now - first) / (num_generated - 1) if first is not None and num_generated > 1
        else None,
        prompt_tokens=request.num_prompt_tokens, generation_tokens=num_generated,
        max_tokens=request.params.max_tokens)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:   # the event loop is closed: nobody is listening any more
        pass

"""Finding the request behind an engine step that raised without naming one (used by AsyncEngine).

A failure that names its requests (`exc.request_ids`) ends those. One that names none, with a single
request running, ends that one. Otherwise every request in the scheduler is parked: taken out of
the scheduler (pages freed, progress reset so it is recomputed later) and re-admitted one per
successful step; a failure while parked requests remain blames the request admitted last.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from moekv.engine.engine import Engine
from moekv.core.request import Request, RequestStatus

logger = logging.getLogger("moekv.async_engine")


class StepRecovery:
    """Finds the request behind a step failure that names none (engine thread only).

    After such a failure with several requests in the scheduler, all of them are parked: taken out
    of the scheduler (pages freed, progress reset so they are recomputed later) and re-admitted one
    per successful step. A failure while parked requests remain blames the request admitted last.
    Each failure ends at least one request or parks the rest, so recovery always terminates.
    """

    def __init__(self, engine: Engine, fail: Callable[[Request, str], None]):
        self.engine = engine
        self.fail = fail           # ends one request with an error message
        self.parked: deque[Request] = deque()
        self.last_admitted: Request | None = None

    @property
    def active(self) -> bool:
        return bool(self.parked) or self.last_admitted is not None

    def admitted(self, request: Request) -> None:
        """A new request while isolating waits its turn with the parked ones."""
        if self.active:
            self._park(request)

    def forget(self, request_id: str) -> None:
        self.parked = deque(r for r in self.parked if r.request_id != request_id)
        if self.last_admitted is not None and self.last_admitted.request_id == request_id:
            self.last_admitted = None

    def before_step(self) -> None:
        if self.parked and self.engine.scheduler.num_waiting == 0:
            request = self.parked.popleft()
            self.engine.scheduler.add(request)
            self.last_admitted = request

    def step_succeeded(self) -> None:
        if not self.parked:
            self.last_admitted = None

    def step_failed(self, exc: Exception) -> None:
        engine = self.engine
        named = [engine.requests[rid] for rid in (getattr(exc, "request_ids", None) or ()) if rid in engine.requests]
        in_scheduler = list(engine.scheduler.running) + list(engine.scheduler.waiting)
        message = f"the engine failed on this request: {type(exc).__name__}: {exc}"
        if named:
            culprits = named
        elif len(engine.scheduler.running) == 1 and not self.parked:
            culprits = list(engine.scheduler.running)
        elif self.last_admitted is not None and not self.last_admitted.status.is_finished:
            culprits = [self.last_admitted]
        else:
            culprits = []
        for request in culprits:
            if not request.status.is_finished:
                self.fail(request, message)
        self.last_admitted = None
        # Every other request may hold a partial write from the failed step: recompute it later.
        for request in in_scheduler:
            if not request.status.is_finished:
                self._park(request)
        if not culprits and not self.parked:
            logger.error("a step failed with no request to blame")

    def _park(self, request: Request) -> None:
        self.engine.scheduler.remove(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        if request not in self.parked:
            self.parked.append(request)

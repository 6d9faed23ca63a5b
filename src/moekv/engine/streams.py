"""What the asyncio side of the server holds of a request: the delta it streams (`StreamDelta`), the stream of one
HTTP request's engine requests (`RequestStream`), and the engine thread's records and commands
(engine/async_engine.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from moekv.errors import MoekvError
from moekv.sampling import SamplingParams


class Aborts(Protocol):
    """What a stream needs of its engine (the AsyncEngine)."""

    def abort(self, request_ids: Sequence[str]) -> None: ...


class EngineDeadError(MoekvError):
    """The engine loop has stopped; no request can be served."""


@dataclass(frozen=True)
class StreamDelta:
    """What happened to one request since its previous delta: the unit the server streams."""

    request_id: str
    token_ids: list[int]                        # new tokens
    text: str                                   # new visible text (held back while a stop string may match)
    logprobs: list[dict[int, float]] | None     # one {token_id: logprob} per new token, when asked
    finished: bool
    finish_reason: str | None                   # "stop" | "length" | "abort" | "error" once finished
    error: str | None                           # why, when finish_reason == "error"
    num_prompt_tokens: int
    num_output_tokens: int                      # total generated so far
    cumulative_logprob: float | None = None     # with best_of > n: the sequence's summed log-probability


@dataclass
class Tracked:
    """The engine thread's bookkeeping for one request whose outputs go to an asyncio queue."""

    request_id: str
    out_queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submit_time: float
    sent_tokens: int = 0
    sent_chars: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    scheduled_time: float | None = None   # start of the first step that ran it (queue time ends here)


@dataclass
class AddCommand:
    requests: list[tuple[str, list[int] | str, SamplingParams]]
    out_queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    submit_time: float = field(default_factory=time.monotonic)


class RequestStream:
    """The deltas of one or more engine requests (an OpenAI `n > 1` request shares one stream).

    Use as `async with stream: async for delta in stream: ...`; leaving the block early (an error, a
    cancelled task, a client that went away) aborts whatever is unfinished.
    """

    def __init__(self, engine: Aborts, request_ids: list[str], out_queue: asyncio.Queue):
        self.request_ids = list(request_ids)
        self._engine = engine
        self._queue = out_queue
        self._unfinished = set(request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if not self._unfinished:
            raise StopAsyncIteration
        delta: StreamDelta = await self._queue.get()
        if delta.finished:
            self._unfinished.discard(delta.request_id)
        return delta

    def abort(self) -> None:
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.abort()

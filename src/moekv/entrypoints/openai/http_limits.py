"""Connection limits uvicorn's h11 server lacks: a cap on open connections and a header timeout.

`limited_protocol(limits)` returns an `H11Protocol` subclass for `uvicorn.Config(http=...)`:
- one connection over `limits.max_connections` gets a 503 (OpenAI's error shape) and is closed at once;
- a connection that has not finished sending a request's headers `limits.header_timeout_s` after it
  opened (or after its previous response) gets a 408 and is closed, so sockets that trickle partial
  headers (slowloris) cannot pile up.
The keep-alive timeout is uvicorn's own (`timeout_keep_alive`); the body read timeout and the rejection
of ambiguous framing are ASGI middleware (server.py, `BodyLimitMiddleware`).
"""

from __future__ import annotations

import json
import logging
import time

from moekv.config import ServerLimits
from moekv.entrypoints.openai.protocol import error_body

logger = logging.getLogger("moekv.server")

WARN_EVERY_S = 10.0   # rejections are logged at most this often (a flood must not flood the log)


def raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection."""
    body = json.dumps(error_body(message, "server_error" if status >= 500 else "invalid_request_error",
                                 code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def limited_protocol(limits: ServerLimits):
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    too_many = raw_response(503, "Service Unavailable", f"too many open connections (the limit is "
                            f"{limits.max_connections}, --max-connections); retry later", "too_many_connections")
    too_slow = raw_response(408, "Request Timeout", f"the request headers did not arrive within "
                            f"{limits.header_timeout_s:g} s (--header-timeout)", "request_timeout")
    last_warning = {"rejected": 0.0, "timed_out": 0.0}

    def warn(kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - last_warning[kind] >= WARN_EVERY_S:
            last_warning[kind] = now
            logger.warning(message, *args)

    class LimitedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                warn("rejected", "rejecting connections: %d are open (--max-connections %d)",
                     len(self.connections) - 1, limits.max_connections)
                transport.write(too_many)
                transport.close()
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:   # still waiting for a request's headers
                self._arm_header_timer()
            else:
                self._cancel_header_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return   # a response is running (pipelining): its end re-arms the keep-alive timer
            warn("timed_out", "closing a connection whose request headers did not arrive within %g s "
                 "(--header-timeout)", limits.header_timeout_s)
            self.transport.write(too_slow)
            self.transport.close()

    return LimitedH11Protocol


def uvicorn_options(limits: ServerLimits) -> dict:
    """The `uvicorn.Config` keyword arguments that apply `limits`."""
    return {"http": limited_protocol(limits), "timeout_keep_alive": limits.keep_alive_timeout_s}

"""The FastAPI app: OpenAI-compatible routes, health, metrics, auth, body limit and error bodies.

`build_app(async_engine, config)` returns an app whose lifespan starts and stops the engine thread.
Every error leaves as `{"error": {"message", "type", "param", "code"}}` with no traceback text.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from moekv.engine.async_engine import AsyncEngine
from moekv.entrypoints.openai.protocol import (
    DEFAULT_CODES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    dump,
    error_body,
)
from moekv.entrypoints.openai.serving import ServerConfig, wrap_invalid
from moekv.entrypoints.openai.serving_chat import OpenAIChat
from moekv.entrypoints.openai.serving_completions import OpenAICompletions
from moekv.entrypoints.openai.serving_tokens import DetokenizeRequest, OpenAITokens, TokenizeRequest
from moekv.errors import InvalidRequestError
from moekv.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from moekv.version import __version__

logger = logging.getLogger("moekv.server")

OPEN_PATHS = ("/health", "/ping", "/metrics", "/version")   # never behind the API key


def build_app(async_engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics | None = None) -> FastAPI:
    """An app serving `async_engine`. Pass the `metrics` the engine was built with (or none)."""
    metrics = metrics if metrics is not None else async_engine.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = ContainedApp(title="moekv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    completions = OpenAICompletions(async_engine, config)
    chat = OpenAIChat(async_engine, config)
    tokens = OpenAITokens(async_engine, config)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(async_engine.dead_reason or "the engine is not running", "server_error",
                                       code="engine_unavailable"), status_code=503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:      # vLLM (SageMaker): the same answer as /health
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return tokens.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return tokens.detokenize(body)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=config.served_model_name, max_model_len=async_engine.engine.max_model_len)
                 for name in config.model_names]
        return dump(ModelList(data=cards))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return _respond(await completions.create(body, request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return _respond(await chat.create(body, request))

    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes,
                       read_timeout_s=config.limits.read_timeout_s)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app


class ContainedApp(FastAPI):
    """FastAPI whose exceptions never reach the server: Starlette answers 500 (`unexpected` below logs it)
    and then re-raises, which makes uvicorn log a second traceback and drop the keep-alive connection.
    Here the re-raise stops; a response cut mid-body is at least ended properly."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        started = ended = False

        async def tracking_send(message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await super().__call__(scope, receive, tracking_send)
        except Exception:
            try:
                if not started:   # the 500 itself could not be sent
                    logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
                    body = JSONResponse(error_body("internal server error", "server_error", code="internal_error"),
                                        500)
                    await body(scope, receive, send)
                elif not ended:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:     # the connection is gone
                pass


def _respond(result) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return EventStream(result)


class EventStream(StreamingResponse):
    """Server-sent events that notice a client going away even while no token is due.

    Starlette only watches for `http.disconnect` under ASGI < 2.4; we always do, so an idle stream
    (a request still queued) is cancelled at once, and its generator's exit aborts the requests.
    """

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        import anyio

        async with anyio.create_task_group() as group:
            async def stream_then_stop() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass   # the socket closed under us: the client is gone
                group.cancel_scope.cancel()

            group.start_soon(stream_then_stop)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


# -- errors -------------------------------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError) -> Response:
        error = wrap_invalid(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body("the request body is not valid JSON", code="invalid_json"), 400)
        if first.get("type") == "invalid_unicode":
            param = (first.get("ctx") or {}).get("param")
            return JSONResponse(error_body(str(first.get("msg")), param=param, code="invalid_unicode"), 400)
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = location[0] if location else None
        same_param = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == location[:1]]
        if len(same_param) > 1:   # a union: say what was expected in a few words, not every branch's path
            reasons = list(dict.fromkeys(e.get("msg", "invalid value") for e in same_param))
            message = f"{param}: invalid value ({'; '.join(reasons[:3])})"
        else:
            message = f"{'.'.join(location) or 'the request body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(message, param=param, code="invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own 400 means the body could not be parsed (e.g. JSON nested too deep)
        code = "invalid_json" if exc.status_code == 400 else DEFAULT_CODES.get(exc.status_code,
                                                                               f"http_{exc.status_code}")
        return JSONResponse(error_body(str(exc.detail), code=code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "server_error", code="internal_error"), 500)


# -- middleware (pure ASGI, so streaming and disconnect detection pass through untouched) ---------------
class BodyLimitMiddleware:
    """The request body's guard: 400 for ambiguous framing (both Content-Length and Transfer-Encoding, or
    several Content-Lengths: a request-smuggling vector), 413 for a body over `max_bytes` (by its
    Content-Length or as it streams in), 408 when the next piece of the body takes over `read_timeout_s`."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float | None = None):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        lengths = [value for name, value in headers if name == b"content-length"]
        if len(lengths) > 1 or (lengths and any(name == b"transfer-encoding" for name, _ in headers)):
            response = JSONResponse(error_body("ambiguous request framing: send either Content-Length or "
                                               "Transfer-Encoding, once", code="ambiguous_framing"),
                                    status_code=400, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        if lengths and lengths[0].isdigit() and int(lengths[0]) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        received, body_done = 0, False

        async def guarded_receive():
            nonlocal received, body_done
            if body_done or self.read_timeout_s is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), self.read_timeout_s)
                except asyncio.TimeoutError:
                    raise HTTPException(408, f"the request body stalled for {self.read_timeout_s:g} s "
                                             f"(--read-timeout)") from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())  # FastAPI re-raises its own
            return message

        await self.app(scope, guarded_receive, send)

    def _message(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes (--max-request-bytes)"

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse(error_body(self._message(), code="request_too_large"), status_code=413)
        await response(scope, receive, send)


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>`; /health and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            message = "missing API key" if not header else "incorrect API key"
            response = JSONResponse(error_body(f"{message}: send `Authorization: Bearer <key>`",
                                               code="invalid_api_key"), status_code=401)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

"""What completions and chat completions share: prompts -> token ids, OpenAI fields -> SamplingParams,
submitting `n` engine requests per prompt, collecting or streaming their deltas, logprobs formatting.

`OpenAICompletions.create` and `OpenAIChat.create` (serving_completions.py, serving_chat.py) return a
JSON-able dict or an async iterator of SSE strings; server.py turns those into responses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import Request as HTTPRequest

from moekv.config import ServerLimits
from moekv.engine.async_engine import AsyncEngine
from moekv.engine.streams import EngineDeadError, RequestStream, StreamDelta
from moekv.entrypoints.openai.protocol import APIError, UsageInfo, _SamplingRequest, error_body
from moekv.errors import InvalidRequestError
from moekv.sampling import SamplingParams, StructuredOutputParams

logger = logging.getLogger("moekv.server")

MAX_CHOICES = 256   # prompts x n in one request


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs besides the engine."""

    served_model_name: str
    model_path: str = ""
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    chat_template: str | None = None        # template text overriding the tokenizer's (--chat-template)
    tool_call_parser: str | None = None     # --tool-call-parser: hermes, qwen, mistral (tool_choice auto)
    limits: ServerLimits = field(default_factory=ServerLimits)   # connections and timeouts
    default_max_tokens: int | None = None   # chat without max_tokens (--max-tokens-default); None: the context
    served_model_aliases: tuple[str, ...] = ()   # more names requests may use (--served-model-name A B ...)
    max_logprobs: int = 20                  # --max-logprobs: the most logprobs / top_logprobs a request asks
    log_requests: bool = False              # --enable-log-requests: a log line per request queued

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str                 # for echo (decoded when the prompt came as token ids)


@dataclass
class Choice:
    """One generated sequence as it accumulates (non-streamed responses, usage counting)."""

    index: int
    prompt_index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None     # best_of > n: what ranks the sequences


class OpenAIServing:
    """Shared machinery of the two generation endpoints."""

    def __init__(self, async_engine: AsyncEngine, config: ServerConfig):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.config = config
        self.max_model_len = self.engine.max_model_len

    # -- validation ---------------------------------------------------------------------------------
    def check_request(self, body: _SamplingRequest) -> None:
        if body.model is not None and body.model not in self.config.model_names:
            raise APIError(404, f"the model `{body.model}` does not exist; this server serves "
                                f"`{self.config.served_model_name}`", param="model", code="model_not_found")
        for param in ("logprobs", "top_logprobs"):
            asked = getattr(body, param, None)
            if isinstance(asked, int) and not isinstance(asked, bool) and asked > self.config.max_logprobs:
                raise APIError(400, f"{param}={asked} exceeds this server's limit of {self.config.max_logprobs} "
                                    "(--max-logprobs)", param=param)
        problem = body.unsupported()
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0], code="unsupported_parameter")

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids", param=param)
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not token_ids:
            raise APIError(400, "the prompt is empty", param=param)
        return token_ids

    def check_token_ids(self, token_ids: list[int], param: str) -> list[int]:
        """Token ids in [0, vocab_size), checked before anything (the tokenizer's decode) touches them."""
        vocab_size = self.engine.arch.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                shown = token_id if abs(token_id) < 1 << 64 else ("a huge negative number" if token_id < 0
                                                                 else "a huge number")
                raise APIError(400, f"token id {shown} is outside the vocabulary [0, {vocab_size})",
                               param=param, code="invalid_value")
        return list(token_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def max_tokens(self, asked: int | None, default: int | None, num_prompt_tokens: int, param: str) -> int:
        """The generation budget: `asked` must fit in the context; `default` (None: all) is clamped."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"the prompt is {num_prompt_tokens} tokens and this model's maximum context "
                                f"length (max_model_len) is {self.max_model_len} tokens: no room is left to "
                                f"generate; shorten the prompt", param=param, code="context_length_exceeded")
        if asked is None:
            return room if default is None else min(default, room)
        if asked >= 1 and num_prompt_tokens + asked > self.max_model_len:
            raise APIError(400, f"this model's maximum context length (max_model_len) is {self.max_model_len} "
                                f"tokens; the prompt is {num_prompt_tokens} tokens and max_tokens is {asked} "
                                f"({num_prompt_tokens + asked} in all); lower max_tokens or shorten the prompt",
                           param="max_tokens", code="context_length_exceeded")
        return asked

    def sampling_params(self, body: _SamplingRequest, max_tokens: int, logprobs: int | None,
                        seed: int | None, **extra) -> SamplingParams:
        """One engine request's params (n / best_of fan out in `submit`; InvalidRequestError -> 400).
        A field the request leaves out takes the checkpoint's generation_config.json value (vLLM's
        `--generation-config auto`), else OpenAI's default."""
        defaults = getattr(self.engine, "generation_defaults", None) or {}
        top_k = body.top_k if body.top_k is not None else int(defaults.get("top_k", 0))
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(defaults.get("temperature", 1.0)) if body.temperature is None else body.temperature,
            top_p=float(defaults.get("top_p", 1.0)) if body.top_p is None else body.top_p,
            top_k=-1 if top_k in (-1, 0) else top_k,
            seed=seed, stop=body.stop, stop_token_ids=body.stop_token_ids, logprobs=logprobs,
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(float(defaults.get("repetition_penalty", 1.0)) if body.repetition_penalty is None
                                else body.repetition_penalty),
            min_tokens=body.min_tokens or 0, logit_bias=body.logit_bias,
            **{"structured_outputs": structured_outputs(body), **extra})

    # -- running ------------------------------------------------------------------------------------
    async def submit(self, request_id: str, body: _SamplingRequest, prompts: list[Prompt],
                     max_tokens: list[int], logprobs: int | None,
                     **extra) -> tuple[RequestStream, dict[str, Choice]]:
        """Queue best_of (else n) engine requests per prompt; choice i*k+j is prompt i's j-th sample
        (seed + index); `keep_best` then keeps n of each prompt's k when best_of > n."""
        best_of = getattr(body, "best_of", None)
        per_prompt = best_of or body.n
        if len(prompts) * per_prompt > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x {per_prompt} sequences (n, best_of) exceeds "
                                f"{MAX_CHOICES} sequences per request", param="best_of" if best_of else "n")
        triples, choices = [], {}
        for prompt_index, (prompt, budget) in enumerate(zip(prompts, max_tokens)):
            for sample in range(per_prompt):
                index = prompt_index * per_prompt + sample
                seed = None if body.seed is None else (body.seed + index) % (1 << 64)   # any int is a seed
                params = self.sampling_params(body, budget, logprobs, seed, n=body.n, best_of=best_of, **extra)
                engine_id = f"{request_id}-{index}"
                triples.append((engine_id, prompt.token_ids, params))
                choices[engine_id] = Choice(index, prompt_index)
        if self.config.log_requests:
            logger.info("request %s: %d prompt(s), %s prompt tokens, %d sequence(s), max_tokens %s", request_id,
                        len(prompts), [len(p.token_ids) for p in prompts], len(triples), max_tokens)
        try:
            stream = await self.async_engine.add(triples)
        except InvalidRequestError as exc:      # a grammar the library rejects: name the request's field
            if exc.param == "structured_outputs":
                raise APIError(400, str(exc), param="response_format") from None
            raise
        except EngineDeadError as exc:
            raise APIError(503, f"the engine is not running: {exc}", type="server_error",
                           code="engine_unavailable") from None
        return stream, choices

    @staticmethod
    def check_delta(delta: StreamDelta) -> None:
        if delta.finish_reason == "error":
            raise APIError(500, f"generation failed: {delta.error}", type="server_error", code="generation_error")
        if delta.finish_reason == "abort":
            raise APIError(503, "the request was aborted (the server is stopping)", type="server_error",
                           code="aborted")

    async def collect(self, stream: RequestStream, choices: dict[str, Choice],
                      http_request: HTTPRequest) -> list[Choice]:
        """Run a stream to its end (aborting it if the client goes away); choices in index order."""
        async def consume() -> None:
            async for delta in stream:
                self.check_delta(delta)
                choice = choices[delta.request_id]
                choice.token_ids.extend(delta.token_ids)
                choice.text += delta.text
                if delta.logprobs:
                    choice.logprobs.extend(delta.logprobs)
                if delta.finished:
                    choice.finish_reason = delta.finish_reason
                    choice.cumulative_logprob = delta.cumulative_logprob

        async with stream:
            await until_disconnected(http_request, consume())
        return sorted(choices.values(), key=lambda c: c.index)

    @staticmethod
    def keep_best(done: list[Choice], n: int) -> list[Choice]:
        """Each prompt's n sequences of highest cumulative log-probability, renumbered prompt i * n + rank."""
        kept = []
        for prompt_index in sorted({c.prompt_index for c in done}):
            mine = sorted((c for c in done if c.prompt_index == prompt_index), key=_score, reverse=True)
            for rank, choice in enumerate(mine[:n]):
                choice.index = prompt_index * n + rank
                kept.append(choice)
        return kept

    @staticmethod
    def usage(prompts: list[Prompt], choices) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    async def stream_events(self, stream: RequestStream, choices: dict[str, Choice],
                            first_chunks: list[dict], chunk_of: Callable[[Choice, StreamDelta], dict],
                            usage_chunk: Callable[[], dict] | None) -> AsyncIterator[str]:
        """SSE lines: the first chunks, one chunk per delta, the usage chunk if asked, then [DONE].

        An error after the stream started is sent as a `data: {"error": ...}` event before [DONE].
        Leaving early (the client went away) aborts the unfinished requests.
        """
        async with stream:
            try:
                for chunk in first_chunks:
                    yield sse(chunk)
                async for delta in stream:
                    self.check_delta(delta)
                    choice = choices[delta.request_id]
                    choice.token_ids.extend(delta.token_ids)
                    if delta.finished:
                        choice.finish_reason = delta.finish_reason
                    yield sse(chunk_of(choice, delta))
                if usage_chunk is not None:
                    yield sse(usage_chunk())
            except APIError as exc:
                yield sse(exc.body())
            except Exception:
                logger.exception("streaming failed")
                yield sse(error_body("internal server error", "server_error", code="internal_error"))
        yield "data: [DONE]\n\n"


def _score(choice: Choice) -> float:
    return choice.cumulative_logprob if choice.cumulative_logprob is not None else float("-inf")


def structured_outputs(body: _SamplingRequest) -> StructuredOutputParams | None:
    """response_format -> the grammar to decode under (None for text)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError(400, "response_format of type json_schema needs json_schema.schema", param="response_format")
    try:
        return StructuredOutputParams(json=fmt.json_schema.json_schema)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="response_format") from None


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def until_disconnected(http_request: HTTPRequest, work: Awaitable[None]) -> None:
    """Await `work`; if the client disconnects first, cancel it (its stream's exit aborts the requests)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(http_request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            try:
                await work_task
            except asyncio.CancelledError:
                pass
            raise APIError(499, "the client closed the connection", code="client_closed_request")
    work_task.result()


async def _wait_disconnect(http_request: HTTPRequest) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def wrap_invalid(exc: InvalidRequestError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code="invalid_value")

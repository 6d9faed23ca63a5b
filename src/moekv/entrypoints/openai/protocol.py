"""The OpenAI wire format: request bodies (validated by pydantic), responses, and the error body.

Nothing is silently ignored: every field is modelled and honoured, except the few in IGNORED_FIELDS
(bookkeeping that cannot change the output, such as `user`), which are accepted and dropped; any other
field, an OpenAI one moekv does not implement or an unknown one, is a 400 naming it
(`_SamplingRequest.unsupported`). docs/serving.md lists them all.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

# The `code` an error carries when the raiser names none: every error body has a non-null code.
DEFAULT_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                 408: "request_timeout", 413: "request_too_large", 499: "client_closed_request", 500: "internal_error",
                 503: "engine_unavailable"}


# -- errors -------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error the server answers with `{"error": {message, type, param, code}}` and `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        code = code if code is not None else DEFAULT_CODES.get(status, f"http_{status}")
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests -----------------------------------------------------------------------------------------
# OpenAI request fields that cannot change what is generated: accepted, and ignored.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})

# OpenAI request fields moekv does not implement (any value is a 400; so is a field nobody defines).
NOT_IMPLEMENTED = {
    "audio": "audio output", "modalities": "output modalities other than text", "prediction": "predicted outputs",
    "reasoning_effort": "reasoning effort", "verbosity": "verbosity", "web_search_options": "web search",
    "functions": "the deprecated `functions` (use `tools`)", "function_call": "the deprecated `function_call` "
    "(use `tool_choice`)",
}


def _find_surrogate(value: Any) -> tuple | None:
    """The path to the first string (value or key) holding a lone surrogate, else None (no recursion:
    JSON may nest as deep as the parser allows)."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            stack.extend((v, path + (k,)) for k, v in reversed(item.items()))
            stack.extend((k, path + (k,)) for k in item)
        elif isinstance(item, list):   # token ids are most of a big body: skip numbers cheaply
            stack.extend((v, path + (i,)) for i, v in reversed(list(enumerate(item)))
                         if isinstance(v, (str, dict, list)))
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None                # the output always follows the schema (strict or not)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may spell lone surrogates (`"\\ud800"`), which no tokenizer or UTF-8 encoder takes: a 400."""
        path = _find_surrogate(data)
        if path is not None:
            param = str(path[0] if path else "body").encode("utf-8", "backslashreplace").decode("ascii")
            raise PydanticCustomError("invalid_unicode", "{param}: the text holds a lone UTF-16 surrogate "
                                      "(not valid Unicode)", {"param": param})
        return data

    model: str | None = None                  # None: the served model
    temperature: float | None = None          # default 1.0
    top_p: float | None = None                # default 1.0
    top_k: int | None = None                  # extra body field (vLLM-style); None / -1 / 0: off
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None   # extra body field
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                  # extra body field
    presence_penalty: float | None = None     # -2..2
    frequency_penalty: float | None = None    # -2..2
    repetition_penalty: float | None = None   # extra body field (vLLM-style): > 0, 1 is off
    min_tokens: int | None = None             # extra body field: EOS / stop tokens banned until this many
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> -100..100
    response_format: ResponseFormat | None = None  # json_object / json_schema: grammar-constrained decoding

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a field moekv does not implement, or cannot honour with this value."""
        for name in self.model_extra or {}:
            if name in IGNORED_FIELDS:
                continue
            if name == "modalities" and self.model_extra[name] in (None, ["text"]):
                continue
            if name in NOT_IMPLEMENTED:
                return name, f"{name} is not supported: moekv does not implement {NOT_IMPLEMENTED[name]}"
            return name, f"{name} is not a supported request field (docs/serving.md lists them)"
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str | list[int]]   # text, token ids, or a batch of either
    max_tokens: int | None = None             # default: 16, or what fits in the context
    logprobs: int | None = Field(None, ge=0)   # at most --max-logprobs (serving)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported (moekv does not insert text)"
        if self.best_of is not None and self.best_of > self.n and self.stream:
            return "best_of", "best_of > n cannot be streamed (the best sequences are known only at the end)"
        if self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs is not supported (prompt log-probabilities are not computed)"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None            # a JSON schema
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str                            # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None           # a tool turn: the call it answers

    def text(self) -> str:
        """The message's content as one string; only text parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                               param="messages")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # takes precedence over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)   # at most --max-logprobs (serving)
    add_generation_prompt: bool = True        # extra body field
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None   # false: at most one call (required / named force it)

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        return super().unsupported()


# -- responses ----------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "moekv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")

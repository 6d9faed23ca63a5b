"""/tokenize and /detokenize, as vLLM answers them.

POST /tokenize takes either `prompt` (+ `add_special_tokens`, default true) or chat `messages`
(+ `add_generation_prompt`, default true; `add_special_tokens` by default as /v1/chat/completions
does: a BOS only when the template wrote none), and `return_token_strs`; it answers `{"count", "max_model_len", "tokens", "token_strs"}`.
POST /detokenize takes `tokens` and answers `{"prompt"}`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from moekv.engine.async_engine import AsyncEngine
from moekv.entrypoints.openai.chat_tools import template_messages
from moekv.entrypoints.openai.protocol import APIError, ChatMessage
from moekv.entrypoints.openai.serving import ServerConfig


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None    # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


class OpenAITokens:
    """Tokenizer endpoints over the engine's tokenizer."""

    def __init__(self, async_engine: AsyncEngine, config: ServerConfig):
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.config = config

    def _check(self, model: str | None, param: str) -> None:
        if model is not None and model not in self.config.model_names:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"`{self.config.served_model_name}`", param="model", code="model_not_found")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (tokenizer.json)", param=param)

    def tokenize(self, body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`",
                           param="prompt" if body.prompt is None else "messages")
        self._check(body.model, "prompt" if body.prompt is not None else "messages")
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = self.tokenizer.encode(body.prompt, add_special_tokens=add_special)
        else:
            text = self.tokenizer.apply_chat_template(template_messages(body),
                                                      add_generation_prompt=body.add_generation_prompt,
                                                      template=self.config.chat_template)
            tokens = (self.tokenizer.encode_rendered(text) if body.add_special_tokens is None   # as chat does
                      else self.tokenizer.encode(text, add_special_tokens=body.add_special_tokens))
        strs = None
        if body.return_token_strs:
            strs = [self.tokenizer.id_to_token(t) or "" for t in tokens]
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens,
                                token_strs=strs).model_dump(mode="json")

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self._check(body.model, "tokens")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

"""POST /v1/chat/completions: messages -> the chat template -> one prompt -> n choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest

from moekv.engine.streams import StreamDelta
from moekv.entrypoints.openai.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    dump,
)
from moekv.entrypoints.openai.serving import Choice, OpenAIServing, Prompt, new_request_id


class OpenAIChat(OpenAIServing):
    async def create(self, body: ChatCompletionRequest, http_request: HTTPRequest) -> dict | AsyncIterator[str]:
        self.check_request(body)
        prompt = self.render(body)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        budget = self.max_tokens(asked, None, len(prompt.token_ids), "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        request_id = new_request_id("chatcmpl")
        stream, choices = await self.submit(request_id, body, [prompt], [budget], top)
        model = self.config.served_model_name
        created = int(time.time())
        if not body.stream:
            done = await self.collect(stream, choices, http_request)
            return dump(ChatCompletionResponse(
                id=request_id, created=created, model=model, usage=self.usage([prompt], done),
                choices=[ChatChoice(
                    index=c.index, finish_reason=c.finish_reason, message=ChatResponseMessage(content=c.text),
                    logprobs=self.logprobs(c.token_ids, c.logprobs, top) if top is not None else None)
                    for c in done]))

        def chunk(choices_: list[ChatChunkChoice], usage=None) -> dict:
            return dump(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices_,
                                            usage=usage))

        def chunk_of(choice: Choice, delta: StreamDelta) -> dict:
            logprobs = self.logprobs(delta.token_ids, delta.logprobs or [], top) if top is not None else None
            return chunk([ChatChunkChoice(index=choice.index, delta=DeltaMessage(content=delta.text),
                                          logprobs=logprobs, finish_reason=delta.finish_reason)])

        first_chunks = [chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
                        for c in sorted(choices.values(), key=lambda c: c.index)]
        usage_chunk = (lambda: chunk([], self.usage([prompt], choices.values()))) if body.include_usage else None
        return self.stream_events(stream, choices, first_chunks, chunk_of, usage_chunk)

    def render(self, body: ChatCompletionRequest) -> Prompt:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot render chat messages; use "
                                "/v1/completions with token ids", param="messages")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                  template=self.config.chat_template)
        # A template that writes the BOS token itself must not get a second one from the tokenizer.
        bos = self.tokenizer.bos_token
        add_special = not (bos and text.startswith(bos))
        return Prompt(self.encode(text, "messages", add_special_tokens=add_special), text)

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], top: int) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            text = self.token_text(token_id)
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
            content.append(TokenLogprob(
                token=text, logprob=entry.get(token_id, float("-inf")), bytes=list(text.encode("utf-8")),
                top_logprobs=[TopLogprob(token=self.token_text(t), logprob=v,
                                         bytes=list(self.token_text(t).encode("utf-8"))) for t, v in best]))
        return ChatLogprobs(content=content)

"""POST /v1/completions: prompts (text or token ids, one or many) -> n choices each."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest

from moekv.engine.streams import StreamDelta
from moekv.entrypoints.openai.protocol import (
    APIError,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    dump,
)
from moekv.entrypoints.openai.serving import Choice, OpenAIServing, Prompt, new_request_id

DEFAULT_MAX_TOKENS = 16   # OpenAI's default for completions


class OpenAICompletions(OpenAIServing):
    async def create(self, body: CompletionRequest, http_request: HTTPRequest) -> dict | AsyncIterator[str]:
        self.check_request(body)
        prompts = self.prompts(body.prompt)
        budgets = [self.max_tokens(body.max_tokens, DEFAULT_MAX_TOKENS, len(p.token_ids), "prompt")
                   for p in prompts]
        request_id = new_request_id("cmpl")
        stream, choices = await self.submit(request_id, body, prompts, budgets, body.logprobs)
        model = self.config.served_model_name
        created = int(time.time())
        if not body.stream:
            done = await self.collect(stream, choices, http_request)
            usage = self.usage(prompts, done)                  # best_of: every generated sequence counts
            if body.best_of is not None and body.best_of > body.n:
                done = self.keep_best(done, body.n)
            return dump(CompletionResponse(
                id=request_id, created=created, model=model, usage=usage,
                choices=[CompletionChoice(
                    index=c.index, finish_reason=c.finish_reason,
                    text=(prompts[c.prompt_index].text if body.echo else "") + c.text,
                    logprobs=self.logprobs(c.token_ids, c.logprobs, 0) if body.logprobs is not None else None)
                    for c in done]))

        offsets = {c.index: 0 for c in choices.values()}

        def chunk_of(choice: Choice, delta: StreamDelta) -> dict:
            logprobs = None
            if body.logprobs is not None:
                logprobs = self.logprobs(delta.token_ids, delta.logprobs or [], offsets[choice.index])
                offsets[choice.index] += sum(len(t) for t in logprobs.tokens)
            return dump(CompletionChunk(id=request_id, created=created, model=model, choices=[CompletionChoice(
                index=choice.index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason)]))

        first_chunks = []
        if body.echo:
            for c in sorted(choices.values(), key=lambda c: c.index):
                first_chunks.append(dump(CompletionChunk(id=request_id, created=created, model=model, choices=[
                    CompletionChoice(index=c.index, text=prompts[c.prompt_index].text)])))

        def usage_chunk() -> dict:
            return dump(CompletionChunk(id=request_id, created=created, model=model, choices=[],
                                        usage=self.usage(prompts, choices.values())))

        return self.stream_events(stream, choices, first_chunks, chunk_of,
                                  usage_chunk if body.include_usage else None)

    def prompts(self, prompt) -> list[Prompt]:
        """Text, token ids, or a list of either -> prompts (token ids are checked by the engine)."""
        if isinstance(prompt, str):
            return [Prompt(self.encode(prompt, "prompt"), prompt)]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            token_ids = self.check_token_ids(prompt, "prompt")
            return [Prompt(token_ids, self.decode(token_ids))]
        out = []
        for item in prompt:
            if isinstance(item, str):
                out.append(Prompt(self.encode(item, "prompt"), item))
            elif item:
                token_ids = self.check_token_ids(item, "prompt")
                out.append(Prompt(token_ids, self.decode(token_ids)))
            else:
                raise APIError(400, "a prompt in the list is empty", param="prompt")
        return out

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int) -> CompletionLogprobs:
        """OpenAI's legacy logprobs: token strings, their logprobs, top alternatives, text offsets."""
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs):
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(entry.get(token_id))
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            out.top_logprobs.append({self.token_text(t): v for t, v in top})
            out.text_offset.append(offset)
            offset += len(text)
        return out

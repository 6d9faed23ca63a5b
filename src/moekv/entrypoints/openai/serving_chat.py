"""POST /v1/chat/completions: messages (+ tools) -> the chat template -> one prompt -> n choices, with tool
calls parsed or forced as chat_tools.py decides."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest

from moekv.engine.streams import StreamDelta
from moekv.entrypoints.openai.chat_tools import ToolPlan, ToolStreamer, new_call_id, plan_tools, template_messages
from moekv.entrypoints.openai.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    dump,
)
from moekv.entrypoints.openai.serving import Choice, OpenAIServing, Prompt, new_request_id


class OpenAIChat(OpenAIServing):
    async def create(self, body: ChatCompletionRequest, http_request: HTTPRequest) -> dict | AsyncIterator[str]:
        self.check_request(body)
        plan = plan_tools(body, self.config.tool_call_parser, self._renders_tools)
        prompt = self.render(body, plan)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        budget = self.max_tokens(asked, self.config.default_max_tokens, len(prompt.token_ids), "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        request_id = new_request_id("chatcmpl")
        extra = {"structured_outputs": plan.structured} if plan.structured is not None else {}
        stream, choices = await self.submit(request_id, body, [prompt], [budget], top, **extra)
        model = self.config.served_model_name
        created = int(time.time())
        if not body.stream:
            done = await self.collect(stream, choices, http_request)
            return dump(ChatCompletionResponse(
                id=request_id, created=created, model=model, usage=self.usage([prompt], done),
                choices=[self.choice(plan, c, top) for c in done]))

        def chunk(choices_: list[ChatChunkChoice], usage=None) -> dict:
            return dump(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices_,
                                            usage=usage))

        streamers: dict[int, ToolStreamer] = {c.index: plan.streamer() for c in choices.values()}
        sent_calls: dict[int, int] = {c.index: 0 for c in choices.values()}

        def chunk_of(choice: Choice, delta: StreamDelta) -> dict:
            logprobs = self.logprobs(delta.token_ids, delta.logprobs or [], top) if top is not None else None
            streamer = streamers[choice.index]
            content, calls = streamer.feed(delta.text)
            finish_reason = delta.finish_reason
            if delta.finished:
                more, more_calls = streamer.finish()
                content = (content or "") + (more or "") or None
                calls = calls + more_calls
                if streamer.any_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            tool_deltas = []
            for call in calls:
                tool_deltas.append(DeltaToolCall(index=sent_calls[choice.index], id=new_call_id(), type="function",
                                                 function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                sent_calls[choice.index] += 1
            return chunk([ChatChunkChoice(index=choice.index, logprobs=logprobs, finish_reason=finish_reason,
                                          delta=DeltaMessage(content=content if content or not tool_deltas else None,
                                                             tool_calls=tool_deltas or None))])

        first_chunks = [chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
                        for c in sorted(choices.values(), key=lambda c: c.index)]
        usage_chunk = (lambda: chunk([], self.usage([prompt], choices.values()))) if body.include_usage else None
        return self.stream_events(stream, choices, first_chunks, chunk_of, usage_chunk)

    def choice(self, plan: ToolPlan, c: Choice, top: int | None) -> ChatChoice:
        content, calls = plan.parse(c.text) if plan.mode not in ("off", "none") else (c.text, [])
        finish_reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        message = ChatResponseMessage(content=content if calls else c.text, tool_calls=[
            ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in calls] or None)
        return ChatChoice(index=c.index, finish_reason=finish_reason, message=message,
                          logprobs=self.logprobs(c.token_ids, c.logprobs, top) if top is not None else None)

    def _renders_tools(self) -> bool:
        return self.tokenizer is not None and self.tokenizer.template_renders_tools(self.config.chat_template)

    def render(self, body: ChatCompletionRequest, plan: ToolPlan) -> Prompt:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot render chat messages; use "
                                "/v1/completions with token ids", param="messages")
        text = self.tokenizer.apply_chat_template(template_messages(body), add_generation_prompt=body.add_generation_prompt,
                                                  template=self.config.chat_template, tools=plan.tools)
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

"""Tools on /v1/chat/completions: what `tools` + `tool_choice` mean for one request (`plan_tools`), the
messages and tools as chat templates expect them (`template_messages`), and the answer's tool calls.

- `none`: the tools are rendered, the output is text.
- `auto` (the default when tools are given): the output is parsed by the server's `--tool-call-parser`.
- `required` / a named function: the output is forced by a grammar (structured outputs) to a JSON list of
  `{"name", "arguments"}` calls of the given tools (required), or to the named function's arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from moekv.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from moekv.entrypoints.openai.tool_parsers import PARSERS, ParsedToolCall, StreamingToolParser, ToolParser
from moekv.sampling import StructuredOutputParams


@dataclass(frozen=True)
class ToolPlan:
    mode: str                                  # "off" (no tools), "none", "auto", "named", "required"
    tools: list[dict] | None = None            # for the chat template, as transformers passes them
    parser: ToolParser | None = None           # auto
    name: str | None = None                    # named
    structured: StructuredOutputParams | None = None   # named / required: the forcing grammar
    single: bool = False                       # parallel_tool_calls=false: auto keeps the first call only

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """A finished choice's text -> (content, calls)."""
        if self.mode == "auto":
            content, calls = self.parser.parse(text)
            return content, calls[:1] if self.single else calls
        if self.mode in ("named", "required"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return text, []                # cut by max_tokens: hand the text back
            if self.mode == "named":
                return None, [ParsedToolCall(self.name, json.dumps(value, ensure_ascii=False))]
            return None, [ParsedToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]
        return text, []

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)


class ToolStreamer:
    """One streamed choice: `feed(delta_text)` / `finish()` -> (content delta, calls to send)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.stream = StreamingToolParser(plan.parser) if plan.mode == "auto" else None
        self.text = ""
        self.any_calls = False

    def feed(self, delta: str) -> tuple[str | None, list[ParsedToolCall]]:
        if self.stream is not None:
            return self._note(self.stream.feed(delta))
        if self.plan.mode in ("named", "required"):
            self.text += delta                      # the calls are known when the JSON is complete
            return None, []
        return delta, []

    def finish(self) -> tuple[str | None, list[ParsedToolCall]]:
        if self.stream is not None:
            return self._note(self.stream.finish())
        if self.plan.mode in ("named", "required"):
            return self._note(self.plan.parse(self.text))
        return None, []

    def _note(self, result):
        content, calls = result
        if self.plan.single and self.any_calls:
            calls = []
        calls = calls[:1] if self.plan.single else calls
        self.any_calls = self.any_calls or bool(calls)
        return content, calls


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def plan_tools(body: ChatCompletionRequest, tool_call_parser: str | None, renders_tools) -> ToolPlan:
    """Check `tools` / `tool_choice` / `parallel_tool_calls` and decide how this request uses them.
    `renders_tools()` says whether the chat template reads `tools` (else they would be dropped: a 400)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan("off")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    if not renders_tools():
        raise APIError(400, "this model's chat template does not render tools (it never reads `tools`); "
                            "pass a template that does with --chat-template", param="tools")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "response_format cannot be combined with tool calls (use tool_choice none)",
                       param="response_format")
    if choice == "auto":
        if tool_call_parser is None:
            raise APIError(400, "tool_choice auto needs a tool-call parser: start the server with "
                                "--tool-call-parser (hermes, qwen, mistral)", param="tool_choice")
        return ToolPlan("auto", tools, parser=PARSERS[tool_call_parser](), single=body.parallel_tool_calls is False)
    parameters = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in body.tools}
    if choice == "required":
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                            "required": ["name", "arguments"], "additionalProperties": False}
                           for name, schema in parameters.items()]}
        schema = {"type": "array", "items": calls, "minItems": 1}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, structured=StructuredOutputParams(json=schema))
    name = choice.function.name
    if name not in parameters:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
    return ToolPlan("named", tools, name=name, structured=StructuredOutputParams(json=parameters[name]))


def template_messages(body: ChatCompletionRequest) -> list[dict]:
    """The messages as HF chat templates read them: tool calls' arguments as objects, tool results with
    their `tool_call_id`."""
    out = []
    for message in body.messages:
        entry: dict = {"role": message.role, "content": message.text()}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    raise APIError(400, f"the arguments of tool call {call.id!r} are not JSON",
                                   param="messages") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            entry["tool_calls"] = calls
            if message.content is None:
                entry["content"] = None
        out.append(entry)
    return out

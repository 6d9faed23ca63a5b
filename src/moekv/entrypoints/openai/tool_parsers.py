"""Tool calls parsed from a model's text, one parser per model family (`--tool-call-parser`):

- `hermes` / `qwen`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them
  (Hermes 2 Pro, Qwen2.5, Qwen3);
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` objects, or (tokenizer v11+)
  `[TOOL_CALLS]name[ARGS]{...}` per call.

`parse(text)` returns the text outside the calls (None when empty) and the calls; a call whose JSON does
not parse is left in the text. `StreamingToolParser` does the same on a growing text: content up to the
first marker streams at once (a possible start of the marker is held back), each call is sent whole as
soon as it is complete, and what is left at the end is parsed like the whole text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str            # JSON text, as OpenAI returns it


def _call_from(obj) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    marker: str = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        raise NotImplementedError

    def complete_calls(self, section: str) -> list[ParsedToolCall]:
        """The calls already complete in the text from the first marker on (streaming); default: none
        until the end."""
        return []


class HermesToolParser(ToolParser):
    marker = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        calls, kept, end = [], [], 0
        for match in self._call.finditer(text):
            try:
                call = _call_from(json.loads(match.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue
            kept.append(text[end:match.start()])
            end = match.end()
            calls.append(call)
        kept.append(text[end:])
        content = "".join(kept).strip()
        return (content or None) if calls else (text or None), calls

    def complete_calls(self, section: str) -> list[ParsedToolCall]:
        closed = section[:section.rfind("</tool_call>") + len("</tool_call>")] if "</tool_call>" in section else ""
        return self.parse(closed)[1] if closed else []


class MistralToolParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text or None, []
        content = text[:start].strip() or None
        body = text[start + len(self.marker):].strip()
        calls: list[ParsedToolCall] = []
        if body.startswith(("[", "{")):
            try:
                value, _ = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError:
                return text, []
            items = value if isinstance(value, list) else [value]
            calls = [c for c in (_call_from(item) for item in items) if c is not None]
            if len(calls) != len(items):
                return text, []
        else:                                    # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            for part in body.split(self.marker):
                name, sep, arguments = part.partition("[ARGS]")
                try:
                    call = _call_from({"name": name.strip(), "arguments": json.loads(arguments)}) if sep else None
                except json.JSONDecodeError:
                    call = None
                if call is None:
                    return text, []
                calls.append(call)
        return content, calls


    def complete_calls(self, section: str) -> list[ParsedToolCall]:
        """Streaming: the list's elements parsed so far, or the [ARGS] calls another marker has closed."""
        body = section[len(self.marker):].lstrip()
        decoder, calls = json.JSONDecoder(), []
        if body.startswith("["):
            position = 1
            while True:
                while position < len(body) and body[position] in " \n\t,":
                    position += 1
                try:
                    value, position = decoder.raw_decode(body, position)
                except json.JSONDecodeError:
                    return calls
                call = _call_from(value)
                if call is None:
                    return calls
                calls.append(call)
        parts = body.split(self.marker)[:-1]     # the last part may still grow
        return self.parse(self.marker + self.marker.join(parts))[1] if parts else []


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "qwen": HermesToolParser,
                                        "mistral": MistralToolParser}


class StreamingToolParser:
    """Feed text deltas; get (content delta, newly complete calls) back; `finish()` flushes."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0           # characters of content already sent
        self.sent_calls = 0
        self.in_calls = False

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self.text += delta
        marker = self.parser.marker
        if not self.in_calls:
            start = self.text.find(marker)
            if start < 0:
                visible = len(self.text) - _partial_suffix(self.text, marker)
                out = self.text[self.sent_content:visible]
                self.sent_content = max(self.sent_content, visible)
                return out, []
            self.in_calls = True
            out = self.text[self.sent_content:start]
            self.sent_content = start
            return out, self._new(self.parser.complete_calls(self.text[start:]))
        return "", self._new(self.parser.complete_calls(self.text[self.sent_content:]))

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The rest: calls not sent yet, or, when the calls do not parse, their text as content."""
        if not self.in_calls:
            out = self.text[self.sent_content:]
            self.sent_content = len(self.text)
            return out, []
        content, calls = self.parser.parse(self.text[self.sent_content:])
        if not calls:
            return self.text[self.sent_content:], []
        return (content if self.sent_calls == 0 else "") or "", self._new(calls)

    def _new(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        fresh = calls[self.sent_calls:]
        self.sent_calls += len(fresh)
        return fresh


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0

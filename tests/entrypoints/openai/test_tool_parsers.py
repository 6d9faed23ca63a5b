"""The tool-call parsers on whole texts and streamed in pieces of every size: the same content and calls."""

from __future__ import annotations

import json

import pytest

from moekv.entrypoints.openai.tool_parsers import (HermesToolParser, MistralToolParser, ParsedToolCall,
                                                   StreamingToolParser)

WEATHER = ParsedToolCall("get_weather", json.dumps({"city": "Rome", "days": 2}))
LETTER = ParsedToolCall("send_letter", json.dumps({"to": ["Juliet"], "text": "a <b> \u00e9"}, ensure_ascii=False))

HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>', None, [WEATHER]),
    ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>\n'
     '<tool_call>{"name": "send_letter", "arguments": "{\\"to\\": [\\"Juliet\\"], \\"text\\": \\"a <b> \u00e9\\"}"}'
     '</tool_call>', "Let me look.", [WEATHER, LETTER]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}', None, [WEATHER]),   # EOS, no close
    ("No tools needed, <tool not really>.", "No tools needed, <tool not really>.", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', []),                        # broken JSON
]

MISTRAL = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]', None, [WEATHER]),
    ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, '
     '{"name": "send_letter", "arguments": {"to": ["Juliet"], "text": "a <b> \u00e9"}}]', "Sure.", [WEATHER, LETTER]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]send_letter[ARGS]'
     '{"to": ["Juliet"], "text": "a <b> \u00e9"}', None, [WEATHER, LETTER]),
    ("[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {", "[TOOL_CALLS][{\"name\": \"get_weather\", "
     "\"arguments\": {", []),
    ("plain [TOOL text", "plain [TOOL text", []),
]


def stream(parser, text: str, size: int):
    streamer = StreamingToolParser(parser)
    content, calls, first_call_at = "", [], None
    for start in range(0, len(text), size):
        piece, new = streamer.feed(text[start:start + size])
        content += piece
        if new and first_call_at is None:
            first_call_at = start + size
        calls += new
    piece, new = streamer.finish()
    return content + piece, calls + new, first_call_at


@pytest.mark.parametrize("parser_cls, cases", [(HermesToolParser, HERMES), (MistralToolParser, MISTRAL)])
def test_parse_whole_text(parser_cls, cases):
    for text, content, calls in cases:
        assert parser_cls().parse(text) == (content, calls), text


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser_cls, cases", [(HermesToolParser, HERMES), (MistralToolParser, MISTRAL)])
def test_streamed_equals_whole(parser_cls, cases, size):
    for text, content, calls in cases:
        got_content, got_calls, _ = stream(parser_cls(), text, size)
        assert got_calls == calls, text
        assert (got_content.strip() or None) == (content.strip() if content else None), (text, got_content)


@pytest.mark.parametrize("parser_cls, text, first_end", [
    (HermesToolParser, HERMES[1][0], HERMES[1][0].index("</tool_call>") + len("</tool_call>")),
    (MistralToolParser, MISTRAL[1][0], MISTRAL[1][0].index("}}, ") + 2),
    (MistralToolParser, MISTRAL[2][0], MISTRAL[2][0].index("[TOOL_CALLS]send") + len("[TOOL_CALLS]")),
])
def test_each_call_streams_as_soon_as_it_is_complete(parser_cls, text, first_end):
    _, calls, first_call_at = stream(parser_cls(), text, 1)
    assert calls == [WEATHER, LETTER]
    assert first_call_at == first_end


def test_content_before_a_marker_streams_and_a_partial_marker_is_held_back():
    streamer = StreamingToolParser(HermesToolParser())
    assert streamer.feed("Hello <tool") == ("Hello ", [])
    assert streamer.feed("box> there") == ("<toolbox> there", [])

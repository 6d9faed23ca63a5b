"""tools + tool_choice on /v1/chat/completions through the openai client: a scripted mock model writes each
parser's format (auto, streamed and not), the plain mock model under the grammar of tool_choice required /
named, tool turns in the next request, and the 400s."""

from __future__ import annotations

import json

import pytest
import torch

from moekv.engine.engine import Engine
from moekv.tokenizer import Tokenizer
from tests.entrypoints.openai.helpers import ThreadedServer, bad_request, make_app, openai_client, write_char_tokenizer
from tests.mock_model import MockModel, mock_arch, mock_engine_config

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

TEMPLATE = (
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{%- elif m.role == 'tool' %}[{{ m.tool_call_id }}]{{ m.content }}"
    "{%- else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}")
PARAMS = {"type": "object", "properties": {"city": {"enum": ["Rome", "Paris"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["CET"]}}, "required": ["zone"]}}}]
USER = [{"role": "user", "content": "weather?"}]
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>'
MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]'


class ScriptedModel(MockModel):
    """Writes `script` token by token (one sampled row per step), then EOS (id 0); None: the plain mock."""

    script: list[int] | None = None

    def compute_logits(self, hidden):
        if self.script is None:
            return super().compute_logits(hidden)
        logits = torch.full((hidden.shape[0], self.arch.vocab_size), -10.0)
        for row in range(hidden.shape[0]):
            token = self.script.pop(0) if self.script else 0
            logits[row, token] = 10.0
        return logits


def serve(folder, parser):
    tokenizer = Tokenizer(folder)
    config = mock_engine_config(max_model_len=1024, page_size=8, num_pages=512, max_num_seqs=8,
                                max_num_batched_tokens=1024)
    model = ScriptedModel(mock_arch(vocab_size=tokenizer.vocab_size, max_position_embeddings=2048))
    engine = Engine(config, model=model, tokenizer=tokenizer)
    app, _ = make_app(engine, api_key="k", tool_call_parser=parser)
    return ThreadedServer(app), model, tokenizer


@pytest.fixture(scope="module", params=["hermes", "mistral"])
def tool_server(request, tmp_path_factory):
    folder = write_char_tokenizer(tmp_path_factory.mktemp("tools"), chat_template=TEMPLATE)
    server, model, tokenizer = serve(folder, request.param)
    with server:
        server.model, server.tokenizer, server.parser = model, tokenizer, request.param
        server.client = openai_client(server, "k")
        yield server


def script(server, text: str | None):
    server.model.script = None if text is None else server.tokenizer.encode(text, add_special_tokens=False)


def call_text(server) -> str:
    return HERMES_CALL if server.parser == "hermes" else MISTRAL_CALL


def test_auto_returns_parsed_tool_calls(tool_server):
    script(tool_server, "On it. " + call_text(tool_server))
    out = tool_server.client.chat.completions.create(model="mock", messages=USER, tools=TOOLS, max_tokens=200,
                                                     temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "On it."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome", "days": 2}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parallel_calls_and_parallel_tool_calls_false(tool_server, stream):
    def calls(**kwargs):
        script(tool_server, call_text(tool_server).replace("Rome", "Paris") + call_text(tool_server)
               if tool_server.parser == "hermes" else MISTRAL_CALL.replace("}}]", "}}, " + MISTRAL_CALL[13:]))
        out = tool_server.client.chat.completions.create(model="mock", messages=USER, tools=TOOLS, max_tokens=300,
                                                         temperature=0, stream=stream, **kwargs)
        if stream:
            return [json.loads(t.function.arguments)["city"] for c in out if c.choices
                    for t in (c.choices[0].delta.tool_calls or [])]
        return [json.loads(t.function.arguments)["city"] for t in out.choices[0].message.tool_calls]

    assert calls() == (["Paris", "Rome"] if tool_server.parser == "hermes" else ["Rome", "Rome"])
    assert len(calls(parallel_tool_calls=False)) == 1


def test_auto_streamed(tool_server):
    script(tool_server, "On it. " + call_text(tool_server))
    chunks = list(tool_server.client.chat.completions.create(model="mock", messages=USER, tools=TOOLS, max_tokens=200,
                                                             temperature=0, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content.strip() == "On it." and "<tool_call>" not in content and "[TOOL_CALLS]" not in content
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Rome", "days": 2})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_plain_text_and_tool_choice_none(tool_server):
    script(tool_server, "Fair day.")
    out = tool_server.client.chat.completions.create(model="mock", messages=USER, tools=TOOLS, max_tokens=50,
                                                     temperature=0)
    assert out.choices[0].message.content == "Fair day." and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"
    script(tool_server, call_text(tool_server))
    none = tool_server.client.chat.completions.create(model="mock", messages=USER, tools=TOOLS, max_tokens=200,
                                                      temperature=0, tool_choice="none")
    assert none.choices[0].message.content == call_text(tool_server) and none.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_are_forced_by_the_grammar(tool_server, stream):
    script(tool_server, None)                  # the plain mock: it writes no JSON of its own
    for choice, names in (({"type": "function", "function": {"name": "get_weather"}}, ["get_weather"]),
                          ("required", None)):
        # the plain mock would append calls until max_tokens: parallel_tool_calls=False caps the list at one
        kwargs = dict(model="mock", messages=USER, tools=TOOLS, max_tokens=120, temperature=0, tool_choice=choice,
                      parallel_tool_calls=False)
        if stream:
            chunks = list(tool_server.client.chat.completions.create(stream=True, **kwargs))
            calls = [t.function for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
            finish = chunks[-1].choices[0].finish_reason
        else:
            out = tool_server.client.chat.completions.create(**kwargs)
            calls, finish = [t.function for t in out.choices[0].message.tool_calls], out.choices[0].finish_reason
        assert finish == "tool_calls" and calls
        for call in calls:
            assert names is None or call.name in names
            schema = PARAMS if call.name == "get_weather" else TOOLS[1]["function"]["parameters"]
            jsonschema.validate(json.loads(call.arguments), schema)


def test_tool_turns_render_into_the_next_prompt(tool_server):
    script(tool_server, "It is sunny.")
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Rome", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = tool_server.client.chat.completions.create(model="mock", messages=messages, tools=TOOLS, max_tokens=50,
                                                     temperature=0)
    assert out.choices[0].message.content == "It is sunny."
    rendered = tool_server.tokenizer.apply_chat_template(
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Rome", "days": 2}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=TOOLS)
    assert out.usage.prompt_tokens == len(tool_server.tokenizer.encode(rendered))
    assert '<assistant><tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}' in rendered
    assert "<tool>[call_1]sunny" in rendered and rendered.startswith("<tools>[{")


@pytest.mark.parametrize("kwargs, param", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools"),
    (dict(tools=None, tool_choice="required"), "tool_choice"),
])
def test_bad_tool_requests_are_400(tool_server, kwargs, param):
    kwargs = {"tools": TOOLS, **kwargs}
    if kwargs["tools"] is None:
        del kwargs["tools"]
    body = bad_request(tool_server.client.chat.completions.create, model="mock", messages=USER, max_tokens=5,
                       **kwargs)
    assert body["param"] == param


def test_tools_need_a_template_that_renders_them_and_auto_needs_a_parser(tmp_path):
    plain = write_char_tokenizer(tmp_path / "plain")             # its template never reads `tools`
    server, _, _ = serve(plain, "hermes")
    with server:
        client = openai_client(server, "k")
        body = bad_request(client.chat.completions.create, model="mock", messages=USER, tools=TOOLS, max_tokens=5)
        assert body["param"] == "tools"
    server, _, _ = serve(write_char_tokenizer(tmp_path / "tools", chat_template=TEMPLATE), None)
    with server:
        client = openai_client(server, "k")
        body = bad_request(client.chat.completions.create, model="mock", messages=USER, tools=TOOLS, max_tokens=5)
        assert body["param"] == "tool_choice"
        forced = client.chat.completions.create(model="mock", messages=USER, tools=TOOLS, max_tokens=120,
                                                temperature=0, tool_choice="required", parallel_tool_calls=False)
        assert forced.choices[0].finish_reason == "tool_calls"


def test_the_returned_message_can_be_sent_back(tool_server):
    """The openai client's message object (with refusal, annotations, ... set to null) is the next turn's input."""
    script(tool_server, call_text(tool_server))
    first = tool_server.client.chat.completions.create(model="mock", messages=USER, tools=TOOLS, max_tokens=200,
                                                       temperature=0)
    message = first.choices[0].message
    script(tool_server, "Sunny.")
    messages = USER + [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
    second = tool_server.client.chat.completions.create(model="mock", messages=messages, tools=TOOLS, max_tokens=50,
                                                        temperature=0)
    assert second.choices[0].message.content == "Sunny." and second.choices[0].finish_reason == "stop"

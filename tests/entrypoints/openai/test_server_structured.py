"""response_format on the server (mock engine + character tokenizer): the mock model writes no JSON of its
own, constrained it must produce output that parses and validates, streamed and not; bad formats are 400."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tests.entrypoints.openai.conftest import API_KEY  # noqa: E402
from tests.entrypoints.openai.helpers import stream_texts  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "mood": {"enum": ["glad", "sad"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 1},
    "in": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}},
    "required": ["mood", "n", "tags", "in"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "report", "schema": SCHEMA, "strict": True}}


def test_chat_json_schema_validates(client):
    messages = [{"role": "user", "content": "report"}]
    plain = client.chat.completions.create(model="mock", messages=messages, max_tokens=40, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.choices[0].message.content)
    out = client.chat.completions.create(model="mock", messages=messages, max_tokens=70, temperature=0,
                                         response_format=FORMAT)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    chunks = client.chat.completions.create(model="mock", messages=messages, max_tokens=70, temperature=0.5,
                                            seed=3, response_format=FORMAT, stream=True, n=2)
    for text in stream_texts(chunks).values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_response_format_too(client):
    out = client.completions.create(model="mock", prompt="a", max_tokens=70, temperature=0,
                                    extra_body={"response_format": FORMAT})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}}, {"type": "yaml"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}},
])
def test_bad_response_format_is_400(mock_server, fmt):
    response = httpx.post(f"{mock_server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "mock", "messages": [{"role": "user", "content": "a"}],
                                "response_format": fmt}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"

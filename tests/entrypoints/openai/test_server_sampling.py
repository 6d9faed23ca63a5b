"""Sampling controls and the "nothing silently ignored" rule on the server (mock engine, character tokenizer:
id = ord(c) - 31 for printable ASCII, the mock continues with id + 1 at logit 10 against -10)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY
from tests.entrypoints.openai.helpers import ThreadedServer, error_of, make_app, make_engine

AUTH = {"Authorization": f"Bearer {API_KEY}"}
E = str(ord("e") - 31)                          # the token id of "e"


@pytest.fixture(scope="module")
def mock_server(char_tokenizer_dir):
    """The conftest's mock server without the poison token (high temperatures may sample any token)."""
    app, _ = make_app(make_engine(char_tokenizer_dir, delay_s=0.001), api_key=API_KEY)
    with ThreadedServer(app) as server:
        yield server


def post(server, path, payload):
    return httpx.post(f"{server.url}{path}", json=payload, headers=AUTH, timeout=30)


def test_logit_bias_and_penalties(client):
    def text(**kw):
        return client.completions.create(model="mock", prompt="a", max_tokens=4, temperature=0, **kw).choices[0].text

    assert text(logit_bias={E: 21}) == "eeee"                               # 11 beats the mock's 10
    assert text(logit_bias={E: 21}, presence_penalty=2.0) == "efgh"
    assert text(logit_bias={E: 21}, frequency_penalty=1.5) == "efgh"
    assert text(logit_bias={E: 21}, extra_body={"repetition_penalty": 2.0}) == "efgh"
    chat = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={E: 21}, presence_penalty=2.0)
    assert chat.choices[0].message.content == "efg"


def test_min_tokens_holds_eos_back(client):
    # token 256 is followed by id 0, the EOS: without min_tokens the completion stops at once
    plain = client.completions.create(model="mock", prompt=[256], max_tokens=5, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 1
    held = client.completions.create(model="mock", prompt=[256], max_tokens=5, temperature=0,
                                     extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens >= 3


def test_best_of_returns_the_most_likely_of_its_samples(client):
    every = client.completions.create(model="mock", prompt="a", max_tokens=4, temperature=40.0, seed=11, n=4,
                                      logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(model="mock", prompt="a", max_tokens=4, temperature=40.0, seed=11, n=1,
                                     best_of=4)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == every.choices[max(range(4), key=scores.__getitem__)].text
    assert best.usage.completion_tokens == 16                                # every sample is generated


@pytest.mark.parametrize("payload, param", [
    ({"best_of": 3, "stream": True}, "best_of"), ({"best_of": 2, "temperature": 0}, "best_of"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"), ({"min_tokens": 50, "max_tokens": 4}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"suffix": "x"}, "suffix"), ({"audio": {"voice": "x"}}, "audio"), ({"foo": 1}, "foo"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_unimplemented_or_bad_fields_are_400_naming_them(mock_server, payload, param):
    response = post(mock_server, "/v1/completions", {"model": "mock", "prompt": "a", **payload})
    error = error_of(response, status=400)
    assert error["param"] == param and param in error["message"]


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]), ("prediction", {"x": 1}),
    ("reasoning_effort", "low"), ("verbosity", "low"), ("web_search_options", {}), ("functions", []),
    ("function_call", "auto"), ("best_of", 2), ("echo", True), ("frobnicate", True),
])
def test_chat_fields_moekv_does_not_implement_are_400(mock_server, field, value):
    response = post(mock_server, "/v1/chat/completions", {
        "model": "mock", "messages": [{"role": "user", "content": "a"}], field: value})
    error = error_of(response, status=400)
    assert error["param"] == field


def test_fields_that_cannot_change_the_output_stay_accepted(mock_server):
    ignored = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
               "safety_identifier": "s", "prompt_cache_key": "p", "modalities": ["text"]}
    chat = post(mock_server, "/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "a"}],
                                                      "max_tokens": 2, "temperature": 0, **ignored})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
    completion = post(mock_server, "/v1/completions", {"model": "mock", "prompt": "a", "max_tokens": 2,
                                                       "temperature": 0, "user": "u-1"})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == "bc"


def test_openai_client_defaults_pass(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="mock", prompt="a", extra_body={"nonsense": 1})
    out = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "a"}], max_tokens=1,
                                         user="someone", temperature=0)
    assert out.choices[0].finish_reason == "length"

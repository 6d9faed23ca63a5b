"""Bad input never gets a 500: out-of-range token ids, lone surrogates, fuzzed bodies -> a 400 in OpenAI's
error shape with a non-null `code`; no exception escapes the ASGI app; keep-alive connections survive an
error (issue 20, item 2)."""

from __future__ import annotations

import asyncio
import http.client
import json
import random

import httpx
import pytest

from tests.entrypoints.openai.helpers import ThreadedServer, make_app, make_engine

C, H = "/v1/completions", "/v1/chat/completions"

# (path, raw JSON body, expected code, expected param): the cases of the issue and their neighbours
BAD = [
    (C, '{"prompt": [1, -1]}', "invalid_value", "prompt"),
    (C, '{"prompt": [[1, -5]]}', "invalid_value", "prompt"),
    (C, '{"prompt": [1, 9223372036854775808]}', "invalid_value", "prompt"),
    (C, '{"prompt": [[2], [1, 99999999999999999999999999]]}', "invalid_value", "prompt"),
    (C, '{"prompt": [257]}', "invalid_value", "prompt"),
    (C, '{"prompt": "\\ud800"}', "invalid_unicode", "prompt"),
    (C, '{"prompt": ["a", "b\\udfffc"]}', "invalid_unicode", "prompt"),
    (H, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_unicode", "messages"),
    (H, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}]}',
     "invalid_unicode", "messages"),
    (H, '{"messages": [{"role": "user", "content": "a", "name": "\\ud83d"}]}', "invalid_unicode", "messages"),
    (C, '{"prompt": "a", "model": "\\ud800"}', "invalid_unicode", "model"),
    (C, '{"prompt": "a", "stop": ["\\ud800"]}', "invalid_unicode", "stop"),
    (C, '{"prompt": "a", "\\ud800": 1}', "invalid_unicode", "\\ud800"),
    (C, '{"prompt": "a", "audio": {}}', "unsupported_parameter", "audio"),
    (C, '{"prompt": "a", "presence_penalty": 7}', "invalid_value", "presence_penalty"),
    (C, '{"prompt": "a", "max_tokens": -1}', "invalid_value", "max_tokens"),
    (C, '{"prompt": "a", "top_p": 0}', "invalid_value", "top_p"),
    (C, '{"prompt": [[]]}', "invalid_value", "prompt"),
    (C, '{"prompt": ' + "[" * 3000 + "]" * 3000 + "}", "invalid_json", None),
    (C, "{not json", "invalid_json", None),
]


def post_all(app, requests: list[tuple[str, bytes]]) -> list[httpx.Response]:
    """POST each body through the app in process; an exception escaping the app fails the test."""
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return [await http.post(path, content=body, headers={"content-type": "application/json"})
                    for path, body in requests]
    return asyncio.run(asyncio.wait_for(main(), timeout=120))


@pytest.fixture(scope="module")
def app_engine(char_tokenizer_dir):
    engine = make_engine(char_tokenizer_dir)
    app, async_engine = make_app(engine)
    async_engine.start()
    yield app, engine
    async_engine.shutdown()


def assert_error_shape(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["code"], str) and error["code"]
    assert "Traceback" not in response.text
    return error


def test_bad_input_is_a_400_with_a_code(app_engine):
    app, engine = app_engine
    responses = post_all(app, [(path, body.encode()) for path, body, _, _ in BAD])
    for (path, body, code, param), response in zip(BAD, responses):
        assert response.status_code == 400, (body[:80], response.text)
        error = assert_error_shape(response)
        assert (error["code"], error["param"]) == (code, param), (body[:80], error)
    assert not engine.requests   # nothing was queued


def _random_string(rng: random.Random) -> str:
    alphabet = ["a", "Z", " ", "\n", "\x00", "\ud800", "\udfff", "\u00e9", "\U0001f600", "\\", '"', "~"]
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    return [lambda: None, lambda: rng.choice([True, False]), lambda: rng.choice([0, 1, -1, 2 ** 63, -2 ** 70, 7]),
            lambda: rng.choice([0.5, -1e300, 1e400, float("nan")]), lambda: _random_string(rng),
            lambda: rng.randint(-3, 300),
            lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            lambda: [rng.choice([1, 5, -1, 2 ** 64, 256]) for _ in range(rng.randint(1, 3))],
            lambda: {_random_string(rng): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 2))}][kind]()


FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "seed", "stream",
          "logprobs", "echo", "model", "stream_options", "ignore_eos", "user", "best_of", "logit_bias"]


def fuzzed_bodies(seed: int, count: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        path = rng.choice([C, H])
        body = {name: _random_value(rng) for name in rng.sample(FIELDS, rng.randint(1, 5))}
        if path == H:
            body.pop("prompt", None)
            message = {"role": rng.choice(["user", "system", "robot"]), "content": _random_value(rng)}
            body["messages"] = rng.choice([[message], [], _random_value(rng)])
        if "max_tokens" in body and rng.random() < 0.7:
            body["max_tokens"] = 2   # keep what is valid short
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        bodies.append((path, raw))
    return bodies


def test_fuzzed_bodies_never_get_a_5xx(app_engine):
    app, engine = app_engine
    bodies = fuzzed_bodies(seed=20, count=300)
    responses = post_all(app, bodies)
    statuses = [r.status_code for r in responses]
    assert all(s in (200, 400, 404) for s in statuses), sorted(set(statuses))
    assert statuses.count(400) > 100 and statuses.count(200) > 0   # the fuzzer reaches both sides
    for response in responses:
        if response.status_code >= 400:
            assert_error_shape(response)
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n")


def test_an_exception_escapes_neither_the_app_nor_the_connection(char_tokenizer_dir):
    """A bug (here a tokenizer that raises) is a 500 `internal_error`; the keep-alive connection carries on."""
    engine = make_engine(char_tokenizer_dir)
    app, _ = make_app(engine)
    real_encode = engine.tokenizer.encode

    def encode(text, *args, **kwargs):
        if text == "boom":
            raise RuntimeError("secret internals")
        return real_encode(text, *args, **kwargs)

    engine.tokenizer.encode = encode
    with ThreadedServer(app) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        answers, sockets = [], []
        for body in ('{"prompt": "boom"}', '{"prompt": [1, -1]}', '{"prompt": "\\ud800"}',
                     '{"prompt": "a", "max_tokens": 2, "temperature": 0}'):
            connection.request("POST", C, body=body, headers={"content-type": "application/json"})
            response = connection.getresponse()
            answers.append((response.status, json.loads(response.read()), response.getheader("connection")))
            sockets.append(connection.sock)   # None once the server has closed it
        connection.close()
    assert sockets[0] is not None and all(s is sockets[0] for s in sockets)   # one connection throughout
    assert [a[0] for a in answers] == [500, 400, 400, 200]
    assert answers[0][1]["error"]["code"] == "internal_error" and "secret" not in json.dumps(answers[0][1])
    assert answers[3][1]["choices"][0]["text"] == "bc"
    assert all(a[2] != "close" for a in answers)

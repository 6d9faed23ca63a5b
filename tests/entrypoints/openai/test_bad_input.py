"""Bad input never gets a 500: out-of-range token ids, lone surrogates, fuzzed bodies -> a 400 in OpenAI's
error shape with a non-null `code`; no exception escapes the ASGI app; keep-alive connections survive an
error (issue 20, item 2)."""

from __future__ import annotations

import http.client
import json

import httpx
import pytest

from tests.entrypoints.openai.helpers import ThreadedServer, asgi_call, error_of, make_app, make_engine, running_app

from moekv.testing.bad_requests import BAD_REQUESTS as BAD
from moekv.testing.bad_requests import COMPLETIONS as C
from moekv.testing.bad_requests import fuzzed_requests


def post_all(app, requests: list[tuple[str, bytes]]) -> list[httpx.Response]:
    """POST each body through the app in process; an exception escaping the app fails the test."""
    async def calls(http):
        return [await http.post(path, content=body, headers={"content-type": "application/json"})
                for path, body in requests]
    return asgi_call(app, calls, timeout_s=120, raise_app_exceptions=True)


@pytest.fixture(scope="module")
def app_engine(char_tokenizer_dir):
    engine = make_engine(char_tokenizer_dir)
    with running_app(engine) as (app, _):
        yield app, engine


def test_bad_input_is_a_400_with_a_code(app_engine):
    app, engine = app_engine
    responses = post_all(app, [(path, body.encode()) for path, body, _, _ in BAD])
    for (path, body, code, param), response in zip(BAD, responses):
        assert response.status_code == 400, (body[:80], response.text)
        error = error_of(response)
        assert (error["code"], error["param"]) == (code, param), (body[:80], error)
    assert not engine.requests   # nothing was queued


def test_fuzzed_bodies_never_get_a_5xx(app_engine):
    app, engine = app_engine
    bodies = fuzzed_requests(seed=20, count=300)
    responses = post_all(app, bodies)
    statuses = [r.status_code for r in responses]
    assert all(s in (200, 400, 404) for s in statuses), sorted(set(statuses))
    assert statuses.count(400) > 100 and statuses.count(200) > 0   # the fuzzer reaches both sides
    for response in responses:
        if response.status_code >= 400:
            error_of(response)
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

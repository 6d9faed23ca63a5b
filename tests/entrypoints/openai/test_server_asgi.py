"""The OpenAI app around a mock engine through an in-process ASGI transport: 503 when the engine loop is
dead, no-chat-template answers, the chat template override, 500 without a traceback."""

from __future__ import annotations

import asyncio

from tests.entrypoints.openai.helpers import asgi_call, make_app, make_engine, running_app, write_char_tokenizer


def test_health_is_503_and_requests_are_503_when_the_loop_is_dead(tmp_path):
    engine = make_engine(write_char_tokenizer(tmp_path / "tok"))
    app, async_engine = make_app(engine)
    async_engine.start()

    async def calls(http):
        assert (await http.get("/health")).status_code == 200
        engine.has_unfinished = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
        for _ in range(100):
            if not async_engine.is_alive:
                break
            await asyncio.sleep(0.01)
        health = await http.get("/health")
        completion = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        return health, completion

    health, completion = asgi_call(app, calls, timeout_s=30, raise_app_exceptions=False)
    assert health.status_code == 503 and "boom" in health.json()["error"]["message"]
    assert completion.status_code == 503 and completion.json()["error"]["code"] == "engine_unavailable"


def test_chat_without_a_template_is_400(tmp_path):
    with running_app(make_engine(write_char_tokenizer(tmp_path / "tok", chat_template=None))) as (app, _):
        response = asgi_call(app, lambda http: http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]}),
            timeout_s=30, raise_app_exceptions=False)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "no chat template" in error["message"]


def test_chat_template_override(tmp_path):
    engine = make_engine(write_char_tokenizer(tmp_path / "tok", chat_template=None))
    with running_app(engine, chat_template="{{ messages[0]['content'] }}|") as (app, _):
        response = asgi_call(app, lambda http: http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2, "temperature": 0}),
            timeout_s=30, raise_app_exceptions=False)
    assert response.status_code == 200
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "}~" and body["usage"]["prompt_tokens"] == 3


def test_an_unexpected_exception_is_500_without_a_traceback(tmp_path):
    engine = make_engine(write_char_tokenizer(tmp_path / "tok"))
    with running_app(engine) as (app, _):
        def broken_encode(*args, **kwargs):
            raise RuntimeError("secret internals")

        engine.tokenizer.encode = broken_encode
        response = asgi_call(app, lambda http: http.post("/v1/completions", json={"prompt": "a"}),
                             timeout_s=30, raise_app_exceptions=False)
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "internal server error", "type": "server_error", "param": None,
                                         "code": "internal_error"}}
    assert "secret" not in response.text and "Traceback" not in response.text

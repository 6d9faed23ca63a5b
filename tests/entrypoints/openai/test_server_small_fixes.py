"""Issue 20, item 5: /v1/models never shows the host path, --max-tokens-default bounds chat requests
without max_tokens, and /metrics already describes a request once its last chunk has arrived."""

from __future__ import annotations

import json

from moekv.metrics import parse_metrics
from tests.entrypoints.openai.helpers import asgi_call, make_engine, running_app


def test_models_shows_the_served_name_not_the_path(char_tokenizer_dir):
    with running_app(make_engine(char_tokenizer_dir), name="served", model_path="/secret/host/layout") as (app, _):
        response = asgi_call(app, lambda http: http.get("/v1/models"))
    card = response.json()["data"][0]
    assert card["id"] == "served" and card["root"] == "served" and "secret" not in response.text


def test_chat_without_max_tokens_takes_the_default(char_tokenizer_dir):
    results = {}
    for default in (None, 5):
        with running_app(make_engine(char_tokenizer_dir, max_model_len=64), default_max_tokens=default) as (app, _):
            response = asgi_call(app, lambda http: http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "a"}], "ignore_eos": True}))
        results[default] = response.json()["usage"]
    assert results[5]["completion_tokens"] == 5
    assert results[None]["completion_tokens"] == 64 - results[None]["prompt_tokens"]   # the rest of the context


def test_metrics_are_current_when_the_last_chunk_arrives(char_tokenizer_dir):
    async def calls(http):
        readings = []
        for _ in range(10):
            body = {"prompt": "a", "max_tokens": 6, "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"]:
                        readings.append(parse_metrics((await http.get("/metrics")).text))
                        break
        return readings

    with running_app(make_engine(char_tokenizer_dir, delay_s=0.002)) as (app, _):
        readings = asgi_call(app, calls)
    assert len(readings) == 10
    for values in readings:   # scraped right after the final chunk, before [DONE]
        assert values["moekv:num_requests_running"] == 0 and values["moekv:kv_cache_usage_perc"] == 0

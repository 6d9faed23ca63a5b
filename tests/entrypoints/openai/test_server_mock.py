"""The OpenAI-compatible server around a mock engine (no weights), through the real `openai` client
and a real uvicorn: the character tokenizer + mock model make every output predictable ("a" -> "bcd...")."""

from __future__ import annotations

import math
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY
from tests.entrypoints.openai.helpers import bad_request, error_of, openai_client, read_metrics, stream_texts, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_completion(client):
    out = client.completions.create(model="mock", prompt="abc", max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.model == "mock"
    assert [c.text for c in out.choices] == ["defgh"]
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 5, 8)


def test_completion_token_ids_and_batch_of_prompts(client):
    out = client.completions.create(model="mock", prompt=[[66, 67], "xy"], max_tokens=2, temperature=0)
    assert [(c.index, c.text) for c in out.choices] == [(0, "cd"), (1, "z{")]   # ids 66, 67 = "ab"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 4)


def test_completion_stream_with_usage(client):
    chunks = list(client.completions.create(model="mock", prompt="abc", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "defghi"
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 6, 9)


def test_default_max_tokens_is_16_and_clamped_to_the_context(client):
    assert client.completions.create(model="mock", prompt="A", temperature=0).usage.completion_tokens == 16
    out = client.completions.create(model="mock", prompt="A" * 90, temperature=0)   # max_model_len 96
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_chat(client):
    out = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         temperature=0)
    # "<user>hi\n<assistant>" is 20 tokens ending in ">", so the mock continues "?@AB".
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == "?@AB"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (20, 4)
    again = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}],
                                           max_completion_tokens=2, temperature=0)
    assert again.choices[0].message.content == "?@"


def test_chat_stream(client):
    chunks = list(client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=3,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "?@A"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].usage.prompt_tokens == 20


def test_n_greater_than_one(client):
    out = client.completions.create(model="mock", prompt="ab", max_tokens=3, n=3, seed=7, temperature=1.0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert [c.text for c in out.choices] == ["cde"] * 3      # the mock's next token has all the mass
    assert out.usage.completion_tokens == 9 and out.usage.prompt_tokens == 2
    huge_seed = client.completions.create(model="mock", prompt="ab", max_tokens=2, n=2, seed=2**70)
    assert [c.text for c in huge_seed.choices] == ["cd", "cd"]
    chunks = list(client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, n=2, stream=True))
    assert stream_texts(chunks) == {0: "?@", 1: "?@"}


def test_echo(client):
    out = client.completions.create(model="mock", prompt="abc", max_tokens=2, echo=True, temperature=0)
    assert out.choices[0].text == "abcde"
    chunks = list(client.completions.create(model="mock", prompt="abc", max_tokens=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "abcde"


def test_completion_logprobs(client):
    out = client.completions.create(model="mock", prompt="ab", max_tokens=3, logprobs=2, temperature=0)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["c", "d", "e"]
    # mock logits: +10 for the next id, -10 for the 256 others -> log p = -log(1 + 256 e^-20) (fp32)
    expected = -math.log1p(256 * math.exp(-20))
    assert lp.token_logprobs == pytest.approx([expected] * 3, abs=1e-6)
    assert len(lp.top_logprobs[0]) == 2 and lp.top_logprobs[0]["c"] == pytest.approx(expected, abs=1e-6)
    assert min(lp.top_logprobs[0].values()) == pytest.approx(-20 + expected, abs=1e-6)
    assert lp.text_offset == [0, 1, 2]


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert [t.token for t in content] == ["?", "@"]
    assert content[0].bytes == [63] and len(content[0].top_logprobs) == 3
    assert content[0].top_logprobs[0].token == "?" and content[0].logprob == pytest.approx(0.0, abs=1e-6)


def test_stop_strings_and_stop_token_ids(client):
    out = client.completions.create(model="mock", prompt="a", max_tokens=20, stop=["ef", "zz"], temperature=0)
    assert out.choices[0].text == "bcd" and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="mock", prompt="a", max_tokens=20, stop="e", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "bcd"
    out = client.completions.create(model="mock", prompt="a", max_tokens=20, temperature=0,
                                    extra_body={"stop_token_ids": [70]})      # id 70 = "e"
    assert out.choices[0].text == "bcde" and out.choices[0].finish_reason == "stop"


def test_models_health_metrics(mock_server, client):
    assert [m.id for m in client.models.list().data] == ["mock"]
    assert httpx.get(f"{mock_server.url}/health").json() == {"status": "ok"}      # no key needed
    text = httpx.get(f"{mock_server.url}/metrics").text
    for name in ("moekv:time_to_first_token_seconds_bucket", "moekv:inter_token_latency_seconds_bucket",
                 "moekv:e2e_request_latency_seconds_count", "moekv:num_requests_running",
                 "moekv:num_requests_waiting", "moekv:kv_cache_usage_perc", "moekv:num_preemptions_total",
                 "moekv:prompt_tokens_total", "moekv:generation_tokens_total", "moekv:request_success_total",
                 "moekv:kv_cache_bits_per_value", "moekv:kv_outlier_budget_hits_total",
                 'moekv:expert_load{expert="0",layer="1",model_name="mock"}'):
        assert name in text, name


def test_metrics_count_tokens_and_requests(mock_server, client):
    before = read_metrics(mock_server.url)
    client.completions.create(model="mock", prompt="abcd", max_tokens=5, temperature=0)
    client.completions.create(model="mock", prompt="ab", max_tokens=3, n=2, temperature=0)
    after = wait_idle(mock_server.url)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta("moekv:prompt_tokens_total") == 4 + 2 * 2
    assert delta("moekv:generation_tokens_total") == 5 + 2 * 3
    assert delta('moekv:request_success_total{finished_reason="length",model_name="mock"}') == 3
    assert delta("moekv:time_to_first_token_seconds_count") == 3
    assert delta("moekv:e2e_request_latency_seconds_count") == 3
    assert delta("moekv:inter_token_latency_seconds_count") == 4 + 2 * 2
    assert after["moekv:kv_cache_bits_per_value"] == 32.0       # fp32 pages
    assert after["moekv:kv_cache_usage_perc"] == 0.0


# -- errors ----------------------------------------------------------------------------------------------
def post(server, path, payload=None, headers=AUTH, timeout=30):
    return httpx.post(f"{server.url}{path}", json=payload, headers=headers, timeout=timeout)


def test_unknown_model_is_404(mock_server, client):
    response = post(mock_server, "/v1/completions", {"model": "gpt-4", "prompt": "a"})
    assert response.status_code == 404
    error = error_of(response)
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_malformed_json_is_400(mock_server):
    response = httpx.post(f"{mock_server.url}/v1/completions", content=b'{"model": "mock", "prompt": ',
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_json"


def test_context_length_is_400_with_both_numbers(client):
    error = bad_request(client.completions.create, model="mock", prompt="abcdefghij", max_tokens=90)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert "prompt is 10 tokens" in error["message"] and "max_model_len) is 96" in error["message"]
    error = bad_request(client.completions.create, model="mock", prompt="a" * 96)
    assert error["param"] == "prompt" and "prompt is 96 tokens" in error["message"]


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 1.5), ("max_tokens", 0), ("n", 0),
                                          ("top_k", -5), ("logprobs", 50), ("presence_penalty", 2.5),
                                          ("seed", "x"), ("stop", [""])])
def test_invalid_parameter_is_400_naming_it(mock_server, field, value):
    response = post(mock_server, "/v1/completions", {"model": "mock", "prompt": "a", field: value})
    assert response.status_code == 400
    assert error_of(response)["param"] == field


def test_chat_errors(mock_server):
    bad_role = post(mock_server, "/v1/chat/completions", {"model": "mock", "messages": [{"role": "x", "content": "a"}]})
    assert bad_role.status_code == 400 and error_of(bad_role)["param"] == "messages"
    no_messages = post(mock_server, "/v1/chat/completions", {"model": "mock", "messages": []})
    assert no_messages.status_code == 400 and error_of(no_messages)["param"] == "messages"
    image = post(mock_server, "/v1/chat/completions", {"model": "mock", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert image.status_code == 400 and "not supported" in error_of(image)["message"]
    lonely = post(mock_server, "/v1/chat/completions", {"model": "mock", "top_logprobs": 2,
                                                        "messages": [{"role": "user", "content": "a"}]})
    assert lonely.status_code == 400 and error_of(lonely)["param"] == "top_logprobs"


def test_token_id_outside_vocab_is_400(mock_server):
    response = post(mock_server, "/v1/completions", {"model": "mock", "prompt": [1, 99999]})
    assert response.status_code == 400 and error_of(response)["param"] == "prompt"


def test_body_too_large_is_413(mock_server):
    response = post(mock_server, "/v1/completions", {"model": "mock", "prompt": "a" * 70_000})
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def test_body_too_large_without_content_length_is_413(mock_server):
    def chunks():
        yield b'{"model": "mock", "prompt": "'
        for _ in range(80):
            yield b"a" * 1024
        yield b'"}'

    response = httpx.post(f"{mock_server.url}/v1/completions", content=chunks(),
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def test_api_key(mock_server):
    missing = post(mock_server, "/v1/completions", {"model": "mock", "prompt": "a"}, headers={})
    wrong = post(mock_server, "/v1/completions", {"model": "mock", "prompt": "a"},
                 headers={"Authorization": "Bearer nope"})
    models = httpx.get(f"{mock_server.url}/v1/models")
    for response in (missing, wrong, models):
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
    bad = openai_client(mock_server, "wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{mock_server.url}/health").status_code == 200
    assert httpx.get(f"{mock_server.url}/metrics").status_code == 200


def test_unknown_route_is_404_json(mock_server):
    response = httpx.get(f"{mock_server.url}/v1/nothing", headers=AUTH)
    assert response.status_code == 404 and error_of(response)["code"] == "not_found"


# -- cancellation and failures -----------------------------------------------------------------------------
def test_closing_a_stream_aborts_and_frees_pages(mock_server, client):
    before = read_metrics(mock_server.url)
    # " " is id 1: 90 tokens count up to id 91, far from the poison token 95
    stream = client.completions.create(model="mock", prompt=" ", max_tokens=90, stream=True, temperature=0)
    received = 0
    for chunk in stream:
        received += len(chunk.choices[0].text)
        if received >= 3:
            break
    stream.close()
    after = wait_idle(mock_server.url)
    assert after["moekv:kv_cache_usage_perc"] == 0.0 and after["moekv:num_requests_running"] == 0
    assert mock_server.engine.kv_manager.num_free_pages == 128 and not mock_server.engine.requests
    abort_key = 'moekv:request_success_total{finished_reason="abort",model_name="mock"}'
    assert after[abort_key] - before.get(abort_key, 0) == 1


def test_disconnect_during_non_streamed_request_aborts(mock_server):
    with pytest.raises(httpx.ReadTimeout):
        post(mock_server, "/v1/completions", {"model": "mock", "prompt": " ", "max_tokens": 90}, timeout=0.05)
    after = wait_idle(mock_server.url)
    assert after["moekv:kv_cache_usage_perc"] == 0.0 and not mock_server.engine.requests


def test_a_failing_request_does_not_take_down_the_batch(mock_server, client):
    """"~" (id 95) makes the mock raise whenever it is in the batch: only its request ends with an error."""
    good = client.completions.create(model="mock", prompt="A", max_tokens=40, stream=True, temperature=0)
    first = next(iter(good))
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="mock", prompt="}", max_tokens=5, temperature=0)   # next token is "~"
    assert info.value.body["code"] == "generation_error" and "poisoned batch" in info.value.body["message"]
    text = first.choices[0].text + "".join(c.choices[0].text for c in good)
    assert text == "".join(chr(c) for c in range(ord("B"), ord("B") + 40))    # "BCD...": intact, in order
    failed_stream = client.completions.create(model="mock", prompt="|", max_tokens=5, stream=True, temperature=0)
    with pytest.raises(openai.APIError, match="poisoned batch"):
        list(failed_stream)
    assert httpx.get(f"{mock_server.url}/health").status_code == 200
    assert client.completions.create(model="mock", prompt="a", max_tokens=2, temperature=0).choices[0].text == "bc"
    assert wait_idle(mock_server.url)["moekv:kv_cache_usage_perc"] == 0.0


def test_many_concurrent_streams_with_cancellations(mock_server):
    """32 streams at once, every fourth closed after its first chunk: the rest complete exactly."""
    import asyncio

    async def one(http: httpx.AsyncClient, i: int):
        payload = {"model": "mock", "prompt": "A", "max_tokens": 20, "temperature": 0, "stream": True}
        text = ""
        async with http.stream("POST", f"{mock_server.url}/v1/completions", json=payload, headers=AUTH) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    text += json.loads(line[6:])["choices"][0]["text"]
                    if i % 4 == 0:
                        return None
        return text

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    results = asyncio.run(main())
    expected = "".join(chr(c) for c in range(ord("B"), ord("B") + 20))
    assert [r for i, r in enumerate(results) if i % 4] == [expected] * 24
    after = wait_idle(mock_server.url)
    assert after["moekv:kv_cache_usage_perc"] == 0.0 and not mock_server.engine.requests
    time.sleep(0)


def test_bench_serve_against_the_mock(mock_server):
    """The load-test tool's own accounting: cancelled requests are not failures; pages all come back."""
    import asyncio

    from moekv.bench.serve import BenchConfig, run_benchmark

    report = asyncio.run(run_benchmark(BenchConfig(url=mock_server.url, concurrency=8, num_prompts=24, max_tokens=3,
                                                   cancel_fraction=0.25, api_key=API_KEY, temperature=0,
                                                   progress=False, prompts=("To be, or not", "Hark!"))))
    assert report["requests"] == {"total": 24, "completed": 18, "cancelled": 6, "failed": 0}
    assert report["output_tokens"] >= 18 * 3 and report["ttft_ms"]["count"] == 24
    assert report["tpot_ms"]["count"] == 18 and report["e2e_ms"]["p99"] >= report["e2e_ms"]["p50"] > 0
    assert report["server_after_run"]["kv_cache_usage_perc"] == 0.0
    assert report["server_after_run"]["num_requests_running"] == 0

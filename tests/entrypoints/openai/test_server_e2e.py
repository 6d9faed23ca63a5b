"""`python -m moekv serve` in a subprocess, exactly as users start it, on the bundled model, driven
by the official `openai` client: generation, errors, cancellation, a bounded load test, clean shutdown.

Without the bundled checkpoint (an install without `models/`), a tiny random Mixtral with a character
tokenizer stands in, so the server path is still tested end to end.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import openai
import pytest

from moekv.bench.serve import BenchConfig, run_benchmark
from moekv.metrics import parse_metrics
from moekv.tokenizer import Tokenizer
from tests.entrypoints.openai.helpers import bad_request, error_of, openai_client, wait_idle
from tests.entrypoints.openai.subprocess_server import ServerProcess

KEY = "e2e-key"
NAME = "tiny"
SERVER_ARGS = ("--max-model-len", "512", "--num-pages", "1024", "--page-size", "16", "--max-num-seqs", "64",
               "--shutdown-timeout", "2")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    process = ServerProcess(model_dir, tmp_path_factory.mktemp("server") / "server.log", *SERVER_ARGS,
                            "--api-key", KEY, "--served-model-name", NAME).start()
    yield process
    process.stop(signal.SIGTERM)   # normally stopped already by the last test


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture()
def client(server):
    return openai_client(server, KEY, timeout=120)


PROMPT = "ROMEO:\nWhat light is this"


def test_startup_logs_capacity(server):
    log = server.log()
    assert "KV cache capacity: 16384 tokens" in log
    assert "max concurrency at max_model_len=512: 32.00 requests" in log


def test_completion_and_stream_agree(client, tokenizer):
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    num_prompt = len(tokenizer.encode(PROMPT))
    assert out.usage.prompt_tokens == num_prompt and out.usage.total_tokens == num_prompt + out.usage.completion_tokens
    assert 1 <= out.usage.completion_tokens <= 12
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_chat_with_the_checkpoint_template(client, tokenizer):
    messages = [{"role": "user", "content": "Speak, good sir."}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    rendered = tokenizer.apply_chat_template(messages)
    assert abs(out.usage.prompt_tokens - len(tokenizer.encode(rendered))) <= 1     # a BOS the template may add
    streamed = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == out.choices[0].message.content


def test_n_seed_echo_logprobs_stop(client):
    many = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, n=3, seed=11, temperature=1.0)
    single = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, seed=11, temperature=1.0)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.choices[0].text == single.choices[0].text        # choice 0 uses the seed itself
    echoed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, echo=True, temperature=0)
    assert echoed.choices[0].text.startswith(PROMPT)
    with_logprobs = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, logprobs=3, temperature=0)
    lp = with_logprobs.choices[0].logprobs
    assert len(lp.token_logprobs) == with_logprobs.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)   # top 3 + the chosen one (texts may coincide)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hail!"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    for token in chat.choices[0].logprobs.content:     # greedy: the chosen token is the most likely one
        assert len(token.top_logprobs) == 3 and token.logprob == pytest.approx(token.top_logprobs[0].logprob)
    full = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full[3:5] if len(full.strip()) >= 5 else None
    if stop:
        cut = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:full.index(stop)]


def test_errors(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{server.url}/v1/completions"
    unknown = httpx.post(url, json={"model": "gpt-4", "prompt": "x"}, headers=headers)
    assert unknown.status_code == 404 and error_of(unknown)["code"] == "model_not_found"
    malformed = httpx.post(url, content=b"{nope", headers={**headers, "Content-Type": "application/json"})
    assert malformed.status_code == 400 and error_of(malformed)["code"] == "invalid_json"
    error = bad_request(client.completions.create, model=NAME, prompt=PROMPT, max_tokens=600)
    assert "max_model_len) is 512" in error["message"] and error["param"] == "max_tokens"
    assert bad_request(client.completions.create, model=NAME, prompt=PROMPT, temperature=-2)["param"] == "temperature"
    huge = httpx.post(url, json={"model": NAME, "prompt": "a" * (1 << 20)}, headers=headers)
    assert huge.status_code == 413 and error_of(huge)["code"] == "request_too_large"
    assert httpx.post(url, json={"model": NAME, "prompt": "x"}).status_code == 401
    assert httpx.post(url, json={"model": NAME, "prompt": "x"}, headers={"Authorization": "Bearer no"}).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics_text = httpx.get(f"{server.url}/metrics").text
    assert "moekv:kv_cache_usage_perc" in metrics_text
    recall = parse_metrics(metrics_text).get('moekv:expert_prediction_recall{lookahead="1",model_name="' + NAME + '"}')
    assert recall is not None and 0.0 < recall <= 1.0     # the server ran requests, so the predictor counted


def test_closing_a_stream_frees_its_pages(server, client):
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    after = wait_idle(server.url, timeout_s=30)
    assert after["moekv:kv_cache_usage_perc"] == 0.0 and after["moekv:num_requests_running"] == 0


def test_load_64_streams_a_quarter_cancelled(server):
    report = asyncio.run(run_benchmark(BenchConfig(
        url=server.url, concurrency=64, num_prompts=64, max_tokens=16, cancel_fraction=0.25, api_key=KEY, seed=3,
        progress=False, idle_timeout_s=30)))
    assert report["requests"] == {"total": 64, "completed": 48, "cancelled": 16, "failed": 0}, report["errors"]
    assert report["output_tokens"] >= 48 * 16
    assert report["server_after_run"]["kv_cache_usage_perc"] == 0.0
    assert report["server_after_run"]["num_requests_running"] == 0


def test_bench_cli_prints_a_table_and_writes_json(server, tmp_path, capsys):
    import json

    from moekv.cli import main

    out = tmp_path / "bench.json"
    code = main(["bench", "serve", "--url", server.url, "--api-key", KEY, "--concurrency", "4", "--num-prompts", "8",
                 "--max-tokens", "4", "--cancel-fraction", "0.25", "--json", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0 and "TTFT" in printed and "completed / cancelled / failed" in printed
    report = json.loads(out.read_text())
    assert report["requests"] == {"total": 8, "completed": 6, "cancelled": 2, "failed": 0}
    assert report["config"]["api_key"] == "***" and report["model"] == NAME
    assert report["server_after_run"]["kv_cache_usage_perc"] == 0.0


def _stop_with_a_stream_open(process: ServerProcess, model: str, api_key: str, sig: int) -> None:
    """Open a long stream, send `sig` once its first chunk arrived: exit status 0 within a few seconds."""
    got_first = threading.Event()

    def stream():
        client = openai_client(process, api_key)
        try:
            for _ in client.completions.create(model=model, prompt=PROMPT, max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True}):
                got_first.set()
        except openai.APIError:
            pass   # the server cut the stream: expected
        got_first.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert got_first.wait(60)
    started = time.monotonic()
    code = process.stop(sig, timeout_s=15)
    assert code == 0, process.log()[-3000:]
    assert time.monotonic() - started < 10
    thread.join(10)


def test_sigint_shuts_down_cleanly_with_a_stream_open(model_dir, tmp_path):
    process = ServerProcess(model_dir, tmp_path / "server.log", *SERVER_ARGS).start()
    _stop_with_a_stream_open(process, model_dir.name, "none", signal.SIGINT)


def test_sigterm_shuts_down_cleanly_with_a_stream_open(server):
    """Last in this file: it stops the module's server."""
    _stop_with_a_stream_open(server, NAME, KEY, signal.SIGTERM)

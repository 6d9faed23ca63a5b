"""vLLM's spellings of `serve` flags (their effect on the config) and vLLM's extra endpoints."""

from __future__ import annotations

import httpx
import pytest

from moekv.cli import build_parser, main
from moekv.errors import ConfigError
from moekv.paths import default_model_dir
from tests.entrypoints.openai.conftest import API_KEY
from tests.entrypoints.openai.helpers import asgi_call, make_engine, running_app

pytest.importorskip("fastapi")
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def config_of(*argv: str):
    from moekv.entrypoints.openai.cli import engine_config_from_args

    return engine_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_positional_model_and_model_flag(monkeypatch):
    config, model = config_of(default_model_dir())
    assert model == default_model_dir() and config.model.model == default_model_dir()
    assert config_of("--model", default_model_dir())[0].model.model == default_model_dir()
    with pytest.raises(ConfigError, match="two models given"):
        config_of(default_model_dir(), "--model", "other")


@pytest.mark.parametrize("argv, field, value", [
    (["--gpu-memory-utilization", "0.55"], ("cache", "memory_fraction"), 0.55),
    (["--block-size", "32"], ("cache", "page_size"), 32),
    (["--num-gpu-blocks-override", "77"], ("cache", "num_pages"), 77),
    (["--max-num-batched-tokens", "999"], ("scheduler", "max_num_batched_tokens"), 999),
    (["--max-num-seqs", "7"], ("scheduler", "max_num_seqs"), 7),
    (["--generation-config", "vllm"], ("model", "generation_config"), "vllm"),
    (["--tokenizer", default_model_dir()], ("model", "tokenizer"), default_model_dir()),
    (["--enable-chunked-prefill"], ("scheduler", "max_num_batched_tokens"), 8192),
    (["--enable-expert-parallel", "--data-parallel-size", "2"], ("parallel", "expert_parallel_size"), 2),
    (["--enable-expert-parallel", "-dp", "4", "--num-redundant-experts", "2"],
     ("parallel", "num_redundant_experts"), 2),
    (["--kv-cache-dtype", "int3", "--staging-block-size", "32"], ("cache", "staging_block_size"), 32),
    (["--kv-cache-dtype", "int3", "--lazy-partial-page"], ("cache", "lazy_partial_page"), True),
])
def test_vllm_flag_sets_the_config(argv, field, value):
    config, _ = config_of(default_model_dir(), *argv)
    assert getattr(getattr(config, field[0]), field[1]) == value


def test_bad_staging_block_size_is_a_config_error():
    with pytest.raises(ConfigError, match="staging_block_size must be a power of two"):
        config_of(default_model_dir(), "--kv-cache-dtype", "int3", "--staging-block-size", "48")


def test_gpu_memory_utilization_is_checked():
    with pytest.raises(ConfigError, match="memory_fraction must be in"):
        config_of(default_model_dir(), "--gpu-memory-utilization", "1.5")


def test_generation_config_vllm_skips_its_eos(tmp_path):
    from moekv.engine.engine import Engine

    import json
    from pathlib import Path
    gen = json.loads((Path(default_model_dir()) / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 5}))
    for choice, has_five in (("auto", False), (str(tmp_path), True)):
        config, _ = config_of(default_model_dir(), "--generation-config", choice, "--device", "cpu",
                              "--max-model-len", "64", "--num-pages", "4")
        assert (5 in Engine(config).eos_token_ids) is has_five


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: moekv has no tensor parallelism"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"),
    (["--data-parallel-size", "2"], "without --enable-expert-parallel"),
    (["--enable-expert-parallel"], "needs 2 or more ranks"),
    (["--enable-expert-parallel", "-dp", "2", "--expert-parallel-size", "4"], "disagree"),
    (["--load-format", "pt"], "safetensors only"),
    (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["--num-pages", "3", "--num-gpu-blocks-override", "4"], "disagree"),
])
def test_flags_moekv_cannot_honour_are_errors(argv, message):
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        config_of(default_model_dir(), *argv)


@pytest.mark.parametrize("flag", ["--swap-space", "--pipeline-parallel-size", "--enable-lora", "--cpu-offload-gb",
                                  "--speculative-config"])
def test_unimplemented_vllm_flags_fail_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", default_model_dir(), flag, "4"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"{flag} is a vLLM flag moekv does not implement" in err


def test_served_model_names_and_max_logprobs(tmp_path):
    from tests.entrypoints.openai.helpers import write_char_tokenizer

    async def calls(http):
        models = (await http.get("/v1/models")).json()["data"]
        ok = await http.post("/v1/completions", json={"model": "second", "prompt": "a", "max_tokens": 2,
                                                      "logprobs": 2})
        too_many = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "logprobs": 3})
        unknown = await http.post("/v1/completions", json={"model": "third", "prompt": "a", "max_tokens": 2})
        return models, ok, too_many, unknown

    engine = make_engine(write_char_tokenizer(tmp_path / "tok"))
    with running_app(engine, name="first", served_model_aliases=("second",), max_logprobs=2) as (app, _):
        models, ok, too_many, unknown = asgi_call(app, calls, timeout_s=30)
    assert [m["id"] for m in models] == ["first", "second"] and models[0]["max_model_len"] == 96
    assert ok.status_code == 200 and ok.json()["model"] == "first"
    assert too_many.status_code == 400 and "--max-logprobs" in too_many.json()["error"]["message"]
    assert unknown.status_code == 404


# -- endpoints (the shared mock server: char tokenizer, id = printable ASCII index + 1) ---------------
def test_tokenize_detokenize_roundtrip(mock_server):
    url = mock_server.url
    out = httpx.post(f"{url}/tokenize", json={"prompt": "abc", "return_token_strs": True}, headers=HEADERS).json()
    assert out["tokens"] == [ord(c) - 31 for c in "abc"] and out["count"] == 3
    assert out["max_model_len"] == 96 and out["token_strs"] == ["a", "b", "c"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": out["tokens"]}, headers=HEADERS).json()
    assert back == {"prompt": "abc"}


def test_tokenize_messages_matches_what_chat_feeds_the_model(mock_server):
    url = mock_server.url
    messages = [{"role": "user", "content": "hi"}]
    out = httpx.post(f"{url}/tokenize", json={"messages": messages}, headers=HEADERS).json()
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                      headers=HEADERS).json()
    assert out["count"] == chat["usage"]["prompt_tokens"] > 2


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
])
def test_tokenize_bad_input_is_400(mock_server, path, body, param):
    response = httpx.post(f"{mock_server.url}{path}", json=body, headers=HEADERS)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_version_ping_health(mock_server):
    from moekv import __version__

    assert httpx.get(f"{mock_server.url}/version").json() == {"version": __version__}
    assert httpx.get(f"{mock_server.url}/ping").status_code == 200      # open, like /health
    assert httpx.post(f"{mock_server.url}/ping").status_code == 200
    assert httpx.get(f"{mock_server.url}/health").status_code == 200
    assert httpx.post(f"{mock_server.url}/tokenize", json={"prompt": "a"}).status_code == 401


def test_vllm_metrics_and_bits_gauges_on_the_bundled_model_int3():
    """Short int3 requests: the bits gauge is the low-bit pages' bits (not the fp tail's cost over few
    tokens, which read 341.7 before) and the tail's share is reported apart; vLLM's series are scraped."""
    from moekv.engine.async_engine import AsyncEngine
    from moekv.engine.engine import Engine
    from moekv.entrypoints.llm import make_engine_config
    from moekv.entrypoints.openai.server import build_app
    from moekv.entrypoints.openai.serving import ServerConfig
    from moekv.kvcache import accounting
    from moekv.metrics import ServerMetrics, parse_metrics

    engine = Engine(make_engine_config(default_model_dir(), kv_cache_dtype="int3", device="cpu", max_model_len=256,
                                       num_pages=16, max_num_seqs=4, max_num_batched_tokens=256))
    metrics = ServerMetrics("tiny", prefix="vllm", max_model_len=256)
    async_engine = AsyncEngine(engine, metrics)
    app = build_app(async_engine, ServerConfig(served_model_name="tiny"))
    from moekv.sampling import SamplingParams

    # before the engine thread runs: step by hand, a 140-token sequence holds 128 quantized + 12 tail tokens
    engine.add_request(list(range(1, 141)), SamplingParams(max_tokens=4, temperature=0), request_id="manual")
    engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=4, temperature=0), request_id="short")
    engine.step()
    async_engine._publish_stats()
    manual = parse_metrics(metrics.render().decode())
    lengths = [r.num_computed_tokens for r in engine.scheduler.running]
    assert sorted(lengths) == [20, 140]
    assert manual["moekv:kv_cache_full_precision_token_share"] == pytest.approx((12 + 20) / 160)
    while engine.has_unfinished():
        engine.step()
    for request_id in ("manual", "short"):
        engine.release(request_id)
    async_engine.start()
    seen_share = []

    async def calls(http):
        async with http.stream("POST", "/v1/completions", json={
                "prompt": "ROMEO:", "max_tokens": 24, "temperature": 0, "stream": True}) as response:
            async for _ in response.aiter_lines():
                seen_share.append(parse_metrics((await http.get("/metrics")).text)[
                    "moekv:kv_cache_full_precision_token_share"])
        return parse_metrics((await http.get("/metrics")).text), (await http.get("/metrics")).text

    try:
        values, text = asgi_call(app, calls, timeout_s=120, timeout=60)
    finally:
        async_engine.shutdown()
    cache = engine.kv_cache
    assert values["moekv:kv_cache_bits_per_value"] == pytest.approx(
        accounting.format_bits_per_value(cache.key_spec, cache.value_spec))
    assert 3.0 < values["moekv:kv_cache_bits_per_value"] < 4.5
    assert set(seen_share) <= {0.0, 1.0}     # a short sequence lives wholly in its fp tail page (or is done)
    assert values["vllm:request_queue_time_seconds_count"] == 1
    assert values["vllm:request_generation_tokens_sum"] == 24
    prompt_tokens = len(engine.tokenizer.encode("ROMEO:"))
    assert values["vllm:request_prompt_tokens_sum"] == prompt_tokens == values["vllm:prompt_tokens_total"]
    assert values["vllm:time_per_output_token_seconds_count"] == 23
    assert values["vllm:request_time_per_output_token_seconds_count"] == 1
    assert 'cache_dtype="int3"' in text and 'block_size="128"' in text and 'num_gpu_blocks="16"' in text


def test_generation_config_sets_the_sampling_defaults(tmp_path):
    import json
    from types import SimpleNamespace

    from moekv.engine.engine import generation_defaults
    from moekv.entrypoints.openai.protocol import CompletionRequest
    from moekv.entrypoints.openai.serving import OpenAIServing, ServerConfig

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "do_sample": True}))
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    assert generation_defaults(None) == {}
    engine = SimpleNamespace(tokenizer=None, max_model_len=64, generation_defaults=defaults)
    serving = OpenAIServing(SimpleNamespace(engine=engine), ServerConfig(served_model_name="m"))
    left_out = serving.sampling_params(CompletionRequest(prompt="a"), 4, None, None)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    given = serving.sampling_params(CompletionRequest(prompt="a", temperature=0, top_p=1.0, top_k=-1,
                                                      repetition_penalty=1.0), 4, None, None)
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty) == (0, 1.0, -1, 1.0)
    engine.generation_defaults = {}
    plain = serving.sampling_params(CompletionRequest(prompt="a"), 4, None, None)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, -1, 1.0)

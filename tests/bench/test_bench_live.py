"""`moekv bench serve` against a live server on the bundled model: a Poisson rate with the random
dataset, and a ShareGPT file through the CLI with --save-result and plots."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def bundled_server():
    from moekv.engine.async_engine import AsyncEngine
    from moekv.engine.engine import Engine
    from moekv.entrypoints.llm import make_engine_config
    from moekv.entrypoints.openai.server import build_app
    from moekv.entrypoints.openai.serving import ServerConfig
    from moekv.metrics import ServerMetrics
    from moekv.paths import default_model_dir
    from tests.entrypoints.openai.helpers import ThreadedServer

    engine = Engine(make_engine_config(default_model_dir(), device="cpu", max_model_len=128, num_pages=64,
                                       page_size=16, max_num_seqs=8, max_num_batched_tokens=256))
    metrics = ServerMetrics("tiny", prefix="vllm", max_model_len=128)   # the bench reads either prefix
    app = build_app(AsyncEngine(engine, metrics), ServerConfig(served_model_name="tiny"))
    with ThreadedServer(app) as server:
        server.vocab_size = engine.tokenizer.vocab_size
        yield server


def test_random_dataset_at_a_poisson_rate(bundled_server):
    from moekv.bench.serve import BenchConfig, run_benchmark

    config = BenchConfig(url=bundled_server.url, num_prompts=12, request_rate=30.0, concurrency=4,
                         dataset_name="random", random_input_len=20, random_output_len=6, random_range_ratio=0.5,
                         goodput=("ttft:60000",), progress=False, seed=5)
    report = asyncio.run(run_benchmark(config))
    assert report["requests"] == {"total": 12, "completed": 12, "cancelled": 0, "failed": 0}, report["error_samples"]
    assert all(10 <= n <= 30 for n in report["input_lens"])          # random_input_len 20 +- 50%, exact (ids)
    assert all(3 <= n <= 9 for n in report["output_lens"])           # ignore_eos: exactly the sampled length
    assert report["total_output_tokens"] == sum(report["output_lens"])
    assert report["request_goodput"] == pytest.approx(report["request_throughput"])   # a 60 s TTFT limit holds
    assert report["request_rate"] == 30.0 and report["max_concurrency"] == 4
    assert report["duration"] > 11 / 30.0 * 0.3                     # arrivals are spread out, not all at once
    assert report["p99_ttft_ms"] >= report["median_ttft_ms"] > 0 and report["mean_e2el_ms"] > 0
    assert report["server_after_run"]["kv_cache_usage_perc"] == 0.0


def test_sharegpt_file_through_the_cli_saves_result_and_plots(bundled_server, tmp_path, capsys):
    from moekv.cli import main

    data = [{"conversations": [{"from": "human", "value": f"ROMEO {i}:"}, {"from": "gpt", "value": "Ay " * (i + 2)}]}
            for i in range(3)]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    code = main(["bench", "serve", "--base-url", bundled_server.url, "--dataset-name", "sharegpt",
                 "--dataset-path", str(tmp_path / "sg.json"), "--num-prompts", "6", "--request-rate", "inf",
                 "--max-concurrency", "3", "--metric-percentiles", "95", "--save-result", "--result-dir",
                 str(tmp_path), "--result-filename", "out.json", "--disable-tqdm"])
    printed = capsys.readouterr().out
    assert code == 0 and "TTFT" in printed and "p95" in printed
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["completed"] == 6 and report["request_rate"] == "inf" and "p95_tpot_ms" in report
    tokens_of_reply = {n for n in report["output_lens"]}
    assert len(tokens_of_reply) > 1 and min(tokens_of_reply) >= 2   # each reply's own token count (/tokenize)
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        assert "no plots" in printed
    else:
        for name in ("out-latency-cdf.png", "out-throughput.png"):
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""benchmarks/bench_prefix_cache.py end to end on a tiny random shape (CPU): both workloads, with and without
prefix caching, results written as JSON + markdown with hit rates and the identical-outputs check."""

from __future__ import annotations

import json

from benchmarks import bench_prefix_cache


def test_tiny_run_writes_hit_rates_and_identical_greedy_outputs(tmp_path):
    argv = ["--tiny", "--model", "mixtral-8x7b", "--prefix", "64", "--turns", "3", "--user", "8", "--answer", "3",
            "--concurrency", "4", "--out", str(tmp_path), "--tag", "tiny"]
    assert bench_prefix_cache.main(argv) == 0
    result = json.loads((tmp_path / "tiny.json").read_text())
    runs = {(r["workload"], r["prefix_caching"]): r for r in result["runs"]}
    assert set(runs) == {(w, c) for w in ("agentic", "concurrent") for c in (False, True)}
    assert all(r["requests"] == (3 if r["workload"] == "agentic" else 4) for r in runs.values())
    assert all(r["kv_usage_after"] == 0.0 for r in runs.values())
    assert runs["agentic", False]["hit_rate"] is None and runs["concurrent", False]["prefix_cache_hits"] == 0
    # agentic: turn i > 1 hits the full pages (16 tokens) the turn before it computed, prefix included
    agentic = runs["agentic", True]
    assert agentic["prefix_cache_queries"] == 72 + 83 + 94 and agentic["prefix_cache_hits"] == 0 + 64 + 80
    # concurrent: one request computes the 64-token prefix, the three others wait a step and hit it
    assert runs["concurrent", True]["prefix_cache_hits"] == 3 * 64
    assert [s["identical"] for s in result["summary"]] == [True, True]
    assert "| agentic | bf16 | on | 3 |" in (tmp_path / "tiny.md").read_text()
    assert result["env"]["commit"] and result["env"]["command"].startswith("PYTHONPATH=src:. python")


def test_batch_invariant_flag_reaches_the_engine_and_the_results(tmp_path, monkeypatch):
    from moekv.ops import dispatch

    seen = []
    original = bench_prefix_cache.Engine

    def engine(config, **kwargs):
        seen.append(config.kernels.batch_invariant)
        return original(config, **kwargs)

    monkeypatch.setattr(bench_prefix_cache, "Engine", engine)
    installed = dispatch.kernel_config()
    argv = ["--tiny", "--model", "mixtral-8x7b", "--workloads", "concurrent", "--prefix", "32", "--user", "4",
            "--answer", "2", "--concurrency", "2", "--batch-invariant", "--out", str(tmp_path), "--tag", "bi"]
    try:
        assert bench_prefix_cache.main(argv) == 0
    finally:
        dispatch.install(installed)                                 # the engines installed the mode
    result = json.loads((tmp_path / "bi.json").read_text())
    assert seen == [True, True] and result["config"]["batch_invariant"] is True
    assert result["summary"][0]["identical"] is True
    assert "Batch-invariant kernels: on." in (tmp_path / "bi.md").read_text()

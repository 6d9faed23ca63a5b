"""bench_offload.py: the speed command's CPU plumbing (tiny shape, a few modes) and the timeline command."""

from __future__ import annotations

import json
import sys

from tests.helpers import needs_bundled_model

pytestmark = needs_bundled_model


def _run(monkeypatch, argv):
    from benchmarks import bench_offload

    monkeypatch.setattr(sys, "argv", ["bench_offload.py", *argv])
    bench_offload.main()


def _speed(monkeypatch, out, modes: str, cache: str, profile_steps: int) -> dict:
    """The speed command on the tiny shape (4 timed tokens of a 512-token trace); its JSON report."""
    _run(monkeypatch, ["speed", "--tiny", "--device", "cpu", "--trace-tokens", "512", "--tokens", "4",
                       "--warmup", "1", "--profile-steps", str(profile_steps), "--cache", cache,
                       "--modes", modes, "--out", str(out)])
    return json.loads(out.with_suffix(".json").read_text())


def test_speed_runs_every_harness_and_checks_tokens(monkeypatch, tmp_path):
    out = tmp_path / "speed"
    report = _speed(monkeypatch, out, "on-demand,staged,device-graph", "50", 1)
    modes = [run["mode"] for run in report["runs"]]
    assert modes == ["resident", "resident-graph", "on-demand", "staged", "device-graph"]
    by_mode = {run["mode"]: run for run in report["runs"]}
    assert by_mode["staged"]["matches"] == "resident" and by_mode["device-graph"]["matches"] == "resident-graph"
    assert by_mode["on-demand"]["misses_per_token"] > 0 and by_mode["device-graph"]["misses_per_token"] > 0
    assert not report["mismatches"] and not report["failures"]
    markdown = out.with_suffix(".md").read_text()
    assert "Issue 24's targets" in markdown and "## Staged rows: the guess gate" in markdown
    staged = by_mode["staged"]["staged"]
    assert staged["decisions"] == 4 * 8                  # the timed steps only (not the profiled one after them)
    assert {"overruns", "issued", "used", "wasted", "budget", "host_ms"} <= set(staged)
    assert staged["gate"] == "measured" and not staged["measuring"]        # CPU copies: nothing to measure
    assert staged["overruns"] == staged["issued"] == 0                    # ... and no idle copy time to stage in


def test_timeline_command(monkeypatch, tmp_path):
    out = tmp_path / "timeline"
    _run(monkeypatch, ["timeline", "--max-tokens", "256", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    staged = [r for r in rows if r["mode"] == "staged"]
    assert len(staged) == 6 and all(r["steps_slower_than_on_demand"] == 0 for r in staged)
    assert all(r["speedup_vs_on_demand"] >= 1.0 for r in staged)


def test_speed_cpu_split_rows(monkeypatch, tmp_path):
    out = tmp_path / "split"
    report = _speed(monkeypatch, out, "on-demand,cpu-split-50", "25,50", 0)
    split = [run for run in report["runs"] if run["mode"] == "cpu-split-50"]
    assert [run["cache_percent"] for run in split] == [25, 50]
    for run in split:
        stats = run["cpu_split"]
        assert stats["fraction"] == 0.5 and stats["split_per_token"] > 0 and stats["cpu_ms_per_token"] > 0
        assert stats["split_per_token"] <= run["misses_per_token"]
        assert run["differs_from_resident_at"] is None          # fp32: the split changes no greedy token here
        assert "speedup_vs_on_demand" in run
    assert 0 < report["cpu_split"]["balanced_fraction"] < 1 and report["cpu_split"]["cpu_gb_per_s"] > 0
    assert "## CPU-split rows" in out.with_suffix(".md").read_text()
    assert not report["mismatches"] and not report["failures"]


def test_speed_guarded_rows(monkeypatch, tmp_path):
    out = tmp_path / "guard"
    report = _speed(monkeypatch, out, "on-demand,prefetch-guard,staged-guard", "50", 0)
    guarded = {run["mode"]: run for run in report["runs"] if run["mode"].endswith("-guard")}
    assert set(guarded) == {"prefetch-guard", "staged-guard"}
    for run in guarded.values():
        guard = run["guard"]
        # the exploration (2 rounds of 8-step windows per side) ran in the warm-up: a side is kept
        assert guard["prefetch"] in (True, False) and guard["windows_on"] >= 2 and guard["windows_off"] >= 2
        assert guard["median_ms_on"] > 0 and guard["median_ms_off"] > 0
        assert run["matches"] == "resident"               # either side keeps the greedy tokens
    markdown = out.with_suffix(".md").read_text()
    assert "## Guarded rows: what the prefetch guard kept" in markdown and "prefetch-guard" in markdown
    assert not report["mismatches"] and not report["failures"]

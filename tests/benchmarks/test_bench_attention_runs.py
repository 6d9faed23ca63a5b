"""benchmarks/bench_attention.py --runs N: the target table timed N times in one process, interleaved; each cell
the median of its run values with their [min, max], each speed-up the median of the per-run ratios (SDPA /
kernel of the same run). A tiny run on the CPU (Triton's interpreter) and the derivation on made-up values."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import attention_measure, attention_report, attention_setup, bench_attention


@pytest.fixture
def restore_settings(monkeypatch):
    """main() sets attention_setup's settings from its arguments (and --dry the device): put them back."""
    for name in ("SHAPES", "CURVE", "BITS", "FP_CONFIGS", "OUTLIERS", "DEVICE"):
        monkeypatch.setattr(attention_setup, name, getattr(attention_setup, name))


def test_runs_2_reports_medians_spreads_and_per_run_ratios(tmp_path, restore_settings):
    argv = ["--dry", "--no-sweep", "--shapes", "1x130", "--bits", "3", "--impls", "v4", "--runs", "2",
            "--out", str(tmp_path)]
    assert bench_attention.main(argv) == 0
    result = json.loads((tmp_path / "attention-bench.json").read_text())
    assert result["runs"] == 2
    row, = result["rows"]
    assert (row["batch"], row["context"]) == (1, 130)
    for name in ("sdpa", "bf16_paged", "int3"):
        runs = row[f"{name}_runs_ms"]
        assert len(runs) == 2 and all(t > 0 for t in runs)
        assert row[f"{name}_ms"] == pytest.approx(statistics.median(runs))
        assert row[f"{name}_spread_ms"] == [min(runs), max(runs)]
    for name in ("bf16_paged", "int3"):
        ratios = [s / k for s, k in zip(row["sdpa_runs_ms"], row[f"{name}_runs_ms"])]
        assert row[f"{name}_runs_speedup"] == pytest.approx(ratios)
        assert row[f"{name}_speedup"] == pytest.approx(statistics.median(ratios))
        assert row[f"{name}_speedup_spread"] == pytest.approx([min(ratios), max(ratios)])
    v4 = row["int3_impl_runs_ms"]["v4"]
    assert v4 == row["int3_runs_ms"] and row["int3_impl_ms"]["v4"] == pytest.approx(statistics.median(v4))
    assert len(row["sdpa_runs_variant"]) == 2
    markdown = (tmp_path / "attention-bench.md").read_text()
    assert "2 runs of the table in one process" in markdown
    assert f"{row['int3_ms']:.4f} ±" in markdown


def _row(sdpa_runs, kernel_runs) -> dict:
    """A row of SDPA, the paged bf16 kernel and int3 (the kernels with the same run times)."""
    row = {"batch": 32, "context": 16384, "sdpa_variant": "rows"}
    for name, runs, nbytes in (("sdpa", sdpa_runs, 10**9), ("bf16_paged", kernel_runs, 10**9),
                               ("int3", kernel_runs, 2 * 10**8)):
        row[f"{name}_bytes"], row[f"{name}_runs_ms"] = nbytes, list(runs)
        row[f"{name}_ms"], row[f"{name}_spread_ms"] = statistics.median(runs), [min(runs), max(runs)]
    return row


def test_speedup_is_the_median_of_per_run_ratios_not_the_ratio_of_medians(tmp_path):
    """SDPA [1, 2, 3] ms against the kernel's [1, 0.5, 3]: per-run ratios 1, 4, 1 -> 1.00x (medians: 2 / 1 = 2x)."""
    result = attention_measure.finish({"copy_bandwidth_tbps": 3.0, "read_bandwidth_tbps": None, "cold_l2": True,
                                       "runs": 3, "rows": [_row([1.0, 2.0, 3.0], [1.0, 0.5, 3.0])]})
    row, = result["rows"]
    assert row["int3_runs_speedup"] == [1.0, 4.0, 1.0]
    assert row["int3_speedup"] == 1.0 and row["int3_speedup_spread"] == [1.0, 4.0]
    env = {"gpu": "test", "date": "-", "commit": "-", "torch": "-", "triton": "-", "command": "-"}
    attention_report.write_markdown(tmp_path / "runs.md", env, result)
    text = (tmp_path / "runs.md").read_text()
    assert ("| 32 | 16384 | 2.0000 ±50.0% | 1.0000 ±125.0% (1.00x [1.00-4.00], 1.00) | - | "
            "1.0000 ±125.0% (1.00x [1.00-4.00], 0.20) | - |") in text


def test_one_run_keeps_the_plain_table(tmp_path):
    row = _row([2.0], [1.0])
    for name in ("sdpa", "bf16_paged", "int3"):
        del row[f"{name}_runs_ms"], row[f"{name}_spread_ms"]
    result = attention_measure.finish({"copy_bandwidth_tbps": 3.0, "read_bandwidth_tbps": None, "cold_l2": True,
                                       "rows": [row]})
    assert result["rows"][0]["int3_speedup"] == 2.0 and "int3_speedup_spread" not in result["rows"][0]
    env = {"gpu": "test", "date": "-", "commit": "-", "torch": "-", "triton": "-", "command": "-"}
    attention_report.write_markdown(tmp_path / "one.md", env, result)
    text = (tmp_path / "one.md").read_text()
    assert "| B | L | SDPA bf16 ms | paged bf16 ms (x, TB/s) | int4 ms (x, TB/s) | int3 ms (x, TB/s) |" in text
    assert "| 32 | 16384 | 2.0000 | 1.0000 (2.00x, 1.00) | - | 1.0000 (2.00x, 0.20) | - |" in text
    assert "±" not in text and "runs of the table" not in text

"""benchmarks/bench_fp8_linear.py --dry: dot vs fma through the interpreter, JSON + markdown written, outputs
checked against the reference."""

from __future__ import annotations

import json

from benchmarks import bench_fp8_linear


def test_dry_run_writes_results(tmp_path):
    assert bench_fp8_linear.main(["--dry", "--sweep", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fp8-linear-fma-cpu.json").read_text())
    variants = {(r["shape"], r["variant"]) for r in result["rows"]}
    assert {("qkv", "dot"), ("qkv", "fma"), ("o", "dot"), ("o", "fma")} <= variants
    assert all(r["max_rel_err"] < 1e-2 for r in result["rows"] if r["variant"] != "cublas")
    assert "Command: `PYTHONPATH=src:. python benchmarks/bench_fp8_linear.py --dry" in \
        (tmp_path / "fp8-linear-fma-cpu.md").read_text()

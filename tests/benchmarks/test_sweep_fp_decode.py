"""benchmarks/sweep_fp_decode.py --dry: the bf16 decode kernel's launch sweep through the interpreter on tiny shapes:
every config's output checked against the default launch's, JSON + markdown written with the best config."""

from __future__ import annotations

import json

from benchmarks import sweep_fp_decode


def test_dry_sweep_writes_results(tmp_path):
    argv = ["--dry", "--out", str(tmp_path), "--shapes", "1x96x2;2x40x4", "--block-n", "16,32", "--warps", "4",
            "--stages", "1", "--waves", "2"]
    assert sweep_fp_decode.main(argv) == 0
    result = json.loads((tmp_path / "fp-decode-sweep-cpu_dry_run.json").read_text())
    assert [(r["batch"], r["length"], r["kv_heads"]) for r in result["rows"]] == [(1, 96, 2), (2, 40, 4)]
    for row in result["rows"]:
        timed = [c for c in row["configs"] if "ms" in c]
        assert {c["BLOCK_N"] for c in timed} == {16, 32}
        assert all(c["max_abs_diff"] < 2e-2 for c in timed)          # the same attention as the default launch
        assert row["best"] in timed
    text = (tmp_path / "fp-decode-sweep-cpu_dry_run.md").read_text()
    assert "| 1 | 96 | 2 |" in text and "best config" in text

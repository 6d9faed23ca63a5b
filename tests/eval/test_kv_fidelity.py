"""`moekv eval kv` end to end on a short context of the bundled model (skipped without it)."""

import argparse
import json

from moekv.eval import kv_fidelity
from tests.helpers import needs_bundled_model


def eval_kv_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    kv_fidelity.add_arguments(parser)
    return parser


@needs_bundled_model
def test_eval_kv_writes_the_table(tmp_path, capsys):
    parser = eval_kv_parser()
    out = tmp_path / "rows.json"
    args = parser.parse_args(["--context", "160", "--windows", "2", "--chunk", "48", "--formats", "int3", "--full",
                              "--json", str(out)])
    assert kv_fidelity.run(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["kv_cache_dtype"], r["axis_mode"], r["outliers"]) for r in rows] == [
        ("fp32", "n/a", False), ("int3", "channel", True), ("int3", "channel", False),
        ("int3", "token", True), ("int3", "token", False)]
    for row in rows:
        for key in ("kv_cache_dtype", "outliers", "axis_mode", "perplexity", "kl", "bits_per_value"):
            assert key in row
        assert row["perplexity"] > 1 and row["kl"] >= 0
    assert rows[0]["kl"] == 0 and rows[0]["bits_per_value"] == 32
    # 160 tokens = one quantized page of 128 + a 32-token fp tail (staging page in fp32)
    assert 0 < rows[1]["kl"] < 0.05 and rows[1]["bits_per_value"] > 3
    assert 0 <= rows[1]["attn_rel_err"] < 1
    assert "KV cache fidelity" in capsys.readouterr().out


def test_variants_cover_the_table():
    rows = kv_fidelity.default_variants()
    assert len(rows) == 13 and rows[0].kv_cache_dtype == "bf16"
    int_rows = {(r.kv_cache_dtype, r.outliers, r.axis_mode) for r in rows[1:]}
    assert len(int_rows) == 12
    off = next(r for r in rows if r.is_low_bit and not r.outliers).cache_config()
    assert off.key_outlier_fraction == 0 and off.value_outlier_fraction == 0


def test_default_rows_are_the_shipped_configurations():
    quick = kv_fidelity.default_variants(full=False)
    assert [(r.kv_cache_dtype, r.axis_mode, r.outliers) for r in quick] == [
        ("bf16", "n/a", False), ("int4", "channel", True), ("int3", "channel", True), ("int2", "channel", True)]


@needs_bundled_model
def test_default_command_is_quick_and_sets_context(tmp_path, capsys):
    parser = eval_kv_parser()
    out = tmp_path / "rows.json"
    args = parser.parse_args(["--windows", "1", "--no-tensor-report", "--no-progress", "--json", str(out)])
    assert kv_fidelity.run(args) == 0
    rows = json.loads(out.read_text())
    assert args.context == 512 and [r["context"] for r in rows] == [512] * 5
    assert [r["kv_cache_dtype"] for r in rows] == ["fp32", "bf16", "int4", "int3", "int2"]
    kl = {r["kv_cache_dtype"]: r["kl"] for r in rows}
    assert kl["fp32"] == 0 < kl["bf16"] < kl["int4"] < kl["int3"] < kl["int2"] < 1   # fewer bits, more KL
    assert parser.parse_args(["--full"]).full and kv_fidelity.default_variants(full=True)[1].axis_mode == "channel"

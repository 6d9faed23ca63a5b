"""The benchmarks' FP8 and Qwen3-30B-A3B options on the CPU: arguments parse, the tiny runs write their
results with the weights tagged, and the byte counts behind TB/s and "% of floor" count FP8 as 1 byte
per weight plus its fp32 scales."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_decode, bench_moe, decode_floor
from moekv.core.fp8 import Fp8Weight
from moekv.models.loader import build_random_model
from moekv.models.registry import named_arch


def test_layer_bytes_count_fp8_codes_and_scales():
    gen = torch.Generator().manual_seed(0)
    w_gate_up, w_down = torch.randn(4, 32, 16, generator=gen), torch.randn(4, 16, 16, generator=gen)
    fp8_gate_up, fp8_down = bench_moe.quantize_layer(w_gate_up.bfloat16(), w_down.bfloat16(), None)
    assert isinstance(fp8_gate_up, Fp8Weight) and fp8_gate_up.block == (1, 16)
    hidden, ids = torch.zeros(1, 16, dtype=torch.bfloat16), torch.tensor([[0, 3]])
    bf16 = bench_moe.layer_bytes(w_gate_up.bfloat16(), w_down.bfloat16(), hidden, ids)
    fp8 = bench_moe.layer_bytes(fp8_gate_up, fp8_down, hidden, ids)
    assert bf16 == 2 * (32 * 16 + 16 * 16) * 2 + 2 * 16 * 2
    assert fp8 == 2 * (32 * 16 + 16 * 16 + 4 * (32 + 16)) + 2 * 16 * 2
    blocks = bench_moe.quantize_layer(w_gate_up, w_down, (16, 16))[0]
    assert blocks.block == (16, 16) and blocks.scale.shape == (4, 2, 1)


def test_floor_counts_touched_experts_and_fp8_bytes():
    arch = named_arch("qwen3-30b-a3b", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      num_experts=8, top_k=2, expert_intermediate_size=48, vocab_size=256)
    bf16 = build_random_model(arch, dtype=torch.bfloat16)
    fp8 = build_random_model(arch, dtype=torch.bfloat16, quantization="fp8")
    per_expert_bf16, rest_bf16 = decode_floor.weight_bytes(bf16)
    per_expert_fp8, rest_fp8 = decode_floor.weight_bytes(fp8)
    assert per_expert_bf16 == 3 * 64 * 48 * 2
    assert per_expert_fp8 == 3 * 64 * 48 + 4 * (2 * 48 + 64)            # codes + one fp32 scale per row
    assert rest_fp8 < rest_bf16
    one = decode_floor.floor_ms(bf16, 1, 100, 16, read_tbps=1.0)
    kv = 100 * 2 * 2 * 16 * 2 * 2
    assert one == pytest.approx((rest_bf16 + 2 * 2 * per_expert_bf16 + kv) / 1e9)
    assert decode_floor.floor_ms(bf16, 64, 100, 16, 1.0) > one           # nearly every expert at B=64
    assert decode_floor.floor_ms(bf16, 1, 100, 16, None) is None


@pytest.fixture
def restore_kernels():
    """bench_moe --tiny installs the Triton backend for the process: put the suite's configuration back."""
    from moekv.ops import dispatch

    installed = dispatch.installed_config()
    yield
    dispatch.install(installed)


def test_bench_moe_tiny_fp8_run(tmp_path, restore_kernels):
    assert bench_moe.main(["--tiny", "--model", "mixtral-8x7b,qwen3-30b-a3b", "--quantization", "fp8",
                           "--fp8-block", "16x16", "--tokens", "1", "--impl", "reference", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("moe-bench-tiny-fp8-*.json")).read_text())
    assert {(r["model"], r["weights"]) for r in result["moe_layer"]} == {("mixtral-8x7b", "fp8"),
                                                                           ("qwen3-30b-a3b", "fp8")}
    assert all(r["max_rel_err"] < 2e-2 for r in result["moe_layer"])
    with pytest.raises(SystemExit):
        bench_moe.main(["--tiny", "--quantization", "int4"])
    with pytest.raises(SystemExit):
        bench_moe.main(["--tiny", "--fp8-block", "128"])


def test_bench_moe_tiny_variants_and_fma_sweep(tmp_path, restore_kernels, monkeypatch):
    """--variants dot,fma --fma-sweep: the sweep (cut to a few launches here) feeds decode-fma-swept; every row names
    the configuration it ran; the markdown ends with the best tiles as a tuned entry's "fma"."""
    from benchmarks import moe_variants

    monkeypatch.setattr(moe_variants, "ROW_FACTORS", (1,))
    monkeypatch.setattr(moe_variants, "BLOCK_KS", (64,))
    assert bench_moe.main(["--tiny", "--quantization", "fp8", "--tokens", "1,5", "--variants", "dot,fma",
                           "--fma-sweep", "--impl", "decode-dot,decode-fma,decode-fma-swept", "--out",
                           str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("moe-bench-tiny-fp8-*-variants.json")).read_text())
    runs = {(r["tokens"], r["impl"]): r for r in result["moe_layer"]}
    assert set(runs) == {(1, "decode-dot"), (1, "decode-fma"), (1, "decode-fma-swept"), (5, "decode-dot")}
    assert runs[(1, "decode-fma")]["config"]["VARIANT"] == "fma"
    assert runs[(5, "decode-dot")]["config"]["VARIANT"] == "dot"
    assert all(r["max_rel_err"] < 2e-2 for r in result["moe_layer"])
    sweep = result["fma_sweep"]["mixtral-8x7b fp8"]
    assert {r["part"] for r in sweep["rows"]} == {"gate_up", "down"}
    assert sweep["best"]["down"]["SPLIT_K"] in (1, 2, 4, None)
    assert runs[(1, "decode-fma-swept")]["config"]["gate_up"]["BLOCK_K"] == sweep["best"]["gate_up"]["BLOCK_K"]
    assert '{"fma": {"gate_up"' in next(tmp_path.glob("*-variants.md")).read_text()
    with pytest.raises(SystemExit):
        bench_moe.main(["--tiny", "--variants", "dot", "--fma-sweep"])


def test_bench_decode_tiny_fp8_run(tmp_path):
    assert bench_decode.main(["--tiny", "--model", "qwen3-30b-a3b", "--quantization", "fp8", "--no-hf",
                              "--scenarios", "1x32:bf16", "--moe-tokens", "", "--steps", "1", "--warmup", "0",
                              "--profile-steps", "0", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("decode-bench-qwen3-30b-a3b-tiny-fp8-*.json")).read_text())
    assert [r["weights"] for r in result["decode"]] == ["fp8"] and not result["errors"]
    with pytest.raises(SystemExit):
        bench_decode.main(["--tiny", "--quantization", "fp4"])


def test_bench_moe_tiny_w8a8_row(tmp_path, restore_kernels):
    """FP8 experts get a moekv-grouped-w8a8 row (activations in e4m3): close to the exact layer, not equal to it."""
    assert bench_moe.main(["--tiny", "--quantization", "fp8", "--tokens", "5", "--impl",
                           "moekv-grouped,moekv-grouped-w8a8", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("moe-bench-tiny-fp8-*.json")).read_text())
    runs = {r["impl"]: r for r in result["moe_layer"]}
    assert set(runs) == {"moekv-grouped", "moekv-grouped-w8a8"}
    assert runs["moekv-grouped"]["max_rel_err"] < 2e-2
    assert 0 < runs["moekv-grouped-w8a8"]["max_rel_err"] < 0.15

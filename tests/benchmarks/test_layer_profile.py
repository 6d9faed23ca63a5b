"""benchmarks/layer_profile.py: attributing a trace's kernels to decoder layers (a hand-made trace with known
numbers), the kernel classes, the per-layer ranges on a real (CPU) profile, and bench_decode's --fusion /
--moe-combine / --layer-profile options on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_decode, decode_moekv, layer_profile


def _trace(layers: int, steps: int) -> list[dict]:
    """Per layer: a norm (2 us), a GEMM (10 us) and a Triton kernel launched by the driver API (3 us), each
    launched inside its layer's CPU range; per step one sampling kernel (5 us) launched outside every layer."""
    events, corr, ts = [], 0, 0.0

    def kernel(name, dur, start, launched_at, cat="cuda_runtime"):
        nonlocal corr
        corr += 1
        events.append({"ph": "X", "cat": cat, "name": "launch", "ts": launched_at, "dur": 1, "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, "args": {"correlation": corr}})

    for _ in range(steps):
        for layer in range(layers):
            events.append({"ph": "X", "cat": "user_annotation", "name": f"moekv_layer_{layer}", "ts": ts, "dur": 50})
            kernel("_rms_norm_kernel", 2.0, ts + 100, ts + 1)
            kernel("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", 10.0, ts + 110, ts + 5)
            kernel("_add_norm_route_kernel", 3.0, ts + 130, ts + 9, cat="cuda_driver")
            ts += 60
        kernel("void at::native::reduce_kernel<512, 1, at::native::ArgMaxOps<float>>(int)", 5.0, ts + 100, ts + 55)
        ts += 200
    return events


def test_attribute_counts_the_kernels_of_one_layer():
    profile = layer_profile.attribute(_trace(layers=4, steps=3), num_layers=4, num_steps=3)
    assert profile["layers_seen"] == 4
    assert profile["kernels_per_layer"] == pytest.approx(3.0)
    assert profile["small_kernels_per_layer"] == pytest.approx(2.0)
    assert [k["name"] for k in profile["kernels"]] == ["_rms_norm_kernel", "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT",
                                                       "_add_norm_route_kernel"]
    assert profile["us_per_layer"] == pytest.approx({"GEMM": 10.0, "attention": 0.0, "small": 5.0})
    assert profile["outside"] == pytest.approx({"launches_per_step": 1.0, "us_per_step": 5.0})
    lines = layer_profile.markdown(profile, "test")
    assert "3.0 kernels per layer (2.0 small)" in lines[2] and "**5.0**" in lines[2]


@pytest.mark.parametrize("name,cls", [
    ("_decode_gate_up_kernel", "GEMM"), ("_decode_down_kernel", "GEMM"), ("_combine_kernel", "small"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "small"), ("nvjet_sm90_tst_64x8", "GEMM"),
    ("_fp_decode_kernel", "attention"), ("void moekv_v7::decode_kernel<3, 128>(Params)", "attention"),
    ("_qk_norm_rotary_write_kernel", "small"), ("_stage_kernel", "small"), ("_skinny_fma_kernel", "GEMM"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl<>>", "small"),
])
def test_kernel_classes(name, cls):
    assert layer_profile.kernel_class(name) == cls


def test_short_name_drops_template_arguments():
    assert layer_profile.short_name("void at::native::reduce_kernel<512, 1, Op<float>>(Op<float>)") == \
        "at::native::reduce_kernel"


def test_layer_ranges_mark_each_layer_and_go_away():
    from torch.profiler import ProfilerActivity, profile

    from moekv.models.loader import build_random_model
    from moekv.models.registry import named_arch

    model = build_random_model(named_arch("mixtral-8x7b", **bench_decode.TINY_ARCH), dtype=torch.float32,
                               device="cpu", seed=0)
    tokens = list(range(3, 9))
    expected = decode_moekv.moekv_logits(model, tokens)
    with layer_profile.layer_ranges(model):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = decode_moekv.moekv_logits(model, tokens)
    assert torch.equal(got, expected)
    names = {e["name"] for e in layer_profile.trace_events(prof) if e.get("cat") == "user_annotation"}
    assert {"moekv_layer_0", "moekv_layer_1"} <= names
    assert all("forward_residual" not in vars(layer) for layer in model.layers)


def test_bench_decode_fusion_on_off_side_by_side(tmp_path):
    assert bench_decode.main(["--tiny", "--no-hf", "--scenarios", "1x32:bf16", "--moe-tokens", "", "--steps", "1",
                              "--warmup", "0", "--profile-steps", "1", "--fusion", "on,off", "--layer-profile",
                              "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("decode-bench-*.json")).read_text())
    rows = [(r["system"], r["fusion"]) for r in result["decode"]]
    assert rows == [("moekv", "on"), ("moekv-eager", "on"), ("moekv", "off"), ("moekv-eager", "off")]
    assert not result["errors"]
    with pytest.raises(SystemExit):
        bench_decode.main(["--tiny", "--fusion", "maybe"])


def test_bench_decode_moe_combine_on_off_side_by_side(tmp_path):
    """--moe-combine on,off: every moekv row once per value, tagged in the row and the markdown's column; the
    attention combine keeps its configured default (off)."""
    assert bench_decode.main(["--tiny", "--no-hf", "--scenarios", "1x32:bf16", "--moe-tokens", "", "--steps", "1",
                              "--warmup", "0", "--moe-combine", "on,off", "--out", str(tmp_path),
                              "--tag", "moecombine"]) == 0
    result = json.loads(next(tmp_path.glob("decode-bench-*-moecombine.json")).read_text())
    rows = [(r["system"], r["moe-combine"], r["attention-combine"]) for r in result["decode"]]
    assert rows == [("moekv", "on", "off"), ("moekv", "off", "off")]
    assert not result["errors"]
    markdown = next(tmp_path.glob("decode-bench-*-moecombine.md")).read_text()
    assert "| moe-combine |" in markdown
    with pytest.raises(SystemExit):
        bench_decode.main(["--tiny", "--moe-combine", "sometimes"])


def test_fusion_parity_of_layer_zero_under_the_triton_kernels():
    """Both sides on the Triton kernels (the interpreter here): fused on vs off agree on layer 0 -- the residual
    bit for bit, the MoE output to bf16 rounding; a wrong fused kernel moves them far more."""
    from moekv.models.loader import build_random_model
    from moekv.models.registry import named_arch
    from moekv.ops import dispatch

    model = build_random_model(named_arch("mixtral-8x7b", **bench_decode.TINY_ARCH), dtype=torch.bfloat16,
                               device="cpu", seed=0)
    with dispatch.override(backend="triton"):
        parity = layer_profile.fusion_parity(model, num_tokens=5)
    assert parity["residual_bit_equal"] and parity["residual_max_abs_diff"] == 0.0
    assert parity["moe_out_max_rel_diff"] <= 2 ** -7 and parity["expert_load_equal"]

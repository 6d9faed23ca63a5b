"""W8A8 FP8 experts: activations quantized to e4m3 per row (core.fp8.quantize_rows), the grouped kernel's fp8 x fp8
dots against the reference (`moe_experts_reference(act_fp8=True)`), on CUDA or under Triton's CPU interpreter; the
row quantizer's error bound; and when ops.dispatch runs it (KernelConfig.w8a8_min_tokens)."""

from __future__ import annotations

import pytest
import torch

from moekv.config import KernelConfig
from moekv.core.fp8 import fake_quantize_rows, quantize_rows
from moekv.errors import ConfigError
from moekv.ops import dispatch
from moekv.ops.reference.moe import moe_activation_reference, moe_experts_reference
from moekv.ops.triton.moe import grouped as moe_grouped
from tests.ops.helpers import assert_close
from tests.ops.test_fp8_kernels import GROUPED_CONFIG, _to, fp8_case

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def activations(x: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """random as given; heavy: channel magnitudes 1e-3 .. 30 (outlier channels, as LLM activations have); spike:
    one huge value in row 0 (the rest of that row falls to e4m3's subnormals or 0); zero: row 0 all zero;
    tails: Student-t(2) values."""
    if kind == "heavy":
        return x * torch.logspace(-3, 1.5, x.shape[1]).to(x.dtype)
    if kind == "spike":
        x = x.clone()
        x[0, 3] = 3e3
        return x
    if kind == "zero":
        x = x.clone()
        x[0] = 0
        return x
    if kind == "tails":
        return torch.distributions.StudentT(2.0).sample(x.shape).clamp(-1e3, 1e3).to(x.dtype)
    return x


def down_from(act, w_down, ids, weights, dtype):
    """The reference's W8A8 down projection and weighted sum from given activation rows act [T*k, I]."""
    rows = fake_quantize_rows(act)                                                       # [T*k, I] fp32
    flat = ids.reshape(-1)
    out = torch.stack([torch.nn.functional.linear(rows[s], w_down[int(flat[s])].dequantize())
                       for s in range(len(flat))])
    out = out.to(dtype).float().view(*ids.shape, -1)                                    # each slot rounded
    return (out * weights.float()[..., None]).sum(1).to(dtype)


# (T, k, E, H, I, weights, routing, block, dtype, activations): T across the decode limit (64) too
CASES = [
    (1, 2, 4, 64, 48, "random", "random", None, FP32, "random"),
    (5, 2, 4, 64, 48, "heavy", "hot", (16, 32), FP32, "heavy"),
    (7, 2, 4, 64, 48, "random", "sparse", (128, 128), BF16, "spike"),
    (9, 2, 4, 64, 48, "extreme", "random", (16, 32), FP16, "zero"),
    (70, 2, 6, 64, 48, "random", "random", None, BF16, "tails"),
    (70, 3, 6, 64, 48, "spiky", "repeat", (16, 32), FP32, "heavy"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}k{c[1]}-{c[5]}-{c[6]}-{c[7]}-{c[8]}-{c[9]}")
def test_grouped_w8a8_matches_reference(case, device):
    num_tokens, top_k, num_experts, hidden, inter, kind, pattern, block, dtype, acts = case
    gen = torch.Generator().manual_seed(num_tokens)
    x, w_gate_up, w_down, ids, weights = fp8_case(num_tokens, top_k, num_experts, hidden, inter, dtype, block, kind,
                                                  pattern)
    x = activations(x, acts, gen)
    x, w_gate_up, w_down, ids, weights = _to(device, x, w_gate_up, w_down, ids, weights)
    expected = moe_experts_reference(x, w_gate_up, w_down, ids, weights, act_fp8=True)
    out = moe_grouped.moe_experts_grouped(x, w_gate_up, w_down, ids, weights, config=GROUPED_CONFIG, act_fp8=True)
    # each launch against its reference: the gate_up launch's activations, then the down launch from those same
    # activations (a 16-bit activation one rounding step off -- the interpreter's fp32 -> bf16 cast truncates --
    # may move its e4m3 code a step: compared end to end only in fp32)
    act = moe_grouped.grouped_activation(x, w_gate_up, ids, GROUPED_CONFIG, act_fp8=True)
    assert_close(act, moe_activation_reference(fake_quantize_rows(x), w_gate_up, ids), dtype)
    assert_close(out, down_from(act, w_down, ids, weights, x.dtype), dtype)
    if dtype == FP32:
        assert_close(out, expected, dtype)
    w8a16 = moe_experts_reference(x, w_gate_up, w_down, ids, weights)
    assert not torch.equal(expected, w8a16)                     # the activations were quantized
    if acts == "random":                                        # and not by much: e4m3's 3 mantissa bits
        relative = (expected.float() - w8a16.float()).norm() / w8a16.float().norm()
        assert relative < 0.08


@pytest.mark.parametrize("kind", ["random", "heavy", "spike", "zero", "tails"])
def test_row_quantizer_error_bound(kind):
    """|x - dequantize(quantize(x))| <= 2^-4 |x| for e4m3 normals, and <= 2^-10 x the row's scale below them
    (subnormal spacing 2^-9); an all-zero row stays exactly zero."""
    gen = torch.Generator().manual_seed(1)
    x = activations(torch.randn(6, 256, generator=gen), kind, gen)
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6,)
    back = fake_quantize_rows(x)
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale[:, None] * 2.0 ** -10) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert (back.abs().amax(dim=1) <= x.abs().amax(dim=1) * (1 + 1e-6)).all()
    if kind == "zero":
        assert torch.equal(back[0], torch.zeros(256)) and scale[0] == 1.0


def test_dispatch_runs_w8a8_from_the_configured_size(device):
    x, w_gate_up, w_down, ids, weights = _to(device, *fp8_case(12, 2, 4, 64, 48, FP32, None))
    w8a16 = moe_experts_reference(x, w_gate_up, w_down, ids, weights)
    w8a8 = moe_experts_reference(x, w_gate_up, w_down, ids, weights, act_fp8=True)
    for backend in ("reference", "triton"):
        for minimum, expected in ((0, w8a16), (13, w8a16), (12, w8a8), (1, w8a8)):
            with dispatch.override(backend=backend, w8a8_min_tokens=minimum):
                assert_close(dispatch.moe_experts(x, w_gate_up, w_down, ids, weights), expected, FP32)
        with dispatch.override(backend=backend, w8a8_min_tokens=1, batch_invariant=True):
            assert not dispatch.w8a8(x, w_gate_up, w_down)     # per row already, but not part of that mode yet
    dense = (w_gate_up.dequantize().to(device), w_down.dequantize().to(device))
    with dispatch.override(w8a8_min_tokens=1):
        assert not dispatch.w8a8(x, *dense)                      # 16-bit experts: no W8A8


def test_w8a8_settings():
    assert KernelConfig().w8a8_min_tokens == 0
    assert KernelConfig(w8a8_min_tokens=64).w8a8_min_tokens == 64
    for bad in (-1, True, 1.5, "64"):
        with pytest.raises(ConfigError, match="w8a8_min_tokens"):
            KernelConfig(w8a8_min_tokens=bad)
    x, w_gate_up, w_down, ids, weights = fp8_case(2, 2, 4, 64, 48, FP32, None)
    with pytest.raises(ValueError, match="needs FP8 expert weights"):
        moe_experts_reference(x, w_gate_up.dequantize(), w_down.dequantize(), ids, weights, act_fp8=True)


def test_w8a8_env_override(monkeypatch):
    from moekv import envs

    monkeypatch.setenv("MOEKV_W8A8_MIN_TOKENS", "128")
    assert envs.kernel_overrides()["w8a8_min_tokens"] == 128
    assert KernelConfig.from_env().w8a8_min_tokens == 128
    monkeypatch.setenv("MOEKV_W8A8_MIN_TOKENS", "lots")
    with pytest.raises(ConfigError, match="MOEKV_W8A8_MIN_TOKENS"):
        envs.kernel_overrides()


@pytest.mark.parametrize("rows,block,dtype,acts", [(1, None, FP32, "random"), (5, (16, 32), BF16, "heavy"),
                                                   (40, None, FP16, "spike"), (70, (128, 128), FP32, "zero")], ids=str)
def test_fp8_linear_w8a8_matches_reference(rows, block, dtype, acts, device):
    """The dense projections' A8 path (the "dot" kernel at any row count, also where W8A16 would take the GEMV)."""
    from moekv.ops.reference.fp8_linear import fp8_linear as fp8_linear_reference
    from moekv.ops.triton.layer.fp8_linear import fp8_linear
    from tests.ops.test_fp8_kernels import fp8_weight

    gen = torch.Generator().manual_seed(rows)
    weight = fp8_weight((72, 96), block, gen, "random")
    x = activations(torch.randn(rows, 96, generator=gen), acts, gen).to(dtype)
    bias = torch.randn(72, generator=gen).to(dtype)
    x, weight, bias = _to(device, x, weight, bias)
    expected = fp8_linear_reference(x, weight, bias, act_fp8=True)
    assert_close(fp8_linear(x, weight, bias, act_fp8=True), expected, dtype)
    assert not torch.equal(expected, fp8_linear_reference(x, weight, bias))
    with dispatch.override(backend="triton", w8a8_min_tokens=rows):
        assert_close(dispatch.fp8_linear(x, weight, bias), expected, dtype)
    with dispatch.override(backend="triton", w8a8_min_tokens=rows + 1):
        assert_close(dispatch.fp8_linear(x, weight, bias), fp8_linear_reference(x, weight, bias), dtype)

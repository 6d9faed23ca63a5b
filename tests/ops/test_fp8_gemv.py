"""fp8_linear's GEMV ("fma") variant (ops.triton.layer.fp8_gemv) against ops.reference.fp8_linear at 1 to 4
rows, on CUDA or under Triton's CPU interpreter (tiny shapes): per-channel and block scales, bias, K and N
not multiples of the tiles, split-K; adversarial weights from test_fp8_kernels.fp8_weight (heavy channels,
e4m3 extremes, a huge weight); and the config switch that selects it."""

from __future__ import annotations

import pytest
import torch

from moekv.ops.reference.fp8_linear import fp8_linear as reference
from moekv.ops.triton.layer import fp8_gemv
from moekv.ops.triton.layer import fp8_linear as fp8_linear_module
from moekv.ops.triton.layer.fp8_linear import fp8_linear
from tests.ops.helpers import assert_close
from tests.ops.test_fp8_kernels import BF16, FP16, FP32, _to, fp8_weight

# (rows, N, K, kind, block, bias, dtype, fma tiles); N 70 / K 100 leave column and K tails
CASES = [
    (1, 72, 96, "random", None, False, BF16, {}),                                      # default fma tiles
    (1, 70, 100, "random", None, True, BF16, {"BLOCK_N": 8, "BLOCK_K": 32}),
    (1, 70, 100, "heavy", None, False, FP16, {"BLOCK_N": 4, "BLOCK_K": 32, "SPLIT_K": 3}),
    (1, 72, 256, "random", (128, 128), True, FP16, {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 2}),   # K capped
    (2, 70, 96, "extreme", (16, 32), True, FP32, {"BLOCK_N": 8, "BLOCK_K": 64}),
    (3, 72, 96, "spiky", (1, 48), False, BF16, {"BLOCK_N": 2, "BLOCK_K": 32, "UNROLL": 2}),
    (4, 70, 100, "extreme", None, True, BF16, {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2}),
    (4, 72, 96, "heavy", (16, 32), False, FP32, {"BLOCK_N": 1, "BLOCK_K": 16, "SPLIT_K": 4}),
]


def _case(rows, n, k, kind, block, bias, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = fp8_weight((n, k), block, gen, kind)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    x, weight = _to(device, x, weight)
    return x, weight, None if b is None else b.to(device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}N{c[1]}K{c[2]}-{c[3]}-{c[4]}-bias{int(c[5])}-{c[6]}")
def test_fp8_gemv_matches_reference(case, device, monkeypatch):
    rows, n, k, kind, block, bias, dtype, tiles = case
    x, weight, b = _case(rows, n, k, kind, block, bias, dtype, device)
    calls = []
    real = fp8_gemv.fp8_gemv
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = fp8_linear(x, weight, b, config={"VARIANT": "fma", **tiles})
    assert calls, "the fma variant did not run"
    expected = reference(x, weight, b)
    assert out.dtype == x.dtype
    assert_close(out, expected, dtype)
    if tiles.get("SPLIT_K", 1) > 1:        # the split-K sum is deterministic
        assert torch.equal(out, fp8_linear(x, weight, b, config={"VARIANT": "fma", **tiles}))


def test_variant_selection(device, monkeypatch):
    """"fma" by default at one row with per-channel scales (the session-27 sweep), "dot" with block scales and at
    2+ rows; config {"VARIANT": "fma"} takes 1-4 rows; 5 rows or codes not contiguous along K fall back to "dot"
    with its own tiles; default_config switching to "fma" takes over."""
    x, weight, _ = _case(1, 40, 64, "random", None, False, FP32, device)
    x2 = torch.randn(2, 64, device=device)
    x5 = torch.randn(5, 64, device=device)
    assert fp8_linear_module.default_config(1)["VARIANT"] == "fma"
    assert fp8_linear_module.default_config(2)["VARIANT"] == "dot"
    variant, cfg = fp8_linear_module.resolve_config(x, weight, None)
    assert variant == "fma" and cfg["BLOCK_N"] == 1 and cfg["BLOCK_K"] == 1024 and cfg["num_warps"] == 2
    assert_close(fp8_linear(x, weight), reference(x, weight), FP32)
    assert fp8_linear_module.resolve_config(x2, weight, None)[0] == "dot"
    xb, blocked, _ = _case(1, 40, 256, "random", (128, 128), False, FP32, device)
    assert fp8_linear_module.resolve_config(xb, blocked, None) == ("dot", fp8_linear_module.dot_config(1))
    monkeypatch.setattr(fp8_linear_module, "default_config",
                        lambda rows: {"VARIANT": "dot", **fp8_linear_module.dot_config(rows)})
    assert fp8_linear_module.resolve_config(x, weight, None)[0] == "dot"
    assert fp8_linear_module.resolve_config(x, weight, {"BLOCK_N": 16})[1]["BLOCK_N"] == 16
    variant, cfg = fp8_linear_module.resolve_config(x, weight, {"VARIANT": "fma", "BLOCK_N": 4})
    assert (variant, cfg) == ("fma", {"BLOCK_N": 4})
    variant, cfg = fp8_linear_module.resolve_config(x5, weight, {"VARIANT": "fma", "BLOCK_N": 4})
    assert (variant, cfg) == ("dot", fp8_linear_module.dot_config(5))
    assert_close(fp8_linear(x5, weight, config={"VARIANT": "fma", "BLOCK_N": 4}), reference(x5, weight), FP32)
    transposed = type(weight)(weight.codes.t().contiguous().t(), weight.scale, weight.block)
    assert fp8_linear_module.resolve_config(x, transposed, {"VARIANT": "fma"})[0] == "dot"
    monkeypatch.setattr(fp8_linear_module, "default_config",
                        lambda rows: {"VARIANT": "fma", "BLOCK_N": 2} if rows == 1 else {"VARIANT": "dot",
                                                                                         **fp8_linear_module.dot_config(rows)})
    assert fp8_linear_module.resolve_config(x, weight, None) == ("fma", {"BLOCK_N": 2})
    assert fp8_linear_module.resolve_config(x, weight, {"VARIANT": "dot"}) == ("dot", fp8_linear_module.dot_config(1))
    assert_close(fp8_linear(x, weight), reference(x, weight), FP32)


def test_fma_default_config():
    """Reasoned tiles: one-byte codes, 16 per thread and step; block scales cap BLOCK_K; split-K only when the
    column tiles leave SMs idle (132 off CUDA)."""
    cpu = torch.device("cpu")
    assert fp8_gemv.default_config(4096, 4096, None, cpu) == {
        "BLOCK_N": 1, "BLOCK_K": 4096, "num_warps": 8, "num_stages": 1, "UNROLL": 1, "SPLIT_K": 1}
    blocked = fp8_gemv.default_config(4096, 4096, 128, cpu)
    assert blocked["BLOCK_K"] == 128 and blocked["SPLIT_K"] == 1
    assert fp8_gemv.default_config(64, 16384, None, cpu)["SPLIT_K"] == 2       # K // (2 BLOCK_K) bounds it

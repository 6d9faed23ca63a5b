"""benchmarks/probe_key_scale_codes.py's 8-bit key scale / zero codes (a study, not the format): round-trip bounds."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.probe_key_scale_codes import (bits_at, coded_scale_zero, decode_scale, encode_scale, key_codes,
                                              page_base)

STEP = 2.0 ** (1 / 16)


def _ranges(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel ranges [N=3, H=2, 1, D=64]: spreads over 4 decades, centres around, above and below 0."""
    g = torch.Generator().manual_seed(seed)
    width = 10.0 ** (torch.rand(3, 2, 1, 64, generator=g) * 4 - 3)
    centre = torch.randn(3, 2, 1, 64, generator=g) * width * 2
    return centre - width / 2, centre + width / 2


def test_scale_code_rounds_up_within_one_step():
    lo, hi = _ranges()
    needed = (hi - lo) / 7
    base = page_base(needed)
    assert base.dtype == torch.float32 and bool((base.half().float() == base).all())   # an fp16 value
    assert bool((base >= needed.amax(dim=(2, 3), keepdim=True)).all())
    code = encode_scale(needed, base)
    assert code.dtype == torch.uint8
    scale = decode_scale(code, base)
    assert bool((scale >= needed).all())                      # rounded up: the page's range stays covered
    unclamped = code < 255
    assert bool((scale[unclamped] <= needed[unclamped] * STEP * (1 + 1e-6)).all())   # within one 2^(1/16) step
    # 32 steps per octave: within one 2^(1/32) step
    code32 = encode_scale(needed, base, steps=32)
    scale32 = decode_scale(code32, base, steps=32)
    assert bool((scale32 >= needed).all())
    ok = code32 < 255
    assert bool((scale32[ok] <= needed[ok] * 2.0 ** (1 / 32) * (1 + 1e-6)).all())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("mode", ["scale", "u8", "u8-32", "u8-64", "s8", "s8a"])
def test_coded_scale_zero_cover_the_range_and_codes_fit(bits, mode):
    lo, hi = _ranges(bits)
    got = coded_scale_zero(lo, hi, bits, mode)
    levels = (1 << bits) - 1
    scale, zero = got["scale"], got["zero"]
    tol = 1e-5 * (hi.abs() + lo.abs() + scale)
    assert bool((zero <= lo + tol).all()) and bool((zero + levels * scale >= hi - tol).all())
    assert got["scale_code"].dtype == torch.uint8
    if mode != "scale":
        zmin, zmax = (0, 255) if mode.startswith("u8") else (-128, 127)
        zc = got["zero_code"]
        assert int(zc.min()) >= zmin and int(zc.max()) <= zmax
        frac = got["frac"]
        assert torch.equal(zero, -(scale * zc.float()) / torch.exp2(frac))        # Z decodes from its code
    # a channel whose range includes 0 costs at most one scale step (plus the zero's resolution) over fp32
    inside = (lo <= 0) & (hi >= 0) & (got["scale_code"] < 255)
    exact = (hi - lo) / levels
    limit = STEP * levels / (levels - 1.0)      # zero grid of at most one whole step (s8a may pick f = 0)
    assert bool((scale[inside] <= exact[inside] * limit * (1 + 1e-5)).all())


def test_key_codes_patch_is_scoped_and_bits_drop():
    from moekv import kv
    from moekv.ops.reference import lowbit_quantize as ref

    original = ref._scale_zero
    x = torch.randn(256, 2, 64)
    plain = kv.quantize(x, "key", bits=3).dequantize()
    with key_codes("u8"):
        assert ref._scale_zero is not original
        coded = kv.quantize(x, "key", bits=3).dequantize()
    assert ref._scale_zero is original
    assert not torch.equal(plain, coded)
    rel = float((coded - x).norm() / (plain - x).norm())
    assert 0.95 < rel < 1.15                                  # same order of error, scale steps of 4.4 %
    before, after = bits_at(3, "fp16"), bits_at(3, "u8")
    assert before["exact"] == pytest.approx(3.229, abs=1e-3)
    # 254 bytes saved per page-head (128 channels x 2 bytes, minus the fp16 base) over 2 x 128 x 128 values
    assert before["exact"] - after["exact"] == pytest.approx(254 * 8 / (2 * 128 * 128))
    assert math.isclose(before["page_cycle"] - after["page_cycle"], before["exact"] - after["exact"], rel_tol=0.02)

"""benchmarks/probe_fp8_tail.py's FP8 e4m3 staging rows (a study, not the format): round-trip bounds, bits."""

from __future__ import annotations

import pytest
import torch

from benchmarks.probe_fp8_tail import E4M3_MAX, decode_attention, fp8_round, row_scale
from benchmarks.probe_fp8_tail_report import (cycle_bits,
                                       staged_bits)


def _rows(seed: int = 0) -> torch.Tensor:
    """[T=16, H=2, D=64] bf16-exact rows whose magnitudes span 6 decades, one row scale per (token, head)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 2, 64, generator=g) * 10.0 ** (torch.rand(16, 2, 1, generator=g) * 6 - 3)
    return x.to(torch.bfloat16).float()


def test_scale_is_fp16_rounded_up_and_covers_the_row():
    x = _rows()
    s = row_scale(x)
    assert s.shape == (16, 2, 1)
    assert bool((s.half().float() == s).all())                            # an fp16 value
    amax = x.abs().amax(-1, keepdim=True)
    assert bool((amax / s <= E4M3_MAX).all())                             # no code saturates
    need = amax / E4M3_MAX
    assert bool((s - need <= torch.maximum(need * 2.0 ** -10, torch.full_like(need, 2.0 ** -24))).all())  # one ulp
    pow2 = row_scale(x, "fp8-pow2")
    assert bool((torch.log2(pow2) == torch.log2(pow2).round()).all()) and bool((amax / pow2 <= E4M3_MAX).all())


@pytest.mark.parametrize("kind", ["fp8", "fp8-pow2"])
def test_round_trip_error_bound(kind):
    x = _rows(1)
    y = fp8_round(x, kind)
    s = row_scale(x, kind)
    # e4m3: 3 mantissa bits, half an ulp is at most 2^-4 of the value in the normal range; below 2^-6 (subnormal)
    # the step is 2^-9: absolute error at most 2^-10 times the row's scale
    bound = torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10)
    assert bool(((y - x).abs() <= bound * (1 + 1e-6)).all())
    assert bool((((y - x).abs() <= x.abs() * 2.0 ** -4 * (1 + 1e-6)) | (x.abs() < s * 2.0 ** -6)).all())
    assert bool(((y / s).to(torch.float8_e4m3fn).float() * s == y).all())  # y is exactly codes * scale
    big = x.abs().amax(-1, keepdim=True)                                   # the row's largest stays within 2^-4
    assert bool(((y.abs().amax(-1, keepdim=True) - big).abs() <= big * 2.0 ** -4).all())
    assert torch.equal(fp8_round(x, kind), y)                              # deterministic


def test_zero_and_constant_rows():
    zeros = torch.zeros(3, 2, 64)
    assert torch.equal(fp8_round(zeros), zeros)
    const = torch.full((3, 2, 64), -3.25)
    assert torch.allclose(fp8_round(const), const, rtol=2.0 ** -10, atol=0)   # the max lands on 448 * s
    mixed = torch.zeros(1, 1, 64)
    mixed[0, 0, 5] = 1e-30                                                 # far below fp16: the 2^-24 scale floor
    assert bool((fp8_round(mixed).abs() <= 2.0 ** -24 * 2.0 ** -10).all())


def test_non_finite_entries_pass_through():
    x = _rows(2)[:2]
    x[0, 0, 3], x[0, 1, 7], x[1, 0, 0] = float("nan"), float("inf"), float("-inf")
    y = fp8_round(x)
    assert bool(torch.isnan(y[0, 0, 3])) and y[0, 1, 7] == float("inf") and y[1, 0, 0] == float("-inf")
    finite = torch.isfinite(x)
    clean = torch.where(finite, x, torch.zeros(()))
    assert torch.equal(y[finite], fp8_round(clean)[finite])                # scale from the finite entries only
    assert torch.equal(fp8_round(x, "bf16")[finite], x[finite])


def test_bits_and_decode_attention_reduce_to_known_cases():
    assert staged_bits("fp8", 128) == 8.125 and staged_bits("bf16", 128) == 16.0
    assert cycle_bits(3, 16.0) == pytest.approx(3.3650, abs=1e-4)        # today's int3 page cycle at 16k
    assert cycle_bits(3, 8.125) < cycle_bits(3, 16.0)
    from moekv.eval.kv_runner import sampled_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(300, h, 16, generator=g) for h in (4, 2, 2))
    positions = torch.arange(3, 300, 4)
    exact = sampled_attention(q, k, v, positions, 0.25)
    assert torch.allclose(decode_attention(q, k, v, k, v, k, v, positions, 0.25), exact, atol=1e-5)
    # the own row is read from own_*, not from the tail: a corrupted tail row at a query's own position is unseen
    tail_k = k.clone()
    tail_k[positions[-1]] = 100.0
    assert torch.allclose(decode_attention(q, k, v, tail_k, v, k, v, positions[-1:], 0.25), exact[-1:], atol=1e-5)

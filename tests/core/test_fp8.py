"""The FP8 weight record: quantize / dequantize error bounds on random and adversarial weights, the
checkpoint scale layouts, exact re-blocking, and clear errors on inconsistent records."""

from __future__ import annotations

import pytest
import torch

from moekv.core.fp8 import (FP8_DTYPE, FP8_MAX, Fp8Weight, concat_rows, encode_fp8, per_channel_scale,
                            quantize_fp8, rowwise)
from moekv.errors import ConfigError

# e4m3: 3 mantissa bits -> a normal value rounds within 2^-4 of itself; below 2^-6 (subnormals) the step is
# 2^-9 of the scale. So |w - deq| <= max(2^-4 |w|, 2^-10 * scale) elementwise (half a step of either).
REL, SUBNORMAL_STEP = 2.0 ** -4, 2.0 ** -9


def _check_error(weight: torch.Tensor, quantized: Fp8Weight) -> None:
    deq = quantized.dequantize()
    rows, cols = weight.shape[-2:]
    scale = quantized.scale.repeat_interleave(quantized.block[0], -2)[..., :rows, :]
    scale = scale.repeat_interleave(quantized.block[1], -1)[..., :cols]
    bound = torch.maximum(REL * weight.abs(), 0.5 * SUBNORMAL_STEP * scale) * (1 + 1e-6)
    assert torch.isfinite(deq).all()
    assert ((deq - weight).abs() <= bound).all(), ((deq - weight).abs() - bound).max()


@pytest.mark.parametrize("block", [None, (128, 128), (16, 32), (3, 5)], ids=str)
@pytest.mark.parametrize("shape", [(40, 96), (3, 24, 40)], ids=str)
def test_quantize_error_bound_random(block, shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    quantized = quantize_fp8(weight, block)
    assert quantized.codes.dtype == FP8_DTYPE and quantized.codes.shape == weight.shape
    _check_error(weight, quantized)
    # the largest magnitude of every block maps to the largest code exactly
    assert quantized.codes.float().abs().max() == FP8_MAX


def test_heavy_channels_do_not_swamp_light_ones():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 64, generator=gen) * 1e-3
    weight[3] *= 1e6                                    # one output channel a million times heavier
    weight[7, 5] = 0.0
    per_channel = quantize_fp8(weight)
    _check_error(weight, per_channel)
    light = torch.arange(16) != 3
    rel = ((per_channel.dequantize() - weight).abs()[light] / weight.abs()[light].clamp_min(1e-30))
    assert rel[weight[light] != 0].max() <= REL * (1 + 1e-6)
    # per tensor, the same light channels lose (nearly) everything: the reason scales are per channel
    per_tensor = quantize_fp8(weight, (16, 64))
    assert (per_tensor.dequantize()[light] == 0).float().mean() > 0.9


def test_zeros_spikes_and_static_scales():
    weight = torch.zeros(8, 32)
    weight[2, 3] = 1e30                                 # a huge spike: its channel's other values underflow
    weight[4] = torch.linspace(-1, 1, 32)
    quantized = quantize_fp8(weight)
    assert torch.equal(quantized.scale[0], torch.ones(1))          # all-zero channel: scale 1, codes 0
    assert (quantized.codes.float()[0] == 0).all()
    assert quantized.dequantize()[2, 3] == pytest.approx(1e30, rel=1e-6)
    _check_error(weight, quantized)
    # a static scale smaller than the data: values beyond 448 * scale saturate at +-448 (never NaN / inf)
    static = encode_fp8(torch.tensor([[1e6, -1e6, 3.0, 0.0]]), torch.tensor([[0.01]]), (1, 4))
    codes = static.codes.float()[0]
    assert codes[0] == FP8_MAX and codes[1] == -FP8_MAX and codes[3] == 0
    assert static.dequantize()[0, :2].tolist() == pytest.approx([4.48, -4.48])
    assert abs(static.dequantize()[0, 2] - 3.0) <= REL * 3.0
    assert torch.isfinite(static.dequantize()).all()


def test_checkpoint_scale_layouts():
    assert per_channel_scale(torch.tensor(0.5), (4, 8)).tolist() == [[0.5]] * 4
    assert per_channel_scale(torch.tensor([0.5]), (4, 8)).shape == (4, 1)
    assert per_channel_scale(torch.arange(4.0), (4, 8)).flatten().tolist() == [0, 1, 2, 3]
    assert per_channel_scale(torch.arange(4.0).reshape(4, 1), (4, 8)).shape == (4, 1)
    per_expert = per_channel_scale(torch.tensor([1.0, 2.0]), (2, 3, 8))          # one per expert
    assert per_expert.shape == (2, 3, 1) and per_expert[1].flatten().tolist() == [2.0] * 3
    with pytest.raises(ConfigError, match="per output channel"):
        per_channel_scale(torch.ones(3), (4, 8))


def test_rowwise_and_concat_are_exact():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(48, 64, generator=gen), torch.randn(16, 64, generator=gen)
    parts = [quantize_fp8(q, (32, 32)), quantize_fp8(k, (32, 32))]         # 16 rows: not a multiple of 32
    assert torch.equal(rowwise(parts[1]).dequantize(), parts[1].dequantize())
    fused = concat_rows(parts)
    assert fused.block == (1, 32)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    aligned = concat_rows([quantize_fp8(q, (16, 32)), quantize_fp8(k, (16, 32))])
    assert aligned.block == (16, 32) and aligned.scale.shape == (4, 2)
    experts = quantize_fp8(torch.randn(3, 16, 64, generator=gen), (16, 32))
    assert torch.equal(experts[1].dequantize(), experts.dequantize()[1])      # [expert] slices codes and scales


def test_record_validation():
    codes = torch.zeros(4, 8, dtype=FP8_DTYPE)
    with pytest.raises(ConfigError, match="needs scales of shape"):
        Fp8Weight(codes, torch.ones(4, 2), (1, 8))
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        Fp8Weight(torch.zeros(4, 8), torch.ones(4, 1), (1, 8))
    with pytest.raises(ConfigError, match="float32"):
        Fp8Weight(codes, torch.ones(4, 1, dtype=torch.bfloat16), (1, 8))
    assert Fp8Weight(codes, torch.ones(4, 1), (1, 8)).nbytes == 32 + 16

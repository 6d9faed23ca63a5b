"""Triton page-fill quantization vs the reference quantizer (ops.reference.lowbit.quantize_pages).

Channel axis: bit-exact (codes, fp16 scales/zeros, outlier residuals/indices/counts). Token axis:
bit-exact here too, but the kernel's scale codes come from log2/exp2 whose last-ulp rounding may
differ on a GPU, so there the check is one scale step (see ops/triton/lowbit/quantize.py).
The oracle always runs on the CPU: torch's CUDA division by a scalar is not IEEE-exact.
"""

from __future__ import annotations

import pytest
import torch

from moekv.core.lowbit_layout import PackedPages, QuantSpec
from moekv.ops import dispatch
from moekv.ops.reference import lowbit as reference
from moekv.ops.triton.lowbit.quantize import quantize_pages
from moekv.testing.attention_cases import make_data


def compare(x: torch.Tensor, spec: QuantSpec) -> None:
    expected, expected_qualifying = reference.quantize_pages(x.cpu(), spec)
    expected = PackedPages(**{name: t.to(x.device) for name, t in expected.tensors().items()},
                           **({"scale_base": None} if expected.scale_base is None else {}))
    expected_qualifying = expected_qualifying.to(x.device)
    packed, qualifying = quantize_pages(x, spec)
    assert torch.equal(qualifying, expected_qualifying)
    exact = x.device.type == "cpu" or spec.axis == "channel"
    for name, want in expected.tensors().items():
        got = packed.tensors()[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if exact:
            assert torch.equal(got, want), name
    if not exact:   # token axis on a GPU: decodes within a quantization step of the reference
        step = reference.token_scale_zero(expected.scale, expected.zero, expected.scale_base, spec)[0]
        error = (reference.dequantize_pages(packed, spec) - reference.dequantize_pages(expected, spec)).abs()
        assert (error <= 1.01 * step.repeat_interleave(spec.group_size, -1) + 1e-3).all()


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("axis,group_size", [("channel", None), ("token", None), ("token", 16)])
@pytest.mark.parametrize("kind", ["normal", "outlier_channels", "large"])
def test_quantize_matches_reference(device, bits, axis, group_size, kind):
    spec = QuantSpec(bits=bits, axis=axis, head_dim=64, page_size=16, group_size=group_size,
                     outlier_capacity=QuantSpec.capacity_for(0.02, 16, 64))
    x = make_data((3, 2, 16, 64), torch.float32, kind, torch.Generator().manual_seed(bits)).to(device)
    compare(x, spec)


@pytest.mark.parametrize("capacity", [0, 2])
def test_quantize_budget(device, capacity):
    # more values qualify than the budget holds (or none fit): the largest deviations win
    spec = QuantSpec(bits=3, axis="channel", head_dim=64, page_size=16, outlier_capacity=capacity)
    x = make_data((2, 2, 16, 64), torch.float32, "outlier_channels", torch.Generator().manual_seed(9)).to(device)
    compare(x, spec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_half_inputs_and_strided_layout(device, dtype):
    # the cache hands pages over as a transposed view [N, H, P, D] of [N, P, H, D] rows
    spec = QuantSpec(bits=4, axis="channel", head_dim=128, page_size=32, outlier_capacity=41)
    rows = make_data((2, 32, 2, 128), dtype, "outlier_channels", torch.Generator().manual_seed(3)).to(device)
    compare(rows.transpose(1, 2), spec)


def test_dispatch_switch(device, triton_backend):
    spec = QuantSpec(bits=2, axis="token", head_dim=64, page_size=16, outlier_capacity=10)
    x = make_data((1, 2, 16, 64), torch.float32, "normal", torch.Generator().manual_seed(4)).to(device)
    packed, _ = dispatch.quantize_pages(x, spec)
    with dispatch.override(backend="reference"):
        expected, _ = dispatch.quantize_pages(x, spec)
        assert torch.equal(packed.codes, expected.codes)


@pytest.mark.parametrize("axis,group_size", [("channel", None), ("token", None), ("token", 16)])
@pytest.mark.parametrize("kind,bits", [("normal", 2), ("heavy_tail", 3), ("spikes", 2), ("constant", 4),
                                       ("near_max", 3), ("outlier_channels", 3)])
@pytest.mark.parametrize("refine", [0, 3])
def test_range_search_matches_reference(device, bits, axis, group_size, kind, refine):
    # range search (clip_steps, then each end alone: clip_refine): same stored layout, candidates chosen by
    # least squared error; adversarial data (heavy tails, sparse spikes, constant pages, values near the fp16
    # maximum, heavy channels) with and without outliers
    capacity = QuantSpec.capacity_for(0.01 if kind != "normal" else 0.0, 16, 64)
    spec = QuantSpec(bits=bits, axis=axis, head_dim=64, page_size=16, group_size=group_size,
                     outlier_capacity=capacity, clip_steps=6, clip_refine=refine)
    x = make_data((2, 2, 16, 64), torch.float32, kind, torch.Generator().manual_seed(10 + bits)).to(device)
    compare(x, spec)


def test_range_search_staged_kv_matches_reference(device):
    # the decode step's one-launch key + value quantizer with different clip steps per side
    key_spec = QuantSpec(bits=2, axis="channel", head_dim=64, page_size=16, clip_steps=3, clip_refine=1)
    value_spec = QuantSpec(bits=2, axis="token", head_dim=64, page_size=16, outlier_capacity=4, clip_steps=8,
                           clip_refine=2)
    gen = torch.Generator().manual_seed(21)
    staging_k = make_data((3, 16, 2, 64), torch.float32, "heavy_tail", gen).to(device)
    staging_v = make_data((3, 16, 2, 64), torch.float32, "normal", gen).to(device)
    slots = torch.tensor([2, 0], device=device)
    pages = torch.tensor([1, 3], device=device)
    outs = _staged_both_ways(staging_k, staging_v, slots, pages, key_spec, value_spec, device)


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 3])
def test_range_search_never_raises_the_squared_error(axis, bits):
    # per group the chosen candidate is the least squared error of k = 0..clip_steps, k = 0 being min/max;
    # so the page's total squared error over inliers can only go down, and on Gaussian data it does
    x = torch.randn(4, 2, 128, 64, generator=torch.Generator().manual_seed(bits))
    errors = []
    for steps in (0, 2, 8):
        spec = QuantSpec(bits=bits, axis=axis, head_dim=64, page_size=128, clip_steps=steps)
        packed, _ = reference.quantize_pages(x, spec)
        errors.append(float((reference.dequantize_pages(packed, spec) - x).square().sum()))
    assert errors[0] >= errors[1] >= errors[2]
    assert errors[2] < (0.85 if bits == 2 else 0.95) * errors[0]


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_range_refine_never_raises_the_squared_error(axis, bits):
    # clip_refine only adds candidates after the symmetric search (a later one wins only when strictly better),
    # so per group the squared error cannot rise; on skewed data (a Gaussian plus an exponential tail on one
    # side) the asymmetric ranges it finds lower the page's error measurably
    gen = torch.Generator().manual_seed(30 + bits)
    x = torch.randn(4, 2, 128, 64, generator=gen) + torch.empty(4, 2, 128, 64).exponential_(generator=gen)
    spec = QuantSpec(bits=bits, axis=axis, head_dim=64, page_size=128, clip_steps=8)
    grouped_errors = []
    for refine in (0, 4):
        spec = QuantSpec(bits=bits, axis=axis, head_dim=64, page_size=128, clip_steps=8, clip_refine=refine)
        packed, _ = reference.quantize_pages(x, spec)
        squared = (reference.dequantize_pages(packed, spec) - x).square()
        grouped_errors.append(squared.sum(2) if axis == "channel" else squared.sum(-1))
    plain, refined = grouped_errors
    assert (refined <= plain).all()
    assert refined.sum() < 0.98 * plain.sum()


def test_clip_steps_validated():
    with pytest.raises(ValueError, match="clip_steps"):
        QuantSpec(bits=3, axis="channel", head_dim=64, page_size=16, clip_steps=9)
    with pytest.raises(ValueError, match="clip_refine"):
        QuantSpec(bits=3, axis="channel", head_dim=64, page_size=16, clip_steps=2, clip_refine=3)


@pytest.mark.parametrize("axis,group_size", [("channel", None), ("token", None), ("token", 16)])
@pytest.mark.parametrize("kind,bits", [("normal", 4), ("outlier_channels", 4), ("spikes", 3), ("heavy_tail", 2),
                                       ("constant", 4), ("near_max", 4)])
def test_outliers_by_range_match_reference(device, bits, axis, group_size, kind):
    # outlier_select "range" (greedy: the group end whose removal shrinks its squared range most; ties to the
    # lowest index): same bits as the reference, with and without a range search afterwards
    capacity = QuantSpec.capacity_for(0.02, 16, 64)
    steps = 0 if bits == 4 else 8
    spec = QuantSpec(bits=bits, axis=axis, head_dim=64, page_size=16, group_size=group_size,
                     outlier_capacity=capacity, outlier_select="range", clip_steps=steps, clip_refine=min(steps, 2))
    x = make_data((2, 2, 16, 64), torch.float32, kind, torch.Generator().manual_seed(40 + bits)).to(device)
    compare(x, spec)


def test_outliers_by_range_staged_kv_matches_reference(device):
    # the decode step's one-launch quantizer, range-chosen outliers on both sides: same bits and counters
    # (outliers stored = the greedy steps that removed a value, whatever tau says)
    key_spec = QuantSpec(bits=4, axis="channel", head_dim=64, page_size=16, outlier_capacity=6,
                         outlier_select="range")
    value_spec = QuantSpec(bits=4, axis="token", head_dim=64, page_size=16, group_size=32, outlier_capacity=5,
                           outlier_select="range")
    gen = torch.Generator().manual_seed(22)
    staging_k = make_data((3, 16, 2, 64), torch.float32, "outlier_channels", gen).to(device)
    staging_v = make_data((3, 16, 2, 64), torch.float32, "normal", gen).to(device)
    slots = torch.tensor([2, 0, 1], device=device)
    pages = torch.tensor([1, -1, 3], device=device)
    outs = _staged_both_ways(staging_k, staging_v, slots, pages, key_spec, value_spec, device)
    assert outs[0][2][1] == 2 * 2 * 6 and outs[0][2][5] == 2 * 2 * 5       # every slot used, 2 pages x 2 heads


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_outliers_by_range_take_the_extremes_that_widen_a_range(axis):
    # a few values far outside their group: the greedy choice takes exactly them first (each removal shrinks
    # its group's range the most), then fills the rest of the budget; the inlier error falls below the
    # deviation choice's, which spends slots on mid-sized tail values of wide groups
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, 128, 64, generator=gen)
    spikes = [(3, 5, 40.0), (70, 17, -25.0), (100, 60, 30.0)]
    for token, channel, value in spikes:
        x[0, 0, token, channel] = value
    group_size = 32 if axis == "token" else None
    spec = QuantSpec(bits=4, axis=axis, head_dim=64, page_size=128, group_size=group_size, outlier_capacity=8,
                     outlier_select="range")
    packed, _ = reference.quantize_pages(x, spec)
    kept = set((packed.outlier_idx[0, 0].long() & 0xFFFF).tolist())
    assert {t * 64 + c for t, c, _ in spikes} <= kept and int(packed.outlier_count[0, 0]) == 8
    errors = []
    for select in ("deviation", "range"):
        spec = QuantSpec(bits=4, axis=axis, head_dim=64, page_size=128, group_size=group_size, outlier_capacity=29,
                         outlier_select=select, outlier_tau=2.0)
        packed, _ = reference.quantize_pages(x, spec)
        errors.append(float((reference.dequantize_pages(packed, spec) - x).square().sum()))
    assert errors[1] < errors[0]


def test_outlier_select_validated():
    with pytest.raises(ValueError, match="outlier_select"):
        QuantSpec(bits=4, axis="channel", head_dim=64, page_size=16, outlier_select="magnitude")


def _staged_both_ways(staging_k, staging_v, slots, pages, key_spec, value_spec, device):
    """quantize_staged_kv_counted by the reference and by Triton into fresh 4-page, 2-head pools: every stored tensor
    and the counters bit-equal; returns [(keys, values, counters)] of the reference, then of Triton."""
    from moekv.ops.triton.lowbit import quantize as triton_quantize

    outs = []
    for module in (reference, triton_quantize):
        k_out, v_out = (PackedPages.empty(s, 4, 2, device) for s in (key_spec, value_spec))
        counters = torch.zeros(8, dtype=torch.int64, device=device)
        module.quantize_staged_kv_counted(staging_k, staging_v, slots, pages, key_spec, value_spec, k_out, v_out,
                                          counters, (0, 1, 2, 3), (4, 5, 6, -1))
        outs.append((k_out, v_out, counters))
    for want, got in zip(outs[0][:2], outs[1][:2]):
        for name, tensor in want.tensors().items():
            assert torch.equal(got.tensors()[name], tensor), name
    assert torch.equal(outs[0][2], outs[1][2])
    return outs


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_quantize_fragment_order(device, bits, axis):
    # int4 / int3 / int2 pages of head_dim 128 and 32-token chunks are stored in fragment order (core.lowbit_order): the
    # Triton store's addresses against the reference's permutation, key order (channel axis) and value order (token)
    spec = QuantSpec(bits=bits, axis=axis, head_dim=128, page_size=64, outlier_capacity=12)
    assert spec.code_order == ("key" if axis == "channel" else "value")
    x = make_data((1, 2, 64, 128), torch.float32, "outlier_channels", torch.Generator().manual_seed(5)).to(device)
    compare(x, spec)

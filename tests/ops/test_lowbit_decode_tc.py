"""Tensor-core low-bit decode kernel (ops.triton.lowbit.decode_tc) vs the PyTorch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekv.ops.reference.lowbit import paged_attention_lowbit as reference
from moekv.ops.triton.lowbit.decode_tc import paged_attention_lowbit_decode_tc as kernel
from moekv.ops.triton.lowbit.decode_tc import supports
from moekv.testing.attention_cases import build_case
from tests.ops.helpers import assert_close

SCALE = 0.125
DECODE = dict(context_lens=[0, 1, 40, 100], query_lens=[1, 1, 1, 1])   # empty, tiny, ragged, several pages


def check(case, dtype, **overrides):
    assert_close(kernel(*case.args(), SCALE, **overrides), reference(*case.args(), SCALE), dtype)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "outlier_channels"), (torch.bfloat16, "outlier_channels"),
                                        (torch.float16, "normal")])
def test_formats(device, bits, dtype, kind):
    check(build_case(**DECODE, num_kv_heads=2, group=4, head_dim=64, bits=bits, page_size=16, dtype=dtype,
                     kind=kind, device=device), dtype)


@pytest.mark.parametrize("bits,dtype", [(3, torch.bfloat16), (4, torch.float32)])
def test_head_dim_128(device, bits, dtype):
    check(build_case([5, 33], [1, 1], 2, 4, 128, bits, 16, dtype=dtype, kind="outlier_channels", seed=1,
                     device=device), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_values(device, dtype):
    check(build_case([50, 17], [1, 1], 2, 4, 64, 3, 16, dtype=dtype, kind="large", seed=2, device=device), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_axis_keys(device, dtype):
    check(build_case([45, 64], [1, 1], 2, 4, 64, 4, 16, dtype=dtype, key_axis="token", kind="outlier_channels",
                     seed=3, device=device), dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sink_pages_and_splits(device, num_splits):
    # the first two pages of each sequence stay in fp staging pages, before low-bit ones
    case = build_case([90, 20, 70], [1, 1, 1], 2, 4, 64, 3, 16, sink_pages=2, seed=4, device=device)
    check(case, torch.float32, num_splits=num_splits, SCAN=4)


def test_no_outlier_capacity_group_1(device):
    check(build_case([40, 3], [1, 1], 1, 1, 64, 2, 16, outlier_fraction=0.0, seed=5, device=device), torch.float32)


def test_page_size_32_elementwise_outliers(device):
    case = build_case([70, 31], [1, 1], 2, 4, 64, 4, 32, kind="outlier_channels", seed=6, device=device)
    check(case, torch.float32, outliers="elementwise", BLOCK_C=8)
    check(case, torch.float32, BLOCK_C=32)


# the layout / latency switches of the main loop: the old paths (spread, perm off), preloaded outlier chunks
# (outlier_pre: fewer, as many as and more than the capacity; the remainder loop after them), L2 prefetch
# (a no-op in the interpreter: the plumbing only)
LOOP_VARIANTS = [{"spread": False, "perm": False}, {"outlier_pre": 1}, {"outlier_pre": 3, "l2_prefetch": True},
                 {"outlier_pre": 2, "spread": False, "codes": "subnormal"}]


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "outlier_channels"), (torch.bfloat16, "outlier_channels"),
                                        (torch.float16, "normal"), (torch.float16, "large")])
def test_loop_variants(device, bits, dtype, kind):
    # empty, length 1, ragged and several-page contexts, a sink page; planted 50x channels / 1e4 values
    case = build_case([0, 1, 40, 100], [1, 1, 1, 1], 2, 4, 64, bits, 16, dtype=dtype, kind=kind, sink_pages=1,
                      seed=11, device=device)
    want = reference(*case.args(), SCALE)
    for overrides in LOOP_VARIANTS:
        assert_close(kernel(*case.args(), SCALE, **overrides), want, dtype)


@pytest.mark.parametrize("key_bits,value_bits", [(3, 4), (4, 2), (2, 3)])
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "outlier_channels"), (torch.float16, "normal")])
def test_mixed_widths(device, key_bits, value_bits, dtype, kind):
    # keys and values of different widths: the permuted channel orders of q / keys and of values / acc differ
    # (16-bit with 50x key channels is ill-conditioned at int2: softmax ~ argmax; see test_launch_variants)
    keys = build_case([70, 33], [1, 1], 2, 4, 64, key_bits, 32, dtype=dtype, kind=kind, sink_pages=1, seed=12,
                      device=device)
    values = build_case([70, 33], [1, 1], 2, 4, 64, value_bits, 32, dtype=dtype, kind=kind, sink_pages=1, seed=12,
                        device=device)
    assert torch.equal(keys.staging_values, values.staging_values)              # same data, other width
    case = dataclasses.replace(keys, value_pages=values.value_pages, value_spec=values.value_spec)
    want = reference(*case.args(), SCALE)
    for overrides in ({}, {"outlier_pre": 1}, {"perm": False}):
        assert_close(kernel(*case.args(), SCALE, **overrides), want, dtype)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_launch_variants(device, bits):
    # the GPU-sweep switches: subnormal codes, prefetch, sub-page blocks, elementwise outliers, gathers, BLOCK_C
    # (fp16 with 50x key channels is ill-conditioned for any kernel: softmax ~ argmax; see test_lowbit_attention)
    case = build_case([70, 100, 5], [1, 1, 1], 2, 4, 64, bits, 32, dtype=torch.float16, kind="normal",
                      sink_pages=1, seed=9, device=device)
    want = reference(*case.args(), SCALE)
    for overrides in ({"codes": "subnormal"}, {"prefetch": True, "BLOCK_N": 16}, {"outliers": "elementwise"},
                      {"codes": "subnormal", "BLOCK_N": 16, "BLOCK_C": 32, "STAGE_N": 16, "num_splits": 2},
                      {"gather_p": True, "bias_dot": False, "num_warps": 8},
                      {"outlier_pre": 2, "outliers": "elementwise", "BLOCK_N": 16, "prefetch": True},
                      {"outlier_pre": 4, "gather_p": True, "l2_prefetch": True, "maxnreg": 168}):
        assert_close(kernel(*case.args(), SCALE, **overrides), want, torch.float16)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_fixed_num_splits(device, splits):
    # device-side split ranges; short sequences leave some splits empty (and context 0 leaves all empty)
    case = build_case([0, 17, 100, 48], [1, 1, 1, 1], 2, 4, 64, 3, 16, dtype=torch.bfloat16, sink_pages=1, seed=7,
                      device=device)
    case.meta.fixed_num_splits = splits
    check(case, torch.bfloat16)


def test_rejects_prefill_and_unsupported(device):
    case = build_case([16], [2], 1, 4, 64, 3, 16, seed=8, device=device)
    with pytest.raises(ValueError):
        kernel(*case.args(), SCALE)
    grouped = build_case([16], [1], 1, 4, 64, 4, 16, key_axis="token", group_size=16, seed=8, device=device)
    assert not supports(grouped.key_spec, grouped.value_spec, 64)
    with pytest.raises(NotImplementedError):
        kernel(*grouped.args(), SCALE)


def test_real_page_shape(device):
    # the target shape's page (P = 128, D = 128, GQA 4), one low-bit page + a staged tail, two splits
    case = build_case([300], [1], 1, 4, 128, 3, 128, dtype=torch.bfloat16, kind="outlier_channels", seed=10,
                      device=device)
    check(case, torch.bfloat16, num_splits=2)
    case.meta.fixed_num_splits = 3
    check(case, torch.bfloat16, codes="subnormal")
    check(case, torch.bfloat16, outlier_pre=3, l2_prefetch=True)

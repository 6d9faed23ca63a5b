"""The CUDA-core decode kernel over low-bit pages (ops/triton/lowbit_decode.py) vs the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.lowbit_layout import QuantSpec
from moekv.ops.reference.lowbit import paged_attention_lowbit as reference
from moekv.ops.triton.lowbit_decode import paged_attention_lowbit_decode as kernel
from moekv.ops.triton.lowbit_decode import supports
from tests.ops.helpers import assert_close
from tests.ops.lowbit_cases import build_case

SCALE = 0.125
RAGGED = [0, 1, 40, 100]            # empty, one token, partial pages, several pages (pages of 16)


def check(case, dtype, **overrides):
    assert_close(kernel(*case.args(), SCALE, **overrides), reference(*case.args(), SCALE), dtype)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["normal", "outlier_channels"])
def test_formats(device, bits, dtype, kind):
    case = build_case(RAGGED, [1] * 4, 2, 4, 64, bits, 16, dtype=dtype, kind=kind, seed=bits, device=device)
    check(case, dtype)


@pytest.mark.parametrize("bits,dtype,group", [(3, torch.bfloat16, 4), (4, torch.float16, 1), (2, torch.float32, 3)])
def test_head_dim_128_and_groups(device, bits, dtype, group):
    case = build_case([5, 33, 64], [1, 1, 1], 2, group, 128, bits, 16, dtype=dtype, kind="outlier_channels",
                      seed=11, device=device)
    check(case, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_values(device, dtype):
    check(build_case([50, 17], [1, 1], 2, 4, 64, 3, 16, dtype=dtype, kind="large", seed=2, device=device), dtype)


@pytest.mark.parametrize("bits", [4, 3])
def test_token_axis_keys(device, bits):
    case = build_case([45, 64], [1, 1], 2, 4, 64, bits, 16, key_axis="token", kind="outlier_channels", seed=3,
                      device=device)
    check(case, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sink_pages_and_splits(device, num_splits):
    # the first two pages of each sequence stay in fp staging pages, between low-bit ones
    case = build_case([90, 20, 70], [1, 1, 1], 2, 4, 64, 3, 16, sink_pages=2, seed=4, device=device)
    check(case, torch.float32, num_splits=num_splits)


def test_no_outlier_capacity(device):
    check(build_case([40, 3], [1, 1], 1, 4, 64, 2, 16, outlier_fraction=0.0, seed=5, device=device), torch.float32)


def test_page_size_32(device):
    check(build_case([70, 31], [1, 1], 2, 4, 64, 4, 32, kind="outlier_channels", seed=6, device=device),
          torch.float32)


@pytest.mark.parametrize("splits", [1, 4])
def test_fixed_num_splits(device, splits):
    # capture-safe mode: split ranges computed on the device; with 4 splits the short sequences leave
    # splits empty (context 0 and 1: all empty; 40 tokens = 3 pages: one empty split)
    case = build_case(RAGGED, [1] * 4, 2, 4, 64, 3, 16, kind="outlier_channels", sink_pages=1, seed=7, device=device)
    expected = reference(*case.args(), SCALE)
    case.meta.fixed_num_splits = splits
    assert_close(kernel(*case.args(), SCALE), expected, torch.float32)


@pytest.mark.parametrize("overrides", [{"code_cvt": True}, {"gather_p": False, "BLOCK_C": 8},
                                       {"K_WT": 1, "V_NL": 4, "num_warps": 2}])
def test_launch_variants(device, overrides):
    case = build_case([40, 9], [1, 1], 2, 4, 64, 3, 16, dtype=torch.float16, kind="outlier_channels", seed=9,
                      device=device)
    check(case, torch.float16, **overrides)


def test_rejects_prefill_and_unsupported(device):
    case = build_case([10, 3], [2, 1], 1, 4, 64, 4, 16, seed=10, device=device)
    with pytest.raises(ValueError):
        kernel(*case.args(), SCALE)
    spec = QuantSpec(bits=3, axis="channel", head_dim=80, page_size=16)
    value_spec = QuantSpec(bits=3, axis="token", head_dim=80, page_size=16)
    assert not supports(spec, value_spec, 80)
    grouped = QuantSpec(bits=3, axis="token", head_dim=64, page_size=16, group_size=16)
    assert not supports(QuantSpec(bits=3, axis="channel", head_dim=64, page_size=16), grouped, 64)
    assert supports(QuantSpec(bits=2, axis="token", head_dim=128, page_size=128),
                    QuantSpec(bits=2, axis="token", head_dim=128, page_size=128), 128)

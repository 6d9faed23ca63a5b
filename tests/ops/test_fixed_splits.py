"""Decode attention with `meta.fixed_num_splits` (the CUDA-graph path): exactly that many split-K splits,
each sequence's splits sized in the kernel from its own length, no host length read -- same output as
the reference, including splits that are empty for short sequences."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekv.ops.reference.attention import paged_attention_full_precision as fp_reference
from moekv.ops.reference.lowbit import paged_attention_lowbit as lowbit_reference
from moekv.ops.triton.attention.full_precision import paged_attention_full_precision as fp_kernel
from moekv.ops.triton.lowbit.attention import paged_attention_lowbit as lowbit_kernel
from moekv.testing.attention_cases import build_case, build_fp_case
from tests.ops.helpers import assert_close

SCALE = 0.125


def _blind(meta, num_splits):
    """The metadata a graph replay sees: fixed splits, host lengths that describe some other batch."""
    return dataclasses.replace(meta, fixed_num_splits=num_splits, max_seq_len=1,
                               context_lens_host=[0] * meta.num_seqs)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp_decode_fixed_splits(device, num_splits, dtype):
    # lengths 1 (most splits empty), a page exactly, ragged, several pages
    query, key_pages, value_pages, meta = build_fp_case([0, 15, 150, 61], [1, 1, 1, 1], 2, 4, 64, 16, dtype,
                                                        device, seed=7)
    expected = fp_reference(query, key_pages, value_pages, meta, SCALE)
    out = fp_kernel(query, key_pages, value_pages, _blind(meta, num_splits), SCALE)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_lowbit_decode_fixed_splits(device, num_splits):
    case = build_case([0, 1, 40, 100], [1, 1, 1, 1], 2, 4, 64, 3, 16, kind="outlier_channels", sink_pages=1,
                      seed=8, device=device)
    expected = lowbit_reference(*case.args(), SCALE)
    blind = dataclasses.replace(case, meta=_blind(case.meta, num_splits))
    assert_close(lowbit_kernel(*blind.args(), SCALE), expected, torch.float32)

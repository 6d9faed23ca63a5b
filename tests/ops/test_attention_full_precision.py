"""Triton paged attention over full-precision pages vs the PyTorch reference (decode and prefill)."""

from __future__ import annotations

import pytest
import torch

from moekv.ops import dispatch
from moekv.ops.reference.attention import paged_attention_full_precision as reference
from moekv.ops.triton.attention.full_precision import paged_attention_full_precision as kernel
from moekv.ops.triton.attention.decode import paged_decode_full_precision
from moekv.testing.attention_cases import build_fp_case
from tests.ops.helpers import assert_close

SCALE = 0.125


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 1), (80, 4)])
def test_decode_ragged(device, dtype, head_dim, group):
    # ragged lengths: 1, not a multiple of the page size, exactly a page, several pages
    case = build_fp_case([0, 20, 15, 70], [1, 1, 1, 1], 2, group, head_dim, 16, dtype, device)
    assert_close(kernel(*case, SCALE), reference(*case, SCALE), dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_splits(device, num_splits):
    query, key_pages, value_pages, meta = build_fp_case([3, 150, 61], [1, 1, 1], 2, 4, 64, 16, torch.float32,
                                                        device, seed=1)
    out = paged_decode_full_precision(query, key_pages, value_pages, meta.block_tables, meta.seq_lens,
                                      meta.max_seq_len, SCALE, num_splits=num_splits)
    assert_close(out, reference(query, key_pages, value_pages, meta, SCALE), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_large_values(device, dtype):
    # keys and values near 1e4: scores far beyond exp range, sharply peaked softmax
    case = build_fp_case([40, 7], [1, 1], 2, 4, 64, 16, dtype, device, seed=2, value_scale=1e4, key_scale=1e2)
    assert_close(kernel(*case, SCALE), reference(*case, SCALE), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 1), (80, 3)])
def test_prefill_chunks(device, dtype, head_dim, group):
    # a fresh prompt, a chunk after cached context, a single token, a chunk not a multiple of a page
    case = build_fp_case([0, 20, 33, 5], [37, 9, 1, 16], 2, group, head_dim, 16, dtype, device, seed=3)
    assert_close(kernel(*case, SCALE), reference(*case, SCALE), dtype)


def test_prefill_page_size_larger_than_block(device):
    case = build_fp_case([100, 0], [30, 70], 1, 4, 64, 128, torch.float32, device, seed=4)
    assert_close(kernel(*case, SCALE), reference(*case, SCALE), torch.float32)


def test_dispatch_switch(device, triton_backend):
    case = build_fp_case([9, 0], [1, 1], 2, 4, 64, 16, torch.float32, device, seed=5)
    out = dispatch.paged_attention_full_precision(*case, SCALE)
    with dispatch.override(backend="reference"):
        assert_close(out, dispatch.paged_attention_full_precision(*case, SCALE), torch.float32)

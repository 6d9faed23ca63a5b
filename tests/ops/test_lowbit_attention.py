"""Triton attention over low-bit pages vs the PyTorch reference (ops.reference.lowbit)."""

from __future__ import annotations

import pytest
import torch

from moekv.ops import dispatch
from moekv.ops.reference.lowbit import paged_attention_lowbit as reference
from moekv.ops.triton.lowbit.attention import paged_attention_lowbit as kernel
from moekv.testing.attention_cases import build_case
from tests.ops.helpers import assert_close

SCALE = 0.125
DECODE = dict(context_lens=[0, 1, 40, 100], query_lens=[1, 1, 1, 1])   # empty, tiny, ragged, several pages


def check(case, dtype, **kwargs):
    assert_close(kernel(*case.args(), SCALE, **kwargs), reference(*case.args(), SCALE), dtype)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["normal", "outlier_channels"])
def test_decode_formats(device, bits, dtype, kind):
    check(build_case(**DECODE, num_kv_heads=2, group=4, head_dim=64, bits=bits, page_size=16, dtype=dtype,
                     kind=kind, device=device), dtype)


@pytest.mark.parametrize("bits,head_dim,group,dtype", [(3, 128, 1, torch.bfloat16), (4, 128, 4, torch.float16),
                                                       (2, 80, 4, torch.float32), (3, 96, 2, torch.float32)])
def test_decode_head_dims(device, bits, head_dim, group, dtype):
    check(build_case([5, 33], [1, 1], 2, group, head_dim, bits, 16, dtype=dtype, kind="outlier_channels",
                     seed=1, device=device), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_large_values(device, dtype):
    check(build_case([50, 17], [1, 1], 2, 4, 64, 3, 16, dtype=dtype, kind="large", seed=2, device=device), dtype)


@pytest.mark.parametrize("key_axis,group_size", [("token", None), ("token", 16), ("channel", 32)])
def test_decode_axes_and_groups(device, key_axis, group_size):
    check(build_case([45, 64], [1, 1], 2, 4, 64, 4, 16, key_axis=key_axis, group_size=group_size,
                     kind="outlier_channels", seed=3, device=device), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_sink_pages_and_splits(device, num_splits):
    # the first two pages of each sequence stay in fp staging pages, between low-bit ones
    case = build_case([90, 20, 70], [1, 1, 1], 2, 4, 64, 3, 16, sink_pages=2, seed=4, device=device)
    check(case, torch.float32, num_splits=num_splits)


def test_decode_no_outlier_capacity(device):
    check(build_case([40, 3], [1, 1], 1, 4, 64, 2, 16, outlier_fraction=0.0, seed=5, device=device), torch.float32)


def test_decode_page_size_32(device):
    check(build_case([70, 31], [1, 1], 2, 4, 64, 4, 32, kind="outlier_channels", seed=6, device=device),
          torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 3])
def test_prefill_chunks(device, dtype, bits):
    # a fresh prompt, a chunk after cached pages (+ a staged tail), a single token, mixed in one step
    # (bf16 with 50x key channels makes the softmax so peaked that bf16 rounding of q alone, in any kernel,
    # moves outputs by ~1-3%: that combination is covered at fp32 and, for decode, by test_decode_formats)
    kind = "outlier_channels" if dtype == torch.float32 else "normal"
    case = build_case([0, 40, 33], [21, 9, 1], 2, 4, 64, bits, 16, dtype=dtype, kind=kind, seed=7, device=device)
    check(case, dtype)


def test_dispatch_switch(device, triton_backend):
    case = build_case([40, 9], [1, 1], 2, 4, 64, 3, 16, seed=8, device=device)
    out = dispatch.paged_attention_lowbit(*case.args(), SCALE)
    with dispatch.override(backend="reference"):
        assert_close(out, dispatch.paged_attention_lowbit(*case.args(), SCALE), torch.float32)


def test_convert_unpack_variant(device):
    # the benchmark's comparison variant (int -> fp16 convert instead of the magic-offset OR)
    case = build_case([40, 9], [1, 1], 2, 4, 64, 3, 16, dtype=torch.float16, seed=9, device=device)
    check(case, torch.float16, config={"unpack": "cvt"})
    check(case, torch.float16, config={"gather": True})
    check(case, torch.float16, config={"BLOCK_N": 16})
    check(case, torch.float16, config={"gather_p": True, "BLOCK_C": 32})


def test_blocks_smaller_than_a_page(device):
    # BLOCK_N < page_size: a page is read in several steps; outliers and staging rows per step
    case = build_case([70, 100], [1, 1], 2, 4, 64, 3, 32, kind="outlier_channels", sink_pages=1, seed=10,
                      device=device)
    check(case, torch.float32, config={"BLOCK_N": 16}, num_splits=2)
    check(case, torch.float32, config={"BLOCK_N": 16, "gather_p": True}, num_splits=2)


def _run_cache_steps(device, backend):
    """A LowBitKVCache (int3, pages of 16) through a prefill chunk, a second chunk and decode steps."""
    from moekv.config import CacheConfig
    from moekv.core.attention_metadata import AttentionMetadata
    from moekv.kvcache.base import KVCacheSpec
    from moekv.kvcache.formats.lowbit import LowBitKVCache

    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32)
    cache = LowBitKVCache(spec, 16, device, CacheConfig(kv_cache_dtype="int3", page_size=16, num_pages=16))
    gen = torch.Generator().manual_seed(11)
    tables, lengths, outs = [[3, 7, 1, 12], [5, 9]], [0, 0], []
    with dispatch.override(backend=backend):
        for step_lens in ([30, 5], [9, 12], [1, 1], [1, 1]):
            meta = AttentionMetadata.build(step_lens, lengths, tables, 16, device)
            total = sum(step_lens)
            q, k, v = (torch.randn(total, heads, 64, generator=gen).to(device) for heads in (8, 2, 2))
            outs.append(cache.attention(0, q, k, v, meta, SCALE))
            lengths = [n + s for n, s in zip(lengths, step_lens)]
    return outs


def test_cache_end_to_end(device):
    # the cache calls dispatch for attention and for page quantization: both paths, step by step
    kernel_outs = _run_cache_steps(device, "triton")
    reference_outs = _run_cache_steps(device, "reference")
    for got, want in zip(kernel_outs, reference_outs):
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("key_axis", ["channel", "token"])
def test_decode_fragment_order(device, bits, key_axis):
    # int3 / int2, head_dim 128, 32-token pages: codes in fragment order (core.lowbit_order), both kinds; contexts
    # that end inside a chunk, on a chunk boundary and past a page
    check(build_case([33, 64, 70], [1, 1, 1], 2, 4, 128, bits, 32, key_axis=key_axis, kind="outlier_channels", seed=9,
                     device=device), torch.float32)


@pytest.mark.parametrize("staging_block,staging_only,kind", [(16, False, "spikes"), (16, True, "heavy_tail"),
                                                              (32, True, "spikes"), (64, False, "heavy_tail")])
def test_staging_blocks_and_staging_only_ids(device, staging_block, staging_only, kind):
    # staging in blocks handed out in shuffled order (a partial page holds only the blocks its rows need), the
    # partial page as an id beyond the low-bit pages; ragged lengths around page and block boundaries, sinks
    case = build_case([1, 17, 63, 64, 65, 129, 200], [1] * 7, 2, 4, 64, 3, 64, kind=kind, sink_pages=1,
                      seed=12, device=device, staging_block=staging_block, staging_only=staging_only)
    if staging_only:
        assert case.block_map.shape[0] > case.key_pages.codes.shape[0]
    check(case, torch.float32, num_splits=2)
    check(case, torch.float32, config={"BLOCK_N": 16})


def test_staging_blocks_match_whole_page_staging(device):
    # the same data staged in whole pages and in blocks of 16: the kernel's outputs are bit-identical
    args = dict(context_lens=[40, 100, 7], query_lens=[1, 1, 1], num_kv_heads=2, group=4, head_dim=64, bits=3,
                page_size=64, kind="outlier_channels", seed=13, device=device)
    whole = kernel(*build_case(**args).args(), SCALE)
    blocks = kernel(*build_case(**args, staging_block=16, staging_only=True).args(), SCALE)
    assert torch.equal(whole, blocks)

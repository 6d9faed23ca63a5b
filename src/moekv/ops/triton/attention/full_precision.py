"""Host entry of the full-precision paged attention kernels: decode steps (every query length 1) use
the split-K decode kernel, anything else (prefill chunks, mixed steps) the prefill kernel."""

from __future__ import annotations

import torch

from moekv.core.attention_metadata import AttentionMetadata
from moekv.ops.triton.attention.decode import paged_decode_full_precision
from moekv.ops.triton.attention.prefill import paged_prefill_full_precision


def paged_attention_full_precision(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                                   meta: AttentionMetadata, scale: float, combine: bool = False,
                                   invariant: bool = False) -> torch.Tensor:
    """Same contract as ops.reference.attention.paged_attention_full_precision.

    query [T, Hq, D]; key/value_pages [num_pages, P, Hkv, D] already holding the new tokens -> [T, Hq, D].
    combine: decode steps merge their splits inside the decode launch (KernelConfig.fused_attention_combine,
    passed by ops.dispatch); False: a second launch does it. invariant: the batch-invariant arithmetic in both
    kernels (KernelConfig.batch_invariant, ops.triton.attention.invariant): a CUDA-graph bucket's fixed_num_splits
    is then its split count at invariant.SPLIT_TOKENS keys each (KVCache.graph_decode_splits plans it so).
    """
    if invariant:
        if meta.is_decode:
            return paged_decode_full_precision(query, key_pages, value_pages, meta.block_tables, meta.seq_lens,
                                               meta.max_seq_len, scale, num_splits=meta.fixed_num_splits,
                                               invariant=True)
        return paged_prefill_full_precision(query, key_pages, value_pages, meta.block_tables, meta.query_start_loc,
                                            meta.context_lens, meta.max_query_len, scale, invariant=True)
    if meta.is_decode:
        if meta.fixed_num_splits is not None:      # graph-capturable: splits sized on the device
            return paged_decode_full_precision(query, key_pages, value_pages, meta.block_tables, meta.seq_lens,
                                               0, scale, num_splits=meta.fixed_num_splits, device_splits=True,
                                               combine=combine)
        return paged_decode_full_precision(query, key_pages, value_pages, meta.block_tables, meta.seq_lens,
                                           meta.max_seq_len, scale, combine=combine)
    return paged_prefill_full_precision(query, key_pages, value_pages, meta.block_tables, meta.query_start_loc,
                                        meta.context_lens, meta.max_query_len, scale)

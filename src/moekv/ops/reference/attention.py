"""Reference paged attention over full-precision pages."""

from __future__ import annotations

import torch

from moekv.kvcache.base import AttentionMetadata, causal_attention_reference


def paged_attention_full_precision(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, Hq, D]; key/value_pages [num_pages, P, Hkv, D] already holding the new tokens.

    Returns [T, Hq, D] in query's dtype. Loops over sequences (the reference, not the fast path).
    """
    out = torch.empty_like(query)
    start = 0
    for seq, (num_new, context_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
        total = context_len + num_new
        pages = torch.tensor(meta.block_tables_host[seq], dtype=torch.long, device=query.device)
        keys = key_pages.index_select(0, pages).flatten(0, 1)[:total]        # [L, Hkv, D]
        values = value_pages.index_select(0, pages).flatten(0, 1)[:total]    # [L, Hkv, D]
        out[start:start + num_new] = causal_attention_reference(
            query[start:start + num_new], keys, values, context_len, scale).to(query.dtype)
        start += num_new
    return out

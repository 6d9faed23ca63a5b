"""Paged full-precision attention on the CPU through torch's fused scaled_dot_product_attention.

Same contract as ops.reference.attention.paged_attention_full_precision (its twin and the oracle of the tests):
each sequence's pages are gathered once, then one fused call per sequence computes its new tokens' attention
over [cached context + new tokens] without materialising the [heads, queries, keys] score matrix (the reference
builds it in fp32 with a mask: about 8 s for a 4k-token prefill of the bundled model on 2 cores). fp32 math as in
the reference (the bf16 kernel was 2.5x faster but 20x further from transformers' fp32 logits than transformers'
own bf16 run: tests/models/test_model_vs_hf.py). The new token i (absolute position context_len + i) sees keys
0 .. context_len + i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekv.core.attention_metadata import AttentionMetadata
from moekv.ops.reference.attention import attend_per_sequence


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int,
                     scale: float) -> torch.Tensor:
    """query [Q, Hq, D]; keys / values [L, Hkv, D] with L = context_len + Q -> [Q, Hq, D] (fp32)."""
    num_q = query.shape[0]
    total = keys.shape[0]
    q = query.float().transpose(0, 1).unsqueeze(0).contiguous()        # [1, Hq, Q, D]
    k = keys.float().transpose(0, 1).unsqueeze(0).contiguous()         # [1, Hkv, L, D]
    v = values.float().transpose(0, 1).unsqueeze(0).contiguous()
    if context_len == 0:                                                 # Q == L: the usual causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=num_q > 1, scale=scale, enable_gqa=True)
    else:                                                                # lower-right aligned causal mask
        q_pos = torch.arange(num_q, device=query.device).unsqueeze(1) + context_len
        allowed = torch.arange(total, device=query.device).unsqueeze(0) <= q_pos          # [Q, L] bool
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)                                # [Q, Hq, D]


def paged_attention_full_precision(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, Hq, D]; key/value_pages [num_pages, P, Hkv, D] already holding the new tokens -> [T, Hq, D]."""
    return attend_per_sequence(causal_attention, query, key_pages, value_pages, meta, scale)

"""Reference paged attention over full-precision pages."""

from __future__ import annotations

import torch

from moekv.core.attention_metadata import AttentionMetadata


def paged_attention_full_precision(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, Hq, D]; key/value_pages [num_pages, P, Hkv, D] already holding the new tokens.

    Returns [T, Hq, D] in query's dtype. Loops over sequences (the reference, not the fast path).
    """
    return attend_per_sequence(causal_attention_reference, query, key_pages, value_pages, meta, scale)


def paged_attention_rowwise(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """paged_attention_full_precision one new token at a time: the batch-invariant mode's path where the Triton
    kernels do not run (KernelConfig.batch_invariant on the CPU). Token i of a chunk (absolute position p) attends
    over keys 0..p in its own causal_attention_reference call, whose shapes depend on p alone, so its result does
    not depend on the chunk it came in, its batch or the step kind (decode or prefill)."""
    def attend(q, keys, values, context_len, scale):
        rows = [causal_attention_reference(q[i:i + 1], keys[:context_len + i + 1], values[:context_len + i + 1],
                                           context_len + i, scale) for i in range(q.shape[0])]
        return torch.cat(rows) if rows else q.float()

    return attend_per_sequence(attend, query, key_pages, value_pages, meta, scale)


def attend_per_sequence(attend, query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Gather each sequence's pages once and run `attend(query, keys, values, context_len, scale)` (the
    causal_attention_reference signature) over them; [T, Hq, D] in query's dtype."""
    out = torch.empty_like(query)
    start = 0
    for seq, (num_new, context_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
        total = context_len + num_new
        pages = torch.tensor(meta.block_tables_host[seq], dtype=torch.long, device=query.device)
        keys = key_pages.index_select(0, pages).flatten(0, 1)[:total]        # [L, Hkv, D]
        values = value_pages.index_select(0, pages).flatten(0, 1)[:total]    # [L, Hkv, D]
        out[start:start + num_new] = attend(query[start:start + num_new], keys, values, context_len,
                                            scale).to(query.dtype)
        start += num_new
    return out


def causal_attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               context_len: int, scale: float) -> torch.Tensor:
    """Attention of one sequence's new tokens over [cached context + new tokens], in fp32.

    query [Q, Hq, D]; keys/values [L, Hkv, D] with L = context_len + Q -> [Q, Hq, D] (fp32).
    New token i (absolute position context_len + i) sees keys 0 .. context_len + i.
    """
    num_q, num_heads, _ = query.shape
    total, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)                                    # [Hq, Q, D]
    k = keys.float().transpose(0, 1).repeat_interleave(group, dim=0)     # [Hq, L, D]
    v = values.float().transpose(0, 1).repeat_interleave(group, dim=0)   # [Hq, L, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale                  # [Hq, Q, L]
    q_pos = torch.arange(num_q, device=query.device).unsqueeze(1) + context_len   # [Q, 1]
    k_pos = torch.arange(total, device=query.device).unsqueeze(0)                 # [1, L]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1)                        # [Q, Hq, D]

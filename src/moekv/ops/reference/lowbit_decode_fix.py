"""References of the outlier-correction passes of the token-major decode kernel
(ops/triton/lowbit/decode_fix.py): same signatures, plain torch, one (sequence, kv head, page) at a time.
Only the tiles the kernels define are written (low-bit page-heads of the context with outliers); the rest of
`fixes` is left as it was. The value corrections come back as [B, Hkv, 1, HG, D] (one chunk)."""

from __future__ import annotations

import torch


def _outlier_pages(pages, spec, staging_slot_of_page, meta, seq: int, kv_head: int):
    """(page_index, tokens, channels, residuals) of the low-bit page-heads of `seq`'s context with outliers."""
    page_size = spec.page_size
    context = int(meta.context_lens[seq])
    for page_index in range(-(-context // page_size)):
        page = int(meta.block_tables[seq, page_index])
        if int(staging_slot_of_page[page]) >= 0:
            continue
        count = min(int(pages.outlier_count[page, kv_head]), spec.outlier_capacity)
        if count == 0:
            continue
        flat = pages.outlier_idx[page, kv_head, :count].long() & 0xFFFF
        yield (page_index, flat // spec.head_dim, flat % spec.head_dim,
               pages.outlier_vals[page, kv_head, :count].float())


def key_fixes(query: torch.Tensor, key_pages, key_spec, staging_slot_of_page: torch.Tensor, meta,
              qk_scale: float, fixes: torch.Tensor, BLOCK_C: int = 64, PAGES: int = 4) -> torch.Tensor:
    batch, num_kv_heads = fixes.shape[:2]
    group = query.shape[1] // num_kv_heads
    if key_spec.outlier_capacity == 0:
        return fixes
    starts = meta.query_start_loc.tolist()
    for seq in range(batch):
        for kv_head in range(num_kv_heads):
            q = query[starts[seq], kv_head * group:(kv_head + 1) * group].float() * qk_scale      # [G, D]
            for page_index, tokens, channels, resid in _outlier_pages(key_pages, key_spec, staging_slot_of_page,
                                                                      meta, seq, kv_head):
                tile = torch.zeros((key_spec.page_size, group), dtype=torch.float32, device=fixes.device)
                tile.index_add_(0, tokens, resid[:, None] * q[:, channels].t())
                fixes[seq, kv_head, page_index, :, :group] = tile
    return fixes


def value_fixes(scores: torch.Tensor, lse: torch.Tensor, value_pages, value_spec,
                staging_slot_of_page: torch.Tensor, meta, BLOCK_C: int = 64, PAGES: int = 4) -> torch.Tensor | None:
    batch, num_kv_heads, width, page_size, hg = scores.shape
    if value_spec.outlier_capacity == 0:
        return None
    group, head_dim = lse.shape[1] // num_kv_heads, value_spec.head_dim
    parts = torch.zeros((batch, num_kv_heads, 1, hg, head_dim), dtype=torch.float32, device=scores.device)
    total = torch.logsumexp(lse.float() * torch.log(torch.tensor(2.0)), dim=-1) / torch.log(torch.tensor(2.0))
    total = torch.where(torch.isinf(total), torch.zeros_like(total), total)                      # [B, Hq]
    starts = meta.query_start_loc.tolist()
    for seq in range(batch):
        for kv_head in range(num_kv_heads):
            norm = total[starts[seq], kv_head * group:(kv_head + 1) * group]                       # [G]
            for page_index, tokens, channels, resid in _outlier_pages(value_pages, value_spec, staging_slot_of_page,
                                                                      meta, seq, kv_head):
                s = scores[seq, kv_head, page_index, tokens, :group]                               # [C, G]
                weight = torch.exp2(s - norm[None, :])
                contrib = torch.where(weight > 0, weight * resid[:, None], torch.zeros_like(weight))
                parts[seq, kv_head, 0, :group].index_add_(1, channels, contrib.t())
    return parts

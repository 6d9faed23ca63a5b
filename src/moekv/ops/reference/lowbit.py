"""Reference (pure PyTorch) low-bit KV ops: quantize pages, dequantize pages, paged attention, the staged pages.

The oracle the Triton kernels are tested against; each kernel mirrors one of these signatures. The page quantizer
itself lives in ops/reference/lowbit_quantize.py (re-exported here). Layout and formulas: core/lowbit_layout.py and
docs/kv-format.md. All arithmetic is fp32.
"""

from __future__ import annotations

import torch

from moekv.core.attention_metadata import AttentionMetadata
from moekv.core.lowbit_layout import PackedPages, QuantSpec
from moekv.ops.reference.attention import causal_attention_reference
from moekv.ops.reference.lowbit_quantize import (dequantize_pages, quantize_pages,  # noqa: F401
                                                 token_scale_zero)  # (re-exported)


def staged_page_rows(staging: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The rows of staged pages: staging [num_blocks, SB, H, D] (blocks of SB tokens), blocks [m, P / SB] int
    (a page's blocks in row order; -1 where none is held, read as block 0: rows past the page's tokens)
    -> [m, P, H, D]."""
    rows = staging.index_select(0, blocks.reshape(-1).long().clamp(min=0))          # [m * nb, SB, H, D]
    return rows.reshape(blocks.shape[0], blocks.shape[1] * staging.shape[1], *staging.shape[2:])


def block_rows(slots: torch.Tensor) -> torch.Tensor:
    """Staging blocks per entry as [B, P / SB]: [B] (whole-page blocks, a slot each) or [B, nb] as given."""
    return slots[:, None] if slots.dim() == 1 else slots


def quantize_staged_pages(staging: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, spec: QuantSpec,
                          out: PackedPages) -> torch.Tensor:
    """Quantize whole staged pages straight into low-bit storage, skipping entries whose page is -1.

    staging [num_blocks, SB, Hkv, D] (one layer's staging pool in blocks of SB tokens; SB = P: whole pages,
    any float dtype); slots [B, P / SB] (or [B] when SB = P), pages [B] (int): entry i quantizes the P rows
    held in blocks slots[i] (in row order) into page pages[i] of `out` (one layer's PackedPages
    [num_pages, Hkv, ...], written in place); entries with pages[i] < 0 are skipped (their blocks are not
    read). Returns num_qualifying [B, Hkv] int32 (0 for skipped entries). Entries naming the same page must
    name the same blocks (they then store the same result).
    """
    slots = block_rows(slots)
    count = slots.shape[0]
    if slots.shape[1] * staging.shape[1] != spec.page_size:
        raise ValueError(f"{slots.shape[1]} staging blocks of {staging.shape[1]} rows do not make a page of "
                         f"{spec.page_size}")
    qualifying = torch.zeros((count, staging.shape[2]), dtype=torch.int32, device=staging.device)
    chosen = (pages >= 0).nonzero().flatten()                                      # host sync: reference only
    if chosen.numel() == 0:
        return qualifying
    x = staged_page_rows(staging, slots.index_select(0, chosen)).transpose(1, 2)   # [m, Hkv, P, D]
    packed, chosen_qualifying = quantize_pages(x, spec)
    out.store(pages.index_select(0, chosen).long(), packed)
    qualifying.index_copy_(0, chosen, chosen_qualifying)
    return qualifying


def gather_context(pages: PackedPages, spec: QuantSpec, staging: torch.Tensor, block_map: list,
                   block_table: list[int], num_tokens: int) -> torch.Tensor:
    """One sequence's first `num_tokens` cached rows [num_tokens, H, D] fp32: low-bit pages dequantized,
    staged pages read from `staging` [num_blocks, SB, H, D] through block_map[page] (its blocks [P / SB], -1
    where not held; a page whose first block is -1 is read from low-bit storage; an int per page: SB = P)."""
    count = -(-num_tokens // spec.page_size)
    table = block_table[:count]

    def blocks(page: int) -> list[int]:
        entry = block_map[page]
        return entry if isinstance(entry, list) else [entry]

    rows: list[torch.Tensor | None] = [None] * count
    lowbit = [i for i, page in enumerate(table) if blocks(page)[0] < 0]
    if lowbit:
        ids = torch.tensor([table[i] for i in lowbit], dtype=torch.long, device=staging.device)
        dequantized = dequantize_pages(pages.select(ids), spec).transpose(1, 2)   # [n, P, H, D]
        for j, i in enumerate(lowbit):
            rows[i] = dequantized[j]
    for i, page in enumerate(table):
        if rows[i] is None:
            held = torch.tensor([blocks(page)], dtype=torch.long, device=staging.device)
            rows[i] = staged_page_rows(staging, held)[0].float()                   # [P, H, D]
    if not rows:
        return staging.new_zeros((0,) + tuple(staging.shape[2:]), dtype=torch.float32)
    return torch.cat(rows, dim=0)[:num_tokens]


def paged_attention_lowbit(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           key_pages: PackedPages, value_pages: PackedPages,
                           key_spec: QuantSpec, value_spec: QuantSpec,
                           staging_keys: torch.Tensor, staging_values: torch.Tensor,
                           staging_block_map: torch.Tensor, meta: AttentionMetadata,
                           scale: float) -> torch.Tensor:
    """Causal attention of the step's new tokens over their cached context plus themselves.

    query [T, Hq, D]; key/value [T, Hkv, D]: the new tokens, used in full precision (not yet cached);
    key/value_pages: the layer's low-bit storage [num_pages, Hkv, ...]; staging_keys/values
    [num_blocks, SB, Hkv, D] (blocks of SB tokens); staging_block_map [num_ids, P / SB] int32 (a page's
    blocks; first -1: read the low-bit page), or [num_ids] when SB = P (a slot per page). Page ids at or
    beyond num_pages (staging-only pages) are always staged. Context of sequence i = its first
    context_lens[i] tokens. Returns [T, Hq, D] in query's dtype.
    """
    out = torch.empty_like(query)
    block_map = staging_block_map.tolist()
    start = 0
    for seq, (num_new, context_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
        rows = slice(start, start + num_new)
        table = meta.block_tables_host[seq]
        keys = gather_context(key_pages, key_spec, staging_keys, block_map, table, context_len)
        values = gather_context(value_pages, value_spec, staging_values, block_map, table, context_len)
        keys = torch.cat([keys, key[rows].float()], dim=0)                        # [L, Hkv, D]
        values = torch.cat([values, value[rows].float()], dim=0)
        out[rows] = causal_attention_reference(query[rows], keys, values, context_len, scale).to(query.dtype)
        start += num_new
    return out


def stage_decode_tokens(key: torch.Tensor, value: torch.Tensor, staging_keys: torch.Tensor,
                        staging_values: torch.Tensor, stage_rows: torch.Tensor, flags: torch.Tensor,
                        key_out: torch.Tensor, value_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step's staging write of one layer (no host reads).

    key/value [B, Hkv, D]: the step's new tokens; staging_keys/values [num_blocks, SB, Hkv, D]: the layer's
    staging pools, written at flat row stage_rows[i] (block * SB + row within the block) for token i; flags [B] bool: set (never
    cleared) for each token whose key or value row holds a NaN or Inf; such a token is written as zeros
    (key and value both). key_out/value_out [B, Hkv, D]: receive the rows as written (zeroed where
    non-finite, in their own dtype); returned, for the attention call. Tokens sharing a staging row
    write it in no set order.
    """
    finite = torch.isfinite(key).flatten(1).all(1) & torch.isfinite(value).flatten(1).all(1)     # [B]
    flags.logical_or_(~finite)
    keep = finite[:, None, None]
    key_out.copy_(torch.where(keep, key, torch.zeros((), dtype=key.dtype, device=key.device)))
    value_out.copy_(torch.where(keep, value, torch.zeros((), dtype=value.dtype, device=value.device)))
    for new, staging in ((key_out, staging_keys), (value_out, staging_values)):
        flat = staging.view(-1, *staging.shape[2:])                                # [blocks * SB, Hkv, D]
        flat.index_copy_(0, stage_rows.long(), new.to(flat.dtype))
    return key_out, value_out


def quantize_staged_pages_counted(staging: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor,
                                  spec: QuantSpec, out: PackedPages, counters: torch.Tensor,
                                  budget_index: int, outliers_index: int, qualifying_index: int,
                                  pages_index: int = -1) -> None:
    """quantize_staged_pages, with its statistics added to `counters` (int64, device) instead of returned:
    counters[budget_index] += page heads whose qualifying count exceeds the capacity,
    counters[outliers_index] += outliers stored, counters[qualifying_index] += qualifying values and,
    when pages_index >= 0, counters[pages_index] += page heads quantized -- over the entries with
    pages[i] >= 0 (an entry repeated is counted each time)."""
    qualifying = quantize_staged_pages(staging, slots, pages, spec, out)           # [B, Hkv]
    filled = pages >= 0                                                            # [B]
    outliers = out.outlier_count.index_select(0, pages.long().clamp(min=0))       # [B, Hkv]
    counters[budget_index] += (qualifying > spec.outlier_capacity).sum()
    counters[outliers_index] += (outliers * filled[:, None]).sum(dtype=torch.int64)
    counters[qualifying_index] += qualifying.sum(dtype=torch.int64)
    if pages_index >= 0:
        counters[pages_index] += filled.sum() * qualifying.shape[1]


def quantize_staged_kv_counted(staging_keys: torch.Tensor, staging_values: torch.Tensor, slots: torch.Tensor,
                               pages: torch.Tensor, key_spec: QuantSpec, value_spec: QuantSpec,
                               key_out: PackedPages, value_out: PackedPages, counters: torch.Tensor,
                               key_counters: tuple[int, int, int, int],
                               value_counters: tuple[int, int, int, int]) -> None:
    """The decode step's page quantization of one layer, keys and values: quantize_staged_pages_counted of
    the keys (counter indices key_counters = (budget, outliers, qualifying, pages or -1)), then of the
    values (value_counters), with the same slots and pages."""
    quantize_staged_pages_counted(staging_keys, slots, pages, key_spec, key_out, counters, *key_counters)
    quantize_staged_pages_counted(staging_values, slots, pages, value_spec, value_out, counters, *value_counters)


def quantize_staged_kv_counted_layers(staging_keys: torch.Tensor, staging_values: torch.Tensor, slots: torch.Tensor,
                                      pages: torch.Tensor, key_spec: QuantSpec, value_spec: QuantSpec,
                                      key_out: PackedPages, value_out: PackedPages, counters: torch.Tensor,
                                      key_counters: tuple[int, int, int, int],
                                      value_counters: tuple[int, int, int, int]) -> None:
    """The decode step's page quantization of every layer at once: staging_keys/values [L, num_blocks, SB, Hkv, D],
    key_out/value_out stacked PackedPages [L, N, Hkv, ...] (PackedPages.empty(..., num_layers=L)); the same
    as quantize_staged_kv_counted of layer l (staging[l], out.layer(l)) for l = 0..L-1, same slots, pages
    and counter indices (every layer's statistics added to the same counters)."""
    if staging_keys.dim() != 5 or staging_values.shape != staging_keys.shape:
        raise ValueError(f"staging pools must be [L, num_blocks, SB, H, D] (keys and values alike), got "
                         f"{tuple(staging_keys.shape)} and {tuple(staging_values.shape)}")
    num_layers = staging_keys.shape[0]
    if key_out.codes.dim() != 5 or key_out.codes.shape[0] != num_layers or value_out.codes.shape[0] != num_layers:
        raise ValueError(f"key_out/value_out must be stacked pages of {num_layers} layers, got codes "
                         f"{tuple(key_out.codes.shape)} and {tuple(value_out.codes.shape)}")
    for layer in range(num_layers):
        quantize_staged_kv_counted(staging_keys[layer], staging_values[layer], slots, pages, key_spec, value_spec,
                                   key_out.layer(layer), value_out.layer(layer), counters, key_counters,
                                   value_counters)

"""Outlier corrections of the token-major decode kernel (v6, lowbit_decode_tm.py) in passes of their own
(`outliers="passes"`): no atomics and no barriers inside the attention's page loop, which only loads a key-fix
tile and stores its scores for pages with outliers.

A low-bit page-head stores up to its count of outliers as (flat index t * D + d, fp16 residual r): the value
at token t, channel d is the dequantized code plus r. Attention needs two corrections:

  keys:   s[t, h] += r * q[h, d]                               (q scaled by scale * log2(e), score units)
  values: out[h, d] += r * exp2(s[t, h] - LSE[h])               (LSE: the base-2 log-sum-exp of all scores)

The key correction depends on the query only, so a pass *before* the attention (`key_fixes`, one program per
(sequence, kv head, PAGES_PER_PROGRAM pages)) writes it for every page-head with outliers as a dense tile
[PAGE, HG]: the program zeroes the tile, then adds one fp32 atomic per (slot, head). The attention adds the
tile to its scores with one coalesced load. The value correction needs the final normaliser, so the
attention stores the (corrected) scores of the pages with value outliers [PAGE, HG], and a pass *after* it
(`value_fixes`) gathers the scores at the outlier tokens, weighs them with the global LSE (from the
attention's split lse) and adds r * weight by fp32 atomics into one [HG, D] accumulator per (sequence, kv
head), which the split combine adds (`split_k.combine_splits(..., fix=...)`).

Determinism: where several outliers meet in one sum (one token's channels for keys, one channel's tokens for
values) the order of the fp32 atomics varies, so the last bits may vary run to run (as for
`outliers="scatter"`; `outliers="dot"` is bit-reproducible).

Buffers (fp32): fixes / scores [B, Hkv, W, PAGE, HG] with W the block table's width (HG = GQA group
rounded up to a power of two >= 2; columns >= GROUP are never read or written); the value accumulator
[B, Hkv, 1, HG, D] (zeroed). Their shapes depend on launch constants only (CUDA graphs). A fix / score tile
is touched only when its page-head is a low-bit page (not staged) inside the context with a non-zero count;
the attention reads / writes a tile under the same condition, so those buffers need no zeroing.

References with the same signatures: ops/reference/lowbit_decode_fix.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.common import pow2
from moekv.ops.triton.lowbit.decode_tm_parts import outlier_slots

PAGES_PER_PROGRAM = 4       # pages per program of both passes


def group_width(group: int) -> int:
    """HG: the row stride of the fix / score tiles, the GQA group rounded up to a power of two >= 2."""
    return max(pow2(group, floor=2), 2)


@triton.jit
def _page_count(block_tables, slot_of_page, count_ptr, seq, kv_head, page_index, num_pages, stride_bt,
                NUM_KV_HEADS: tl.constexpr, CAP: tl.constexpr):
    """(page_head, outlier count) of a table entry; count 0 outside the context and for staged pages."""
    inside = page_index < num_pages
    page = tl.load(block_tables + seq.to(tl.int64) * stride_bt + page_index, mask=inside, other=0).to(tl.int64)
    page_head = page * NUM_KV_HEADS + kv_head
    lowbit = tl.load(slot_of_page + page, mask=inside, other=0) < 0
    count = tl.load(count_ptr + page_head, mask=inside & lowbit, other=0).to(tl.int32)
    return page_head, tl.minimum(count, CAP)


@triton.jit
def _program(query_start_loc, context_lens, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HG: tl.constexpr):
    """(sequence, kv head, pages of its context, its query row, head offsets [HG], heads < GROUP) of a program
    of grid (sequence, kv head, chunk of pages)."""
    seq = tl.program_id(0)
    num_pages = tl.cdiv(tl.load(context_lens + seq), PAGE_SIZE)
    heads = tl.arange(0, HG)
    return seq, tl.program_id(1), num_pages, tl.load(query_start_loc + seq).to(tl.int64), heads, heads < GROUP


@triton.jit
def _key_fix_kernel(
    q_ptr, k_ovals, k_oidx, k_ocount, slot_of_page, block_tables, query_start_loc, context_lens, fix_ptr,
    qk_scale, table_width, stride_qt, stride_qh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    HG: tl.constexpr, CAP: tl.constexpr, BLOCK_C: tl.constexpr, PAGES: tl.constexpr,
):
    seq, kv_head, num_pages, q_row, heads, head_mask = _program(query_start_loc, context_lens, PAGE_SIZE, GROUP, HG)
    q_cols = q_ptr + q_row * stride_qt + (kv_head * GROUP + heads) * stride_qh                    # [HG]
    offs = tl.arange(0, PAGE_SIZE)[:, None] * HG + heads[None, :]
    for i in tl.static_range(PAGES):
        page_index = tl.program_id(2) * PAGES + i
        page_head, count = _page_count(block_tables, slot_of_page, k_ocount, seq, kv_head, page_index, num_pages,
                                       stride_bt, NUM_KV_HEADS, CAP)
        if count > 0:
            # zero the tile, then one fp32 atomic per (slot, head); the barrier orders the two within the program
            tile = fix_ptr + ((seq * NUM_KV_HEADS + kv_head).to(tl.int64) * table_width + page_index) * (PAGE_SIZE * HG)
            tl.store(tile + offs, tl.zeros([PAGE_SIZE, HG], tl.float32), mask=head_mask[None, :])
            tl.debug_barrier()
            for c0 in range(0, count, BLOCK_C):
                flat, resid, live = outlier_slots(k_oidx, k_ovals, page_head, c0, count, CAP, BLOCK_C)
                mask = live[:, None] & head_mask[None, :]
                q = tl.load(q_cols[None, :] + (flat % HEAD_DIM)[:, None], mask=mask, other=0.0).to(tl.float32)
                tl.atomic_add(tile + (flat // HEAD_DIM)[:, None] * HG + heads[None, :],
                              resid.to(tl.float32)[:, None] * (q * qk_scale), mask=mask, sem="relaxed", scope="cta")


@triton.jit
def _value_fix_kernel(
    scores_ptr, lse_ptr, v_ovals, v_oidx, v_ocount, slot_of_page, block_tables, query_start_loc, context_lens,
    acc_ptr, table_width, num_splits, stride_lt, stride_lh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    HG: tl.constexpr, CAP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, PAGES: tl.constexpr,
):
    seq, kv_head, num_pages, q_row, heads, head_mask = _program(query_start_loc, context_lens, PAGE_SIZE, GROUP, HG)
    # the global base-2 log-sum-exp of each head from the splits' (as the combine computes it)
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + q_row * stride_lt + (kv_head * GROUP + heads)[:, None] * stride_lh + offs_s[None, :],
                  mask=head_mask[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"))   # [HG, S]
    lse_max = tl.max(lse, axis=1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.sum(tl.exp2(lse - lse_max[:, None]), axis=1)                                     # 0: no scores
    total = tl.where(weights > 0, lse_max + tl.log2(tl.where(weights > 0, weights, 1.0)), 0.0)    # [HG]
    base = (seq * NUM_KV_HEADS + kv_head).to(tl.int64)
    # by the sequence's query row, as the combine reads it (decode: row = sequence)
    acc = acc_ptr + (q_row * NUM_KV_HEADS + kv_head) * (HG * HEAD_DIM) + heads[None, :] * HEAD_DIM   # [1, HG]
    for i in tl.static_range(PAGES):
        page_index = tl.program_id(2) * PAGES + i
        page_head, count = _page_count(block_tables, slot_of_page, v_ocount, seq, kv_head, page_index, num_pages,
                                       stride_bt, NUM_KV_HEADS, CAP)
        tile = scores_ptr + (base * table_width + page_index) * (PAGE_SIZE * HG)
        for c0 in range(0, count, BLOCK_C):
            flat, resid, live = outlier_slots(v_oidx, v_ovals, page_head, c0, count, CAP, BLOCK_C)
            mask = live[:, None] & head_mask[None, :]
            s = tl.load(tile + (flat // HEAD_DIM)[:, None] * HG + heads[None, :], mask=mask, other=float("-inf"))
            weight = tl.exp2(s - total[None, :])                                                  # [C, HG]
            tl.atomic_add(acc + (flat % HEAD_DIM)[:, None],
                          tl.where(weight > 0, weight * resid.to(tl.float32)[:, None], 0.0), mask=mask, sem="relaxed")


def fix_tiles(batch: int, num_kv_heads: int, table_width: int, page_size: int, group: int,
              device) -> torch.Tensor:
    """An uninitialised [B, Hkv, W, PAGE, HG] fp32 buffer (key fixes or stored scores)."""
    return torch.empty((batch, num_kv_heads, table_width, page_size, group_width(group)), dtype=torch.float32,
                       device=device)


def key_fixes(query: torch.Tensor, key_pages, key_spec, staging_slot_of_page: torch.Tensor, meta,
              qk_scale: float, fixes: torch.Tensor, BLOCK_C: int = 64, PAGES: int = PAGES_PER_PROGRAM) -> torch.Tensor:
    """Fill fixes [B, Hkv, W, PAGE, HG] with r * q (qk_scale applied) summed by (token, head) for every low-bit
    page-head of the context with outliers (other tiles untouched); query [B, Hq, D]."""
    batch, num_kv_heads, width, page_size, hg = fixes.shape
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // num_kv_heads
    if batch == 0 or width == 0 or key_spec.outlier_capacity == 0:
        return fixes
    _key_fix_kernel[(batch, num_kv_heads, triton.cdiv(width, PAGES))](
        query, key_pages.outlier_vals, key_pages.outlier_idx, key_pages.outlier_count, staging_slot_of_page,
        meta.block_tables, meta.query_start_loc, meta.context_lens, fixes,
        qk_scale, width, query.stride(0), query.stride(1), meta.block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim, GROUP=group, HG=hg,
        CAP=key_spec.outlier_capacity, BLOCK_C=BLOCK_C, PAGES=PAGES, num_warps=4)
    return fixes


def value_fixes(scores: torch.Tensor, lse: torch.Tensor, value_pages, value_spec,
                staging_slot_of_page: torch.Tensor, meta, BLOCK_C: int = 64,
                PAGES: int = PAGES_PER_PROGRAM) -> torch.Tensor | None:
    """Value corrections [B, Hkv, 1, HG, D] (fp32, output units, normalised by the global LSE of lse
    [B, Hq, S]) from the stored scores [B, Hkv, W, PAGE, HG]; None without value outlier capacity."""
    batch, num_kv_heads, width, page_size, hg = scores.shape
    if value_spec.outlier_capacity == 0 or batch == 0 or width == 0:
        return None
    group, head_dim = lse.shape[1] // num_kv_heads, value_spec.head_dim
    acc = torch.zeros((batch, num_kv_heads, 1, hg, head_dim), dtype=torch.float32, device=scores.device)
    num_splits = lse.shape[2]
    _value_fix_kernel[(batch, num_kv_heads, triton.cdiv(width, PAGES))](
        scores, lse, value_pages.outlier_vals, value_pages.outlier_idx, value_pages.outlier_count,
        staging_slot_of_page, meta.block_tables, meta.query_start_loc, meta.context_lens, acc,
        width, num_splits, lse.stride(0), lse.stride(1), meta.block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim, GROUP=group, HG=hg,
        CAP=value_spec.outlier_capacity, BLOCK_C=BLOCK_C, BLOCK_S=max(triton.next_power_of_2(num_splits), 2),
        PAGES=PAGES, num_warps=4)
    return acc

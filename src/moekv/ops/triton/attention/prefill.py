"""Prefill (and mixed) attention over full-precision paged KV: a chunk of new tokens attends to the
sequence's earlier cached pages and causally to itself. The new tokens' keys and values are already
in the pages (the cache writes before it calls attention), so everything is read through the table.

One program per (sequence, block of BLOCK_Q new tokens, kv head). Its rows are the BLOCK_Q tokens x
q_per_kv query heads of that KV head (row r: token r // GROUP, head r % GROUP), so each K/V tile is
loaded once for the whole GQA group. Keys run from 0 to the last visible position of the block;
a causal mask (key position <= the row's position) applies throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.attention import invariant as invariant_tiles
from moekv.ops.triton.attention.invariant import block_step, finish, merge, split_result
from moekv.ops.triton.common import LOG2E, check_launchable, dot_modes, gather_kv, mma, pow2



@triton.jit
def _fp_prefill_kernel(
    q_ptr,                  # [T, Hq, D]
    k_ptr, v_ptr,           # [num_pages, P, Hkv, D]
    out_ptr,                # [T, Hq, D]
    block_tables_ptr,       # [B, max_pages] int32
    query_start_loc_ptr,    # [B+1] int32
    context_lens_ptr,       # [B] int32
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, UPCAST: tl.constexpr,
    INVARIANT: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    token = q_block * BLOCK_Q + offs_m // GROUP                          # [BLOCK_M] index in the chunk
    head = kv_head * GROUP + offs_m % GROUP                              # [BLOCK_M] query head
    m_valid = (offs_m < BLOCK_Q * GROUP) & (token < query_len)
    d_mask = offs_d < HEAD_DIM
    q_pos = context_len + token                                          # absolute positions
    row_mask = m_valid[:, None] & d_mask[None, :]

    q = tl.load(q_ptr + (q_start + token)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_mask, other=0.0).to(tl.float32) * qk_scale
    if HALF:
        q = q.to(k_ptr.dtype.element_ty)

    last_token = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, query_len) - 1
    key_end = context_len + last_token + 1                               # keys [0, key_end) are visible
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if INVARIANT:                     # decode's splits, walked and merged in order here (attention.invariant)
        m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_run = tl.zeros([BLOCK_M], tl.float32)
        acc_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for split_start in range(0, key_end, SPLIT_TOKENS):
            m_s = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_s = tl.zeros([BLOCK_M], tl.float32)
            acc_s = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            split_end = tl.minimum(split_start + SPLIT_TOKENS, key_end)
            for block_start in range(split_start, split_end, BLOCK_N):
                keys = block_start + offs_n                                  # [BLOCK_N] key positions
                n_mask = keys < key_end
                k, v = gather_kv(k_ptr, v_ptr, table, keys, n_mask, kv_head, stride_kp, stride_kt, stride_kh,
                                 stride_vp, stride_vt, stride_vh, offs_d, d_mask, PAGE_SIZE)
                visible = n_mask[None, :] & (keys[None, :] <= q_pos[:, None])
                m_s, l_s, acc_s = block_step(q, k, v, visible, m_s, l_s, acc_s, HALF, UPCAST)
            part, lse = split_result(m_s, l_s, acc_s)
            m_run, l_run, acc_run = merge(m_run, l_run, acc_run, lse, part)
        tl.store(out_ptr + (q_start + token)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :], finish(l_run, acc_run).to(out_ptr.dtype.element_ty), mask=row_mask)
        return
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for block_start in range(0, key_end, BLOCK_N):
        keys = block_start + offs_n                                      # [BLOCK_N] key positions
        n_mask = keys < key_end
        k, v = gather_kv(k_ptr, v_ptr, table, keys, n_mask, kv_head, stride_kp, stride_kt, stride_kh, stride_vp,
                         stride_vt, stride_vh, offs_d, d_mask, PAGE_SIZE)
        s = mma(q, tl.trans(k), UPCAST)                                   # [BLOCK_M, BLOCK_N]
        visible = n_mask[None, :] & (keys[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))                       # finite: key 0 is visible to all
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if HALF:
            p = p.to(v.dtype)
        acc = acc * alpha[:, None] + mma(p, v, UPCAST)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill_full_precision(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                                 block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                 context_lens: torch.Tensor, max_query_len: int, scale: float,
                                 config: dict | None = None, invariant: bool = False) -> torch.Tensor:
    """query [T, Hq, D] (sequences' new tokens back to back); pages [num_pages, P, Hkv, D] already
    holding the new tokens -> [T, Hq, D] in query's dtype. invariant: the batch-invariant arithmetic
    (ops.triton.attention.invariant, KernelConfig.batch_invariant): its fixed tiles, keys in SPLIT_TOKENS splits
    merged in order, no multiply-add contraction; config does not apply."""
    num_tokens, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_pages.shape
    assert key_pages.stride(-1) == 1 and value_pages.stride(-1) == 1 and query.stride(-1) == 1
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    batch = query_start_loc.shape[0] - 1
    if num_tokens == 0 or batch == 0:
        return out
    check_launchable(_fp_prefill_kernel, query)
    half, upcast = dot_modes(query, key_pages.dtype)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64 if half else 32, "num_warps": 4, "num_stages": 2}
    cfg.update(config or {})
    if invariant:
        cfg = {"BLOCK_M": invariant_tiles.block_rows(group), "BLOCK_N": invariant_tiles.BLOCK_N,
               "num_warps": invariant_tiles.NUM_WARPS, "num_stages": 2, "enable_fp_fusion": False}
    block_m = max(cfg.pop("BLOCK_M"), pow2(group))
    block_q = block_m // group
    grid = (batch, triton.cdiv(max(max_query_len, 1), block_q), num_kv_heads)
    _fp_prefill_kernel[grid](
        query, key_pages, value_pages, out, block_tables, query_start_loc, context_lens, scale * LOG2E,
        query.stride(0), query.stride(1),
        key_pages.stride(0), key_pages.stride(1), key_pages.stride(2),
        value_pages.stride(0), value_pages.stride(1), value_pages.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        PAGE_SIZE=page_size, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_D=pow2(head_dim), HALF=half, UPCAST=upcast, INVARIANT=invariant,
        SPLIT_TOKENS=invariant_tiles.SPLIT_TOKENS, **cfg)
    return out

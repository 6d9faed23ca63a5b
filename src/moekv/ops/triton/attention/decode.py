"""Decode attention over full-precision paged KV (bf16 / fp16 / fp32 pages), the Triton twin of
ops.reference.attention.paged_attention_full_precision for steps where every query length is 1.

One program per (sequence, kv head, split): it loads the q_per_kv query heads of its KV head as a
[BLOCK_H, D] matrix (padded to 16 rows for tl.dot), walks its share of the sequence's block table
BLOCK_N tokens at a time (a block may span pages: each token row is gathered through the table)
and keeps an online softmax in base 2 (the scale and log2(e) are folded into q). With more than one
split the partial results are merged either by a second launch (split_k.combine_splits) or, with
`combine=True` (KernelConfig.fused_attention_combine), inside this launch: every program stores its partial,
counts its arrival on its (sequence, kv head)'s counter and the last to arrive combines
(split_k.combine_if_last, where the memory ordering is argued). One split (a batch that fills the GPU by
itself) stores the output directly either way.

Splits are planned on the host from the longest sequence (`tokens_per_split` for every sequence),
or, with `device_splits` (CUDA-graph decode), the launch has a fixed number of splits and each
program sizes its sequence's splits from that sequence's own length: cdiv(seq_len, num_splits)
rounded up to whole blocks. No host value of a length enters the launch, so it can be captured once
and replayed; splits past a short sequence's end are empty (their lse is -inf, weight 0 in the combine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton import pdl
from moekv.ops.triton.common import LOG2E, check_launchable, dot_modes, gather_kv, mma, pow2

from moekv.ops.triton.attention import invariant
from moekv.ops.triton.attention.invariant import block_step, split_result
from moekv.ops.triton.attention.split_k import (arrival_counters, combine_chunk, combine_if_last, combine_splits,
                                                plan_splits)



@triton.jit
def _fp_decode_kernel(
    q_ptr,                  # [B, Hq, D]
    k_ptr, v_ptr,           # [num_pages, P, Hkv, D]
    block_tables_ptr,       # [B, max_pages] int32
    seq_lens_ptr,           # [B] int32 (tokens in the cache, the new one included)
    out_ptr,                # [B, Hq, D] (one split, or COMBINE)
    partial_ptr,            # [B, Hq, S, D] fp32 (split mode only)
    lse_ptr,                # [B, Hq, S] fp32 (split mode only)
    counters_ptr,           # [>= B * Hkv] int32 arrival counters, zero on entry and on exit (COMBINE only)
    qk_scale,               # softmax scale * log2(e)
    tokens_per_split,       # host-planned split length (ignored with DEVICE_SPLITS)
    num_splits,             # splits per sequence (DEVICE_SPLITS: split lengths derive from it)
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr, DEVICE_SPLITS: tl.constexpr,
    COMBINE: tl.constexpr, BLOCK_SC: tl.constexpr, INVARIANT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if DEVICE_SPLITS:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    else:
        split_len = tokens_per_split
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h                                     # [BLOCK_H] query heads

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * qk_scale                                                     # [BLOCK_H, BLOCK_D]
    if HALF:
        q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for block_start in range(start, end, BLOCK_N):
        tokens = block_start + offs_n                                    # [BLOCK_N]
        n_mask = tokens < end
        k, v = gather_kv(k_ptr, v_ptr, table, tokens, n_mask, kv_head, stride_kp, stride_kt, stride_kh, stride_vp,
                         stride_vt, stride_vh, offs_d, d_mask, PAGE_SIZE)   # [BLOCK_N, BLOCK_D] each
        if INVARIANT:                          # the arithmetic the prefill kernel repeats (attention.invariant)
            m_i, l_i, acc = block_step(q, k, v, n_mask[None, :], m_i, l_i, acc, HALF, UPCAST)
        else:
            s = mma(q, tl.trans(k), UPCAST)                               # [BLOCK_H, BLOCK_N] fp32
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if HALF:
                p = p.to(v.dtype)
            acc = acc * alpha[:, None] + mma(p, v, UPCAST)
            m_i = m_new

    out_mask = h_mask[:, None] & d_mask[None, :]
    if INVARIANT:
        out, lse = split_result(m_i, l_i, acc)
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    if SPLIT:
        base = partial_ptr + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        tl.store(base, out, mask=out_mask)
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=h_mask)
        if COMBINE:
            combine_if_last(counters_ptr + seq * tl.num_programs(1) + kv_head, partial_ptr + seq * stride_pb,
                            lse_ptr + seq * stride_lb, out_ptr + seq * stride_ob, kv_head * GROUP, num_splits,
                            stride_ph, stride_ps, stride_lh, stride_oh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_SC)
    else:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


def default_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Launch parameters (tuned on an H200, see docs/attention-kernels.md)."""
    block_n = 64 if head_dim <= 128 and dtype != torch.float32 else 32
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}


def paged_decode_full_precision(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                                scale: float, num_splits: int | None = None, config: dict | None = None,
                                device_splits: bool = False, combine: bool = False,
                                invariant: bool = False) -> torch.Tensor:
    """query [B, Hq, D]; key/value_pages [num_pages, P, Hkv, D]; block_tables [B, max_pages] int32;
    seq_lens [B] int32 -> [B, Hq, D] in query's dtype. `num_splits` None: chosen from the GPU size.

    device_splits: launch exactly `num_splits` splits and size them per sequence on the device
    (max_seq_len is not read; CUDA-graph capturable). combine: merge the splits inside the decode launch
    (the last program of each (sequence, kv head) does it) instead of a second launch. invariant: the
    batch-invariant arithmetic (ops.triton.attention.invariant; KernelConfig.batch_invariant): splits of
    invariant.SPLIT_TOKENS keys at fixed positions (num_splits: enough for the longest sequence, or given, e.g. a
    CUDA-graph bucket's; device_splits and combine do not apply), merged by a second launch in split order."""
    if invariant:
        return _decode_invariant(query, key_pages, value_pages, block_tables, seq_lens, max_seq_len, scale,
                                 num_splits)
    batch, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_pages.shape
    assert key_pages.stride(-1) == 1 and value_pages.stride(-1) == 1 and query.stride(-1) == 1
    group = num_heads // num_kv_heads
    cfg = dict(default_config(head_dim, key_pages.dtype), **(config or {}))
    block_n = cfg.pop("BLOCK_N")
    waves = cfg.pop("waves", 2)
    if device_splits:
        assert num_splits is not None and num_splits >= 1, "device_splits needs num_splits"
        tokens_per_split = 0
    elif num_splits is None:
        num_splits, tokens_per_split = plan_splits(batch, num_kv_heads, max_seq_len, block_n, query.device,
                                                   waves=waves)
    else:
        tokens_per_split = -(-max(-(-max(max_seq_len, 1) // num_splits), 1) // block_n) * block_n
    out = torch.empty_like(query)
    if batch == 0:
        return out
    check_launchable(_fp_decode_kernel, query)
    half, upcast = dot_modes(query, key_pages.dtype)
    split = num_splits > 1
    combine = combine and split
    common = dict(PAGE_SIZE=page_size, GROUP=group, BLOCK_H=pow2(group), HEAD_DIM=head_dim,
                  BLOCK_D=pow2(head_dim), BLOCK_N=block_n, HALF=half, UPCAST=upcast,
                  DEVICE_SPLITS=device_splits, SPLIT=split, COMBINE=combine,
                  BLOCK_SC=combine_chunk(head_dim, num_splits) if combine else 1, INVARIANT=False, **cfg)
    grid = (batch, num_kv_heads, num_splits)
    page_strides = (key_pages.stride(0), key_pages.stride(1), key_pages.stride(2),
                    value_pages.stride(0), value_pages.stride(1), value_pages.stride(2))
    if split:
        partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=query.device)
        split_strides = (partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1))
    else:
        partial = lse = out                          # not read: SPLIT is off
        split_strides = (0, 0, 0, 0, 0)
    counters = arrival_counters(query.device, batch * num_kv_heads) if combine else out   # not read without COMBINE
    _fp_decode_kernel[grid](
        query, key_pages, value_pages, block_tables, seq_lens, out, partial, lse, counters, scale * LOG2E,
        tokens_per_split, num_splits, query.stride(0), query.stride(1), *page_strides, block_tables.stride(0),
        out.stride(0), out.stride(1), *split_strides, **common, **pdl.launch_kwargs(query))
    if split and not combine:
        combine_splits(partial, lse, out)
    return out


def _decode_invariant(query, key_pages, value_pages, block_tables, seq_lens, max_seq_len, scale, num_splits):
    """paged_decode_full_precision(invariant=True): every (sequence, kv head, split) a program of the fixed tile
    shapes of attention.invariant, its split's partial stored, then attention.invariant.merge_splits."""
    batch, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_pages.shape
    group = num_heads // num_kv_heads
    num_splits = num_splits or invariant.num_splits(max_seq_len)
    out = torch.empty_like(query)
    if batch == 0:
        return out
    check_launchable(_fp_decode_kernel, query)
    half, upcast = dot_modes(query, key_pages.dtype)
    partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _fp_decode_kernel[(batch, num_kv_heads, num_splits)](
        query, key_pages, value_pages, block_tables, seq_lens, out, partial, lse, out, scale * LOG2E,
        invariant.SPLIT_TOKENS, num_splits, query.stride(0), query.stride(1),
        key_pages.stride(0), key_pages.stride(1), key_pages.stride(2),
        value_pages.stride(0), value_pages.stride(1), value_pages.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
        lse.stride(1), PAGE_SIZE=page_size, GROUP=group, BLOCK_H=invariant.block_rows(group), HEAD_DIM=head_dim,
        BLOCK_D=pow2(head_dim), BLOCK_N=invariant.BLOCK_N, HALF=half, UPCAST=upcast, SPLIT=True,
        DEVICE_SPLITS=False, COMBINE=False, BLOCK_SC=1, INVARIANT=True, num_warps=invariant.NUM_WARPS,
        num_stages=2, enable_fp_fusion=False)
    return invariant.merge_splits(partial, lse, seq_lens, out, num_kv_heads)

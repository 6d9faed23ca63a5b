"""Token-major decode attention over the low-bit paged KV cache (v6; one new token per sequence): the
same contract as lowbit_decode_tc.py (v5) and ops.reference.lowbit.paged_attention_lowbit
(docs/kv-format.md is the byte format), with the MMA roles turned around.

v5 put the GQA group's query heads (padded to 16) in the MMA M dimension, so its big unpacked code
tile was the B operand and went registers -> shared memory -> ldmatrix, and the score tile wasted
3/4 of its rows. Here the tokens are M and the (padded) heads are N:

  scores^T [BLOCK_N, H] = codes_K [BLOCK_N, D] @ qfold^T [D, H]     A: the code tile, from registers
  out^T    [D, H]      += codes_V^T [D, BLOCK_N] @ (p * S_t)^T [BLOCK_N, H]

On Hopper the key tile is a wgmma A operand read straight from registers (the "RS" form): the unpack
(lowbit_decode_tm_parts.py) produces it in exactly the register layout of that operand, from
coalesced word loads, by views only -- rows and columns permuted (token order and channel order are
free; the query rows are loaded in the permuted channel order, the output stored through it). The
small B operands (the folded query [D, H], the probabilities [BLOCK_N, H]) go to shared memory. The
value tile needs its K dimension (tokens) packed in pairs, which the format does not give, so it
takes Triton's shared-memory path (stmatrix + ldmatrix.trans) into the same kind of wgmma.

Math (q holds scale * log2(e); base-2 online softmax; qn = q / |q_h|max, |qn| <= 1; H = BLOCK_H heads):
  keys, channel axis: s[t, h] = ((codes[t] . (qn[h] * S)) * CODE_SCALE + qn[h] . Z) * |q_h|max -- the
      per-channel scale folds into the B operand once per page (fp16: |qn * S| <= 65504), qn . Z is a
      per-page row sum in fp32.
  keys, token axis (one group): s[t, h] = ((codes[t] . qn[h]) * S_t * CODE_SCALE + Z_t * sum(qn[h])) * |q_h|max
  values, token axis (one group): out[h] += ((p[t, h] * S_t / base) . codes[t]) * base * CODE_SCALE
      + sum_t p[t, h] Z_t; the second term and the softmax denominator are accumulated per element
      ([BLOCK_N, H], rescaled by alpha like the output) and summed over tokens once, after the loop:
      no cross-warp reduction per block for them (only the running max needs one).
  16-bit queries: fp16 dots on normalised operands (3 more mantissa bits than bf16); fp32 queries:
  fp32 operands and exact ("ieee") dots.
  Outliers (fp16 residual r at token t, channel d; up to the page-head's count), "passes" (the default from
  PASSES_MIN_PROGRAMS (sequence, kv head) pairs): corrections in launches of their own
  (lowbit_decode_fix.py): the loop adds a key-fix tile [BLOCK_N, H] (one load, by token, rows_view) to the
  scores and stores the scores of pages with value outliers (rows_unview); the value corrections join in the
  split combine. "scatter" (the default below that; BLOCK_C slots at a time): fp32 atomics into this
  program's scratch in global memory (L1/L2), one per (slot, head of the group), then one read of the
  corrections in the accumulator layout:
    keys: K[t, h] += r * q[h, d] (q scaled, read from a copy by channel); barrier; s += K (rows_view of the
      loaded [N, H] tile is the score layout), K re-zeroed by its reader;
    values: P[t, h] = p (stored by token, rows_unview); barrier; V[row(d), h] += P[t, h] * r; barrier after the
      value dot; out^T += V (added on the next page, before its rescale, so the read's latency hides), V
      re-zeroed by its reader. Unconditional barriers per page order every reuse (docs/attention-kernels.md).
  "dot": exact 0/1 dots as in v5, token-major:
    keys: s[:, h] += R [N, C] @ (q[h, d_c] / 2^e_h) [C, H] * 2^e_h, R = r at (its token's row, slot);
    values: p_sel [C, H] = pick [C, N] @ fp16(p) (an exact pick), then out^T += R [D, C] @ p_sel,
      R = r at (its channel's row, slot).
  Codes become fp16 as (code | 0x6400) - 1024 ("magic") or as the raw subnormal code * 2^-24
  ("subnormal", CODE_SCALE = 2^24 applied to the fp32 dot result).

Staging pages, the step's new token, splits (host-planned or `meta.fixed_num_splits` on the device),
and the combine are as in v5: the main loop treats every page as low-bit and masks staged pages; a
second loop attends the staged pages from their fp rows; split 0 adds the new token in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.common import LOG2E, check_launchable, dot_modes, pow2
from moekv.ops.triton.lowbit.decode_tm_parts import (add_values, channels, first_slots, key_outliers, load_words,
                                                     narrow, outlier_slots, pick_values, row_tokens, rows_unview,
                                                     rows_view, scatter_keys, scratch_offsets,
                                                     unpack, value_outliers, widen)
from moekv.ops.triton.lowbit.decode_common import (CODES_SUBNORMAL, code_mode, decode_batch, decode_splits,
                                                   launch_config, page_tensors, split_outputs, supports,
                                                   token_scale_zero)
from moekv.ops.triton.lowbit.decode_fix import fix_tiles, group_width, key_fixes, value_fixes
from moekv.ops.triton.attention.split_k import combine_splits


@triton.jit
def _decode_tm_kernel(
    q_ptr, new_k_ptr, new_v_ptr, out_ptr, lse_ptr,
    k_codes, k_scale, k_zero, k_base, k_ovals, k_oidx, k_ocount,
    v_codes, v_scale, v_zero, v_base, v_ovals, v_oidx, v_ocount,
    staging_k, staging_v, slot_of_page, scratch, scores_ptr,
    block_tables, query_start_loc, context_lens,
    qk_scale, pages_per_split, num_splits, fix_width,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HS: tl.constexpr, HG: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGE_N: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_BITS: tl.constexpr, K_WORDS: tl.constexpr, K_CAP: tl.constexpr,
    V_BITS: tl.constexpr, V_WORDS: tl.constexpr, V_CAP: tl.constexpr,
    CODES: tl.constexpr, CODE_SCALE: tl.constexpr, FP_HALF: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_C: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, PASSES: tl.constexpr, FIXED: tl.constexpr,
    SPLIT: tl.constexpr,
    SCAN: tl.constexpr, WARPS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc + seq).to(tl.int64)
    context_len = tl.load(context_lens + seq)
    num_pages = tl.cdiv(context_len, PAGE_SIZE)
    if FIXED:
        pages_per_split = tl.cdiv(num_pages, num_splits)
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, num_pages)

    offs_h = tl.arange(0, HS)                         # heads (softmax width; the MMAs pad to BLOCK_H)
    offs_c = tl.arange(0, HEAD_DIM)                   # operand column (keys) / output row (values)
    chan_k = channels(offs_c, K_BITS, HEAD_DIM)       # the channel of each key operand column
    chan_v = channels(offs_c, V_BITS, HEAD_DIM)       # the channel of each row of out^T
    head = kv_head * GROUP + offs_h
    head_mask = offs_h < GROUP
    q_heads = q_ptr + q_row * stride_qt + head * stride_qh                            # [HS] pointers
    q_sel_cols = (q_ptr + q_row * stride_qt + (kv_head * GROUP + tl.minimum(offs_h, GROUP - 1)) * stride_qh)[None, :]
    q32 = tl.load(q_heads[None, :] + chan_k[:, None], mask=head_mask[None, :], other=0.0).to(tl.float32) * qk_scale
    q_max = tl.max(tl.abs(q32), axis=0)
    q_max = tl.where(q_max > 0, q_max, 1.0)                                           # [HS]
    q_p2 = tl.exp2(tl.ceil(tl.log2(q_max / qk_scale)))                                # power of two >= |raw q|
    q_inv_p2 = (1.0 / q_p2)[None, :]
    q_p2_scale = q_p2 * qk_scale
    HALF: tl.constexpr = CODES != 0
    if HALF:
        low_dtype = tl.float16
    else:
        low_dtype = tl.float32
    qn = q32 / q_max[None, :]                                                         # [D, HS], |qn| <= 1
    q_sum = tl.sum(qn, axis=0)
    qn_op = widen(qn, HEAD_DIM, HS, BLOCK_H).to(low_dtype)
    dot_scale = CODE_SCALE * q_max                                                    # [HS]

    m_i = tl.full([HS], float("-inf"), tl.float32)
    acc = tl.zeros([HEAD_DIM, HS], tl.float32)                                        # out^T, rows chan_v
    l_acc = tl.zeros([BLOCK_N, HS], tl.float32)                                       # sum_t p, per row
    z_acc = tl.zeros([BLOCK_N, HS], tl.float32)                                       # sum_t p Z_t, per row
    table = block_tables + seq.to(tl.int64) * stride_bt
    tok_r = row_tokens(tl.arange(0, BLOCK_N), BLOCK_N, WARPS)                         # token of each tile row
    if SCATTER:
        # outliers through this program's scratch (fp32; see the v6 section of docs/attention-kernels.md): key
        # corrections [BLOCK_N, HS] by token and value corrections [D, HS] (zeroed here, left zero), the block's
        # probabilities [BLOCK_N, HS] by token, the scaled query [D, HS] by channel
        SK: tl.constexpr = BLOCK_N * HS
        SV: tl.constexpr = HEAD_DIM * HS
        k_scr = scratch + ((seq * NUM_KV_HEADS + kv_head) * num_splits + split).to(tl.int64) * (2 * SK + 2 * SV)
        v_scr = k_scr + SK
        p_scr = v_scr + SV
        q_scr = p_scr + SK
        tl.store(k_scr + tl.arange(0, SK), tl.zeros([SK], tl.float32))
        tl.store(v_scr + tl.arange(0, SV), tl.zeros([SV], tl.float32))
        tl.store(q_scr + chan_k[:, None] * HS + tl.max_contiguous(offs_h, [2])[None, :], q32)
        tl.debug_barrier()
        k_offs = scratch_offsets(BLOCK_N, HS)
        v_offs = scratch_offsets(HEAD_DIM, HS)
        offs_slot = tl.arange(0, BLOCK_C)
        v_fix = tl.zeros([HEAD_DIM, HS], tl.float32)                                  # the previous page's, pending
    if PASSES:
        # outliers in passes of their own (lowbit_decode_fix.py): key fixes [PAGE, HG] per page-head are read
        # here, the scores of pages with value outliers are stored for the value pass; no barriers, no atomics
        fix_tiles = (seq * NUM_KV_HEADS + kv_head).to(tl.int64) * fix_width * (PAGE_SIZE * HG)
        f_offs = tl.max_contiguous(tl.arange(0, BLOCK_N)[:, None] * HG + offs_h[None, :], [1, 2])    # [N, HS]
        f_cols = tl.zeros([BLOCK_N, 1], tl.int32) + offs_h[None, :]                        # [N, HS] column

    # ---- low-bit pages (staged pages computed too, then masked out) ----
    SUBS: tl.constexpr = PAGE_SIZE // BLOCK_N
    for block in range(first * SUBS, last * SUBS):
        page_index = block // SUBS
        row0 = (block % SUBS) * BLOCK_N
        page = tl.load(table + page_index).to(tl.int64)
        page_head = page * NUM_KV_HEADS + kv_head
        k_lo, k_hi = load_words(k_codes, page_head, row0, K_BITS, K_WORDS, PAGE_SIZE, HEAD_DIM, BLOCK_N)
        v_lo, v_hi = load_words(v_codes, page_head, row0, V_BITS, V_WORDS, PAGE_SIZE, HEAD_DIM, BLOCK_N)
        lowbit = tl.load(slot_of_page + page) < 0
        tok = row0 + tok_r                                                            # [N] token in the page
        valid = lowbit & (page_index * PAGE_SIZE + tok < context_len)
        v_b = tl.load(v_base + page_head).to(tl.float32)
        v_rel, v_zt = token_scale_zero(v_scale, v_zero, v_b, page_head * PAGE_SIZE + tok, V_BITS)
        if K_CAP > 0 and SCATTER:
            k_idx0, k_res0 = first_slots(k_oidx, k_ovals, page_head, K_CAP, BLOCK_C)
        if V_CAP > 0 and SCATTER:
            v_idx0, v_res0 = first_slots(v_oidx, v_ovals, page_head, V_CAP, BLOCK_C)
        if PASSES:
            f_tile = fix_tiles + (page_index * PAGE_SIZE + row0) * HG
        if K_CAP > 0 and PASSES:
            k_count = tl.where(lowbit, tl.load(k_ocount + page_head).to(tl.int32), 0)
            k_fix = rows_view(tl.load(scratch + f_tile + f_offs, mask=f_cols < tl.where(k_count > 0, GROUP, 0),
                                      other=0.0), BLOCK_N, HS, WARPS)
        if K_CAP > 0 and SCATTER:
            # key outliers first (the first slots were loaded with the code words): atomics, a barrier, then the
            # read of the corrections is in flight during the unpack and the dot
            k_count = tl.where(lowbit, tl.minimum(tl.load(k_ocount + page_head).to(tl.int32), K_CAP), 0)
            if V_CAP == 0:
                tl.debug_barrier()                                                    # last page's reads first
            scatter_keys(k_scr, q_scr, k_idx0, k_res0, offs_slot < k_count, row0, GROUP, HEAD_DIM, BLOCK_N,
                         PAGE_SIZE, HS, HG)
            for c0 in range(BLOCK_C, k_count, BLOCK_C):
                idx, resid, live = outlier_slots(k_oidx, k_ovals, page_head, c0, k_count, K_CAP, BLOCK_C)
                scatter_keys(k_scr, q_scr, idx, resid, live, row0, GROUP, HEAD_DIM, BLOCK_N, PAGE_SIZE, HS, HG)
            tl.debug_barrier()                                                        # atomics -> reads
            k_mask = k_offs < (k_count > 0).to(tl.int32) * SK                         # all or nothing
            k_fix = rows_view(tl.load(k_scr + k_offs, mask=k_mask, other=0.0, cache_modifier=".cg"), BLOCK_N, HS,
                              WARPS)
            if SK < 32 * WARPS:
                tl.debug_barrier()                                                    # replicated reads first
            tl.store(k_scr + k_offs, tl.zeros([BLOCK_N, HS], tl.float32), mask=k_mask)
        # keys -> scores^T [N, HS]
        k_op = unpack(k_lo, k_hi, K_BITS, CODES, HEAD_DIM, BLOCK_N, WARPS)
        if K_CHANNEL:
            k_s = tl.load(k_scale + page_head * HEAD_DIM + chan_k).to(tl.float32)
            k_z = tl.load(k_zero + page_head * HEAD_DIM + chan_k).to(tl.float32)
            bias = tl.sum(qn * k_z[:, None], axis=0) * q_max                          # [HS] q . Z
            qs_op = widen(qn * k_s[:, None], HEAD_DIM, HS, BLOCK_H).to(low_dtype)
            s = narrow(tl.dot(k_op, qs_op, input_precision="ieee"), BLOCK_N, HS, BLOCK_H) * dot_scale[None, :] \
                + bias[None, :]
        else:
            k_b = tl.load(k_base + page_head).to(tl.float32)
            k_rel, k_zt = token_scale_zero(k_scale, k_zero, k_b, page_head * PAGE_SIZE + tok, K_BITS)
            s = (narrow(tl.dot(k_op, qn_op, input_precision="ieee"), BLOCK_N, HS, BLOCK_H) * (k_b * k_rel)[:, None]
                 * dot_scale[None, :] + k_zt[:, None] * (q_sum * q_max)[None, :])
        if K_CAP > 0 and (SCATTER or PASSES):
            s += k_fix
        elif K_CAP > 0:
            k_count = tl.where(lowbit, tl.minimum(tl.load(k_ocount + page_head).to(tl.int32), K_CAP), 0)
            s_out = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
            for c0 in range(0, k_count, BLOCK_C):
                idx, resid, live = outlier_slots(k_oidx, k_ovals, page_head, c0, k_count, K_CAP, BLOCK_C)
                s_out = key_outliers(s_out, idx, resid, live, tok, q_sel_cols, q_inv_p2, HEAD_DIM, HALF, HS, BLOCK_H)
            if HALF:
                s += narrow(s_out, BLOCK_N, HS, BLOCK_H) * q_p2_scale[None, :]
            else:
                s += narrow(s_out, BLOCK_N, HS, BLOCK_H) * qk_scale
        s = tl.where(valid[:, None], s, float("-inf"))
        if V_CAP > 0 and PASSES:
            v_count = tl.where(lowbit, tl.load(v_ocount + page_head).to(tl.int32), 0)
            tl.store(scores_ptr + f_tile + f_offs, rows_unview(s, BLOCK_N, HS, WARPS),
                     mask=f_cols < tl.where(v_count > 0, GROUP, 0))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[None, :])                                               # [N, HS] in [0, 1]
        m_i = m_new
        l_acc = l_acc * alpha[None, :] + p
        z_acc = z_acc * alpha[None, :] + p * tl.where(lowbit, v_zt, 0.0)[:, None]
        if V_CAP > 0 and SCATTER:
            # value outliers: p by token to the scratch, a barrier, the first slots' p read (in flight during the
            # unpack), atomics; the corrections are read after the dot
            v_count = tl.where(lowbit, tl.minimum(tl.load(v_ocount + page_head).to(tl.int32), V_CAP), 0)
            tl.store(p_scr + k_offs, rows_unview(p, BLOCK_N, HS, WARPS), mask=k_offs < (v_count > 0).to(tl.int32) * SK)
            tl.debug_barrier()                                                        # p -> its readers
            v_p0, v_row0, v_mask0 = pick_values(p_scr, v_idx0, offs_slot < v_count, row0, GROUP, HEAD_DIM, V_BITS,
                                                BLOCK_N, PAGE_SIZE, WARPS, HS, HG)
        # values -> out^T [D, HS]
        v_op = unpack(v_lo, v_hi, V_BITS, CODES, HEAD_DIM, BLOCK_N, WARPS)
        ps_op = widen(p * v_rel[:, None], BLOCK_N, HS, BLOCK_H).to(low_dtype)
        if V_CAP > 0 and SCATTER:
            add_values(v_scr, v_p0, v_row0, v_mask0, v_res0, HS, HG)
            for c0 in range(BLOCK_C, v_count, BLOCK_C):
                idx, resid, live = outlier_slots(v_oidx, v_ovals, page_head, c0, v_count, V_CAP, BLOCK_C)
                v_p, v_row, v_mask = pick_values(p_scr, idx, live, row0, GROUP, HEAD_DIM, V_BITS, BLOCK_N,
                                                 PAGE_SIZE, WARPS, HS, HG)
                add_values(v_scr, v_p, v_row, v_mask, resid, HS, HG)
        pv = tl.dot(tl.trans(v_op), ps_op, input_precision="ieee")                    # [D, BLOCK_H]
        if V_CAP > 0 and SCATTER:
            pv = tl.where(lowbit, narrow(pv, HEAD_DIM, HS, BLOCK_H) * (v_b * CODE_SCALE), 0.0)
            # the previous page's corrections join before this page's rescale; this page's are read now (after
            # the barrier) and added next page, so the read's latency hides behind the next page's work
            acc = (acc + v_fix) * alpha[None, :] + pv
            tl.debug_barrier()                                                        # atomics -> reads
            v_mask = v_offs < (v_count > 0).to(tl.int32) * SV
            v_fix = rows_view(tl.load(v_scr + v_offs, mask=v_mask, other=0.0, cache_modifier=".cg"), HEAD_DIM, HS,
                              WARPS)
            tl.store(v_scr + v_offs, tl.zeros([HEAD_DIM, HS], tl.float32), mask=v_mask)
        elif V_CAP > 0 and not PASSES:
            v_count = tl.where(lowbit, tl.minimum(tl.load(v_ocount + page_head).to(tl.int32), V_CAP), 0)
            p_op = widen(p, BLOCK_N, HS, BLOCK_H).to(low_dtype)
            pv_out = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)
            for c0 in range(0, v_count, BLOCK_C):
                idx, resid, live = outlier_slots(v_oidx, v_ovals, page_head, c0, v_count, V_CAP, BLOCK_C)
                pv_out = value_outliers(pv_out, p, p_op, idx, resid, live, tok, row0, chan_v, HEAD_DIM, HALF, GATHER,
                                        BLOCK_N, WARPS, HS, BLOCK_H)
            pv = narrow(pv, HEAD_DIM, HS, BLOCK_H) * (v_b * CODE_SCALE) + narrow(pv_out, HEAD_DIM, HS, BLOCK_H)
            pv = tl.where(lowbit, pv, 0.0)                                            # staged: stale storage
            acc = acc * alpha[None, :] + pv
        else:
            pv = narrow(pv, HEAD_DIM, HS, BLOCK_H) * (v_b * CODE_SCALE)
            pv = tl.where(lowbit, pv, 0.0)
            acc = acc * alpha[None, :] + pv
    if V_CAP > 0 and SCATTER:
        acc += v_fix
    l_i = tl.sum(l_acc, axis=0)
    acc += tl.sum(z_acc, axis=0)[None, :]

    # ---- staged pages of the split (fp rows), found a vector of table entries at a time ----
    if FP_HALF:
        q_op = widen(q32, HEAD_DIM, HS, BLOCK_H).to(q_ptr.dtype.element_ty)
    else:
        q_op = widen(q32, HEAD_DIM, HS, BLOCK_H)
    offs_scan = tl.arange(0, SCAN)
    for s0 in range(first, last, SCAN):
        index = s0 + offs_scan
        in_range = index < last
        pages = tl.load(table + index, mask=in_range, other=0)
        slots = tl.load(slot_of_page + pages, mask=in_range, other=-1)
        staged = in_range & (slots >= 0)
        for _ in range(tl.sum(staged.to(tl.int32), axis=0)):
            page_index = tl.min(tl.where(staged, index, last), axis=0)
            slot = tl.max(tl.where(index == page_index, slots, -1), axis=0).to(tl.int64)
            staged = staged & (index != page_index)
            for t0 in range(0, tl.minimum(context_len - page_index * PAGE_SIZE, PAGE_SIZE), STAGE_N):
                offs_t = t0 + tl.arange(0, STAGE_N)
                rows = (slot * PAGE_SIZE + offs_t) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
                n_valid = page_index * PAGE_SIZE + offs_t < context_len
                k = tl.load(staging_k + rows[:, None] + chan_k[None, :])
                if UPCAST:
                    s = tl.dot(k.to(tl.float32), q_op.to(tl.float32), input_precision="ieee")
                else:
                    s = tl.dot(k.to(q_op.dtype), q_op)
                s = tl.where(n_valid[:, None], narrow(s, STAGE_N, HS, BLOCK_H), float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=0))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_use)
                p = tl.exp2(s - m_use[None, :])
                m_i = m_new
                l_i = l_i * alpha + tl.sum(p, axis=0)
                v = tl.load(staging_v + rows[:, None] + chan_v[None, :])
                if UPCAST:
                    pv = tl.dot(tl.trans(v.to(tl.float32)), widen(p, STAGE_N, HS, BLOCK_H), input_precision="ieee")
                else:
                    pv = tl.dot(tl.trans(v.to(q_op.dtype)), widen(p, STAGE_N, HS, BLOCK_H).to(q_op.dtype))
                acc = acc * alpha[None, :] + narrow(pv, HEAD_DIM, HS, BLOCK_H)

    # ---- the step's new token, full precision (split 0) ----
    if split == 0:
        k_new = tl.load(new_k_ptr + q_row * stride_kt + kv_head * stride_kh + chan_k).to(tl.float32)
        v_new = tl.load(new_v_ptr + q_row * stride_vt + kv_head * stride_vh + chan_v).to(tl.float32)
        s_new = tl.sum(q32 * k_new[:, None], axis=0)                                  # [HS]
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[None, :] + v_new[:, None] * p_new[None, :]
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[None, :]                                                       # [D, H]
    if SPLIT:
        tl.store(out_ptr + q_row * stride_ot + head[None, :] * stride_oh + split * stride_os + chan_v[:, None], out,
                 mask=head_mask[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + q_row * stride_lt + head * stride_lh + split, lse, mask=head_mask)
    else:
        tl.store(out_ptr + q_row * stride_ot + head[None, :] * stride_oh + chan_v[:, None],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask[None, :])


# outliers="auto" takes "passes" from this many (sequence, kv head) pairs on (H200, int3, L=16k: B=32 0.60 ms
# vs 0.85 with "scatter"; B=1 0.063 vs 0.059 ms), "scatter" below
PASSES_MIN_PROGRAMS = 64
PASSES_MAX_BYTES = 4 << 30      # "auto" keeps "scatter" when the passes' two fp32 tile buffers would exceed this


def paged_attention_lowbit_decode_tm(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pages,
                                     value_pages, key_spec, value_spec, staging_keys: torch.Tensor,
                                     staging_values: torch.Tensor, staging_slot_of_page: torch.Tensor, meta,
                                     scale: float, **launch_overrides) -> torch.Tensor:
    """Decode (one new token per sequence) attention over low-bit pages; query [B, Hq, D] -> [B, Hq, D].

    `meta.fixed_num_splits` (an int) switches to device-side split ranges: no host list is read and
    nothing syncs (CUDA-graph safe); otherwise the split count is planned on the host.
    launch_overrides (defaults in brackets; all give the same results within rounding):
      num_warps [4], num_stages [1], maxnreg [None],
      BLOCK_N [128, capped to the page]: low-bit tokens per step (a divisor of the page size, >= 16); the
          register A-operand layout is matched for BLOCK_N >= 16 * num_warps (4 warps: 64 or 128,
          8 warps: 128),
      BLOCK_H [max(16, GQA group)]: heads per tile, the MMA N (Triton 3.6 takes wgmma from 16 on; 8
          works on later versions),
      STAGE_N [32]: staged fp tokens per step, SCAN [32]: block-table entries scanned per step,
      outliers ["auto": "passes" from PASSES_MIN_PROGRAMS (sequence, kv head) pairs, else "scatter"] | "passes" |
          "scatter" | "dot": "passes": in launches of their own before and after this kernel
          (lowbit_decode_fix.py; the kernel only reads a key-fix tile and stores its scores per page with
          outliers: no barriers or atomics in its loop; a [B, Hkv, table width, page, HG] fp32 buffer per side
          with outlier capacity);
          "scatter": fp32 atomics into a per-program scratch in global memory (torch.empty here,
          [programs, 2 * (BLOCK_N + D) * heads] fp32, zeroed by the kernel); "dot": exact 0/1 dots. Buffer
          shapes depend on launch constants only (CUDA graphs may capture them). With "passes" and "scatter",
          where several outliers meet in one correction the order of the fp32 additions varies run to run, and
          so may the last bits; "dot" is bit-reproducible,
      BLOCK_C [64 for "scatter", 16 for "dot"]: outlier slots per step (>= 16; "scatter" handles the first
          BLOCK_C slots of a page in the page loop itself, further ones in a loop; "passes": not used, the
          passes take 64 at a time),
      gather_p [True] ("dot" only): value outliers pick p with tl.gather, else with a 0/1 dot,
      codes ["subnormal"] | "magic": fp16 codes as the code's bits read as an fp16 subnormal (code * 2^-24,
          2^24 applied after the dot; one instruction per two values less), or as (code | 0x6400) - 1024,
      num_splits [None: planned] (host mode only), waves [2] (host planning).
    """
    cfg = {"num_warps": 4, "num_stages": 1, "maxnreg": None, "BLOCK_N": 128, "BLOCK_H": None, "STAGE_N": 32,
           "SCAN": 32, "BLOCK_C": None, "gather_p": True, "codes": "subnormal", "outliers": "auto", "num_splits": None,
           "waves": 2}
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    page_size = key_spec.page_size
    if not supports(key_spec, value_spec, head_dim):
        raise NotImplementedError(f"lowbit decode_tm: unsupported format {key_spec} / {value_spec} at D={head_dim}")
    cfg = launch_config(cfg, launch_overrides)
    batch = decode_batch(meta, num_tokens, "paged_attention_lowbit_decode_tm")
    fixed = getattr(meta, "fixed_num_splits", None)
    out = torch.empty_like(query)
    if num_tokens == 0 or batch == 0:
        return out
    check_launchable(_decode_tm_kernel, query)
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
    assert staging_keys.is_contiguous() and staging_values.is_contiguous()
    half, upcast = dot_modes(query, staging_keys.dtype)
    codes = code_mode(query, cfg["codes"])
    num_splits, pages_per_split = decode_splits(meta, batch, num_kv_heads, page_size, query.device,
                                                cfg["num_splits"], cfg["waves"])
    if cfg["outliers"] not in ("auto", "dot", "scatter", "passes"):
        raise ValueError(f"outliers must be 'auto', 'dot', 'scatter' or 'passes', not {cfg['outliers']!r}")
    mode = cfg["outliers"]
    fix_width = meta.block_tables.shape[1]
    if mode == "auto":          # the passes' three extra launches cost more than they save on a small grid
        tiles_bytes = 2 * batch * num_kv_heads * fix_width * page_size * group_width(num_heads // num_kv_heads) * 4
        mode = ("passes" if batch * num_kv_heads >= PASSES_MIN_PROGRAMS and tiles_bytes <= PASSES_MAX_BYTES
                else "scatter")
    has_outliers = key_spec.outlier_capacity > 0 or value_spec.outlier_capacity > 0
    scatter = mode == "scatter" and has_outliers
    passes = mode == "passes" and has_outliers
    partial, lse, target, strides = split_outputs(out, num_splits, always=passes)
    group = num_heads // num_kv_heads
    block_h = max(cfg["BLOCK_H"] or 16, pow2(group, floor=1))
    soft_h = block_h if block_h <= 8 or group > block_h // 2 else block_h // 2      # heads the softmax carries
    block_n = min(cfg["BLOCK_N"], page_size)
    block_c = cfg["BLOCK_C"] or (64 if scatter else 16)
    hg = min(group_width(group), soft_h)                # heads per scratch row (scatter) / fix-tile row stride
    if passes and hg != group_width(group):
        raise ValueError(f"outliers='passes' needs BLOCK_H >= {group_width(group)} at GQA group {group}")
    # shapes from launch constants only (no host read of device values: CUDA-graph safe)
    scratch = scores = lse
    if scatter:
        scratch = torch.empty((batch * num_kv_heads * num_splits, 2 * (block_n + head_dim) * soft_h),
                              dtype=torch.float32, device=query.device)
    elif passes:                # each buffer only for a side with outlier capacity
        if key_spec.outlier_capacity > 0:
            scratch = fix_tiles(batch, num_kv_heads, fix_width, page_size, group, query.device)
            key_fixes(query, key_pages, key_spec, staging_slot_of_page, meta, scale * LOG2E, scratch)
        if value_spec.outlier_capacity > 0:
            scores = fix_tiles(batch, num_kv_heads, fix_width, page_size, group, query.device)
    _decode_tm_kernel[(batch, num_kv_heads, num_splits)](
        query, key, value, target, lse, *page_tensors(key_pages, "K"), *page_tensors(value_pages, "V"),
        staging_keys, staging_values, staging_slot_of_page, scratch, scores,
        meta.block_tables, meta.query_start_loc, meta.context_lens,
        scale * LOG2E, pages_per_split, num_splits, fix_width,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *strides, meta.block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        GROUP=group, BLOCK_H=block_h, HS=soft_h, HG=hg,
        BLOCK_N=block_n, STAGE_N=min(cfg["STAGE_N"], page_size),
        K_CHANNEL=key_spec.axis == "channel", K_BITS=key_spec.bits, K_WORDS=key_spec.words_per_row,
        K_CAP=key_spec.outlier_capacity,
        V_BITS=value_spec.bits, V_WORDS=value_spec.words_per_row, V_CAP=value_spec.outlier_capacity,
        CODES=codes, CODE_SCALE=2.0 ** 24 if codes == CODES_SUBNORMAL else 1.0, FP_HALF=half, UPCAST=upcast,
        BLOCK_C=block_c, GATHER=bool(cfg["gather_p"]), SCATTER=scatter, PASSES=passes, FIXED=fixed is not None,
        SPLIT=partial is not None, SCAN=cfg["SCAN"],
        WARPS=cfg["num_warps"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}))
    if passes:
        fix = None
        if value_spec.outlier_capacity > 0:
            fix = value_fixes(scores, lse, value_pages, value_spec, staging_slot_of_page, meta)
        combine_splits(partial, lse, out, fix)
    elif num_splits > 1:
        combine_splits(partial, lse, out)
    return out

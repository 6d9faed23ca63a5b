"""Decode attention over the low-bit paged KV cache on tensor cores (one new token per sequence):
a faster alternative to lowbit_attention.py's decode path, same contract as
ops.reference.lowbit.paged_attention_lowbit (docs/kv-format.md is the byte format).

Programs: one per (sequence, kv head, split of the context). The rows of every tile are the GQA
group's query heads, padded to 16 (the smallest tl.dot M); BLOCK_N tokens (default: a whole page)
per step, so each page's codes are unpacked once for the whole group.

Math (q already holds scale * log2(e); base-2 online softmax; qn = q / |q_h|max, |qn| <= 1):
  keys, channel axis: s[h, t] = ((qn[h] * S / S_max) . code[t] * S_max + qn[h] . Z) * |q_h|max --
      the per-channel scale folds into q once per page; qn . Z runs on the tensor cores as
      (qn_hi + qn_lo) @ [Z broadcast to 16 columns] (Z is exact in fp16, qn split in two fp16 parts:
      22 bits), which avoids a row sum across lanes (bias_dot; else a plain fp32 row sum).
  keys, token axis (one group): s[h, t] = ((qn[h] . code[t]) * S_t + sum(qn[h]) * Z_t) * |q_h|max
  values, token axis (one group): o[h] += ((p[h, t] * S_t / scale_base) . code[t]) * scale_base
      + sum_t p[h, t] Z_t -- the per-token scale folds into p (<= 1).
  16-bit queries: every low-bit dot is fp16 x fp16 -> fp32 on these normalised operands (3 more
  mantissa bits than bf16, nothing overflows); fp32 queries: fp32 operands, exact ("ieee") dots.
  Outliers (fp16 residual r at token t, channel d; up to the page-head's count, BLOCK_C slots at a
  time; slots past the count hold r = 0, so only the capacity is masked), as exact 0/1 dots:
    keys: s[h, t] += q[h, d] r = (q_sel / 2^e) @ R * 2^e, q_sel [M, C] = the raw query at the slots'
      channels (read again from L1), 2^e >= |q_h| a power of two, so q_sel / 2^e and r are exact in
      fp16 and one fp16 MMA against R [C, N] = r at (slot, its token) is exact (fp32 accumulation);
    values: o[h, d] += p[h, t] r: p_sel = fp16(p) @ [N, C] one-hot (an exact pick of fp16(p), the
      same rounding the main value dot applies to p * S_t / scale_base), then p_sel @ R [C, D] = r at
      (slot, its channel): two MMAs, no tl.gather shuffles (gather_p switches to tl.gather with p kept
      to 22 bits as hi + lo). The 0/1 matrices are built as [N, C] / [D, C] and fed transposed: in
      that orientation each thread holds few slots, so each slot's index is loaded by few threads.
    OUTLIERS=2 ("elementwise"): compare-and-sum over [M, C, N] in fp32 instead (a sweep variant).

Unpack, in registers: for a plane of k-bit fields (32 / k per word), fields f and f + 16/k sit at
bits k*f and k*f + 16, so one shift and one mask cut out a packed pair `(w >> k*f) & (m | m << 16)`
whose 16-bit halves are the two codes; int3 ORs in the 1-bit plane's bits, spread once per word to
bits g + 2 / g + 18 of the matching 2-bit-plane word, so a code costs ~2 integer instructions (int4,
int2: ~1). Each half is read as fp16: (code | 0x6400) - 1024 = code exactly ("magic"), or the raw
bits as an fp16 subnormal = code * 2^-24 ("subnormal": no instruction at all; the 2^24 is applied to
the fp32 dot result). The per-field [N, W] tiles are combined by a tree of tl.interleave (join +
reshape: interleave(even fields, odd fields) puts field f of word w at column w*F + f, the format's
channel order); every join's new axis lands in registers, so the [N, D] tile is built without moving
data between lanes. Its only trip through shared memory is the MMA operand load itself (local_alloc
+ ldmatrix, as for any register-produced tl.dot operand on sm_80/90).
Two layout switches (both on by default; tools/sass_stats.py measures them): `perm` puts the operand's
columns in pair order -- column w*F + 2g + h holds channel w*F + g + h*F/2 (parts.channels) -- so
each 32-bit pair is already two adjacent fp16 operand values (no byte permutes before the stores);
q, the key scales / zero points and staged keys are read in the key order, staged values, the new
token's value and the output in the value order (the two differ when the widths differ), and value
outliers map their channel to its column. `spread` loads int3's planes in a layout with two lanes per
row: Triton orders a register tile's shared copy by lanes, so with one thread per row (the plain
layout at 4 warps) each value went to shared memory as its own 16-bit store.

Per block, every load is issued at the top of the iteration, before any math: code words, scales,
zero points, outlier counts and (`outlier_pre` chunks of BLOCK_C) the first outlier slots, with page
ids read one block ahead -- one memory latency per block instead of one per dependent step (the
value scales used to wait for the key outlier loop, each outlier pass for the previous one). Slots
past the preloaded ones are read BLOCK_C at a time in a loop, as before. `l2_prefetch` asks L2 for
the next block's bytes (prefetch.global.L2; CUDA only) so that those loads hit L2.

Staging pages (staging_slot_of_page[page] >= 0: a sequence's partial last page and its sink pages)
are not branched on in the main loop: it treats every page of the split as low-bit (a staged page's
stale low-bit storage is finite, and its scores are masked to -inf, its value contribution and
outlier counts to 0); a second short loop scans the split's block-table entries SCAN at a time and
attends the staged pages from their fp rows (STAGE_N tokens per step). The main loop therefore has
no data-dependent branch; `prefetch` software-pipelines the next block's code words through
registers (Triton's own pipeliner does not touch loads that feed elementwise code). Split 0 also
attends the step's new token (passed in full precision, fp32 math).

Splits: (a) `meta.fixed_num_splits` an int: exactly that many splits per (sequence, head), each
sequence's page range computed on the device from its own context length (pages_per_split =
cdiv(cdiv(len, P), splits)); the wrapper then reads no host list and never syncs (CUDA-graph safe);
(b) otherwise split_k.plan_splits on the host. Partial results meet in split_k.combine_splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.common import LOG2E, check_launchable, dot_modes, online_softmax_step, pow2
from moekv.ops.triton.lowbit.decode_tc_parts import (channels, key_chunk, key_outliers, load_words, outlier_slots,
                                                     prefetch_block, unpack, value_chunk,
                                                     value_outliers)
from moekv.ops.triton.lowbit.decode_common import (CODES_SUBNORMAL, code_mode, decode_batch, decode_splits,
                                                   launch_config, page_tensors, split_outputs, supports,
                                                   token_scale_zero)
from moekv.ops.triton.attention.split_k import combine_splits

OUTLIERS_DOT = 1        # outlier corrections by exact 0/1-matrix tensor-core dots (fp16, or fp32 "ieee")
OUTLIERS_ELEMENTWISE = 2


@triton.jit
def _decode_tc_kernel(
    q_ptr, new_k_ptr, new_v_ptr, out_ptr, lse_ptr,
    k_codes, k_scale, k_zero, k_base, k_ovals, k_oidx, k_ocount,
    v_codes, v_scale, v_zero, v_base, v_ovals, v_oidx, v_ocount,
    staging_k, staging_v, slot_of_page,
    block_tables, query_start_loc, context_lens,
    qk_scale, pages_per_split, num_splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGE_N: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_BITS: tl.constexpr, K_WORDS: tl.constexpr, K_CAP: tl.constexpr,
    V_BITS: tl.constexpr, V_WORDS: tl.constexpr, V_CAP: tl.constexpr,
    CODES: tl.constexpr, CODE_SCALE: tl.constexpr, FP_HALF: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_C: tl.constexpr, OUTLIERS: tl.constexpr, PREFETCH: tl.constexpr, GATHER_P: tl.constexpr,
    BIAS_DOT: tl.constexpr, FIXED: tl.constexpr, SPLIT: tl.constexpr,
    SCAN: tl.constexpr, SPREAD: tl.constexpr, PERM: tl.constexpr, PRE: tl.constexpr, L2_PREFETCH: tl.constexpr,
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

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    chan_k = channels(offs_d, K_BITS, PERM)      # the channel of each column of q and the key tiles
    chan_v = channels(offs_d, V_BITS, PERM)      # ... of the value tiles, acc and the output
    offs_b = tl.arange(0, BLOCK_N)
    SUBS: tl.constexpr = PAGE_SIZE // BLOCK_N                                     # steps per page
    head = kv_head * GROUP + offs_m
    row_mask = offs_m < GROUP
    q_rows = q_ptr + q_row * stride_qt + head * stride_qh                          # [M] pointers
    q_sel_rows = q_ptr + q_row * stride_qt + (kv_head * GROUP + tl.minimum(offs_m, GROUP - 1)) * stride_qh
    q32 = tl.load(q_rows[:, None] + chan_k[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32) * qk_scale
    q_max = tl.max(tl.abs(q32), axis=1)
    q_max = tl.where(q_max > 0, q_max, 1.0)                                        # [M]
    q_p2 = tl.exp2(tl.ceil(tl.log2(q_max / qk_scale)))                             # power of two >= |raw q|
    q_inv_p2 = 1.0 / q_p2
    q_p2_scale = q_p2 * qk_scale
    HALF: tl.constexpr = CODES != 0
    if HALF:
        low_dtype = tl.float16
    else:
        low_dtype = tl.float32
    qn = q32 / q_max[:, None]                                                      # |qn| <= 1
    qn_op = qn.to(low_dtype)
    if HALF:
        qn_lo = (qn - qn_op.to(tl.float32)).to(tl.float16)                         # qn = qn_op + qn_lo (22 bits)
    q_sum = tl.sum(qn, axis=1)                                                     # sum(q) / |q|max

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt

    # ---- low-bit pages (staged pages computed too, then masked out) ----
    # every load of a block is issued at its top, before any math (page ids one block ahead; with
    # PREFETCH the code words too, a register double buffer): per block one memory latency, not one per
    # dependent step (scales after the key outliers, each outlier pass after the previous one)
    end = last * SUBS
    next_page = tl.load(table + tl.minimum(first, tl.maximum(last - 1, 0))).to(tl.int64)
    if PREFETCH:
        next_rows = tl.minimum(first * SUBS, tl.maximum(end - 1, 0)) % SUBS * BLOCK_N + offs_b
        k_lo, k_hi = load_words(k_codes, next_page * NUM_KV_HEADS + kv_head, next_rows, K_BITS, K_WORDS, PAGE_SIZE,
                                HEAD_DIM, SPREAD)
        v_lo, v_hi = load_words(v_codes, next_page * NUM_KV_HEADS + kv_head, next_rows, V_BITS, V_WORDS, PAGE_SIZE,
                                HEAD_DIM, SPREAD)
    for block in range(first * SUBS, end):
        page_index = block // SUBS
        row0 = (block % SUBS) * BLOCK_N
        offs_n = row0 + offs_b                                                     # [N] rows in the page
        page = next_page
        following = tl.minimum(block + 1, end - 1)
        next_page = tl.load(table + following // SUBS).to(tl.int64)
        page_head = page * NUM_KV_HEADS + kv_head
        if PREFETCH:
            k_lo_cur, k_hi_cur, v_lo_cur, v_hi_cur = k_lo, k_hi, v_lo, v_hi
            next_rows = following % SUBS * BLOCK_N + offs_b
            k_lo, k_hi = load_words(k_codes, next_page * NUM_KV_HEADS + kv_head, next_rows, K_BITS, K_WORDS,
                                    PAGE_SIZE, HEAD_DIM, SPREAD)
            v_lo, v_hi = load_words(v_codes, next_page * NUM_KV_HEADS + kv_head, next_rows, V_BITS, V_WORDS,
                                    PAGE_SIZE, HEAD_DIM, SPREAD)
        else:
            k_lo_cur, k_hi_cur = load_words(k_codes, page_head, offs_n, K_BITS, K_WORDS, PAGE_SIZE, HEAD_DIM, SPREAD)
            v_lo_cur, v_hi_cur = load_words(v_codes, page_head, offs_n, V_BITS, V_WORDS, PAGE_SIZE, HEAD_DIM, SPREAD)
        lowbit = tl.load(slot_of_page + page) < 0
        if K_CHANNEL:
            k_s = tl.load(k_scale + page_head * HEAD_DIM + chan_k).to(tl.float32)
            k_z = tl.load(k_zero + page_head * HEAD_DIM + chan_k)                 # fp16
        else:
            k_b = tl.load(k_base + page_head).to(tl.float32)
            k_rel, k_zt = token_scale_zero(k_scale, k_zero, k_b, page_head * PAGE_SIZE + offs_n, K_BITS)
        v_b = tl.load(v_base + page_head).to(tl.float32)
        v_rel, v_zt = token_scale_zero(v_scale, v_zero, v_b, page_head * PAGE_SIZE + offs_n, V_BITS)
        # the first PRE * BLOCK_C outlier slots of each side, loaded now (used only up to the count)
        if K_CAP > 0:
            k_count = tl.where(lowbit, tl.minimum(tl.load(k_ocount + page_head).to(tl.int32), K_CAP), 0)
            if PRE >= 1:
                k_i0, k_r0, k_l0 = outlier_slots(k_oidx, k_ovals, page_head, 0, k_count, K_CAP, BLOCK_C)
            if PRE >= 2:
                k_i1, k_r1, k_l1 = outlier_slots(k_oidx, k_ovals, page_head, BLOCK_C, k_count, K_CAP, BLOCK_C)
            if PRE >= 3:
                k_i2, k_r2, k_l2 = outlier_slots(k_oidx, k_ovals, page_head, 2 * BLOCK_C, k_count, K_CAP, BLOCK_C)
            if PRE >= 4:
                k_i3, k_r3, k_l3 = outlier_slots(k_oidx, k_ovals, page_head, 3 * BLOCK_C, k_count, K_CAP, BLOCK_C)
        if V_CAP > 0:
            v_count = tl.where(lowbit, tl.minimum(tl.load(v_ocount + page_head).to(tl.int32), V_CAP), 0)
            if PRE >= 1:
                v_i0, v_r0, v_l0 = outlier_slots(v_oidx, v_ovals, page_head, 0, v_count, V_CAP, BLOCK_C)
            if PRE >= 2:
                v_i1, v_r1, v_l1 = outlier_slots(v_oidx, v_ovals, page_head, BLOCK_C, v_count, V_CAP, BLOCK_C)
            if PRE >= 3:
                v_i2, v_r2, v_l2 = outlier_slots(v_oidx, v_ovals, page_head, 2 * BLOCK_C, v_count, V_CAP, BLOCK_C)
            if PRE >= 4:
                v_i3, v_r3, v_l3 = outlier_slots(v_oidx, v_ovals, page_head, 3 * BLOCK_C, v_count, V_CAP, BLOCK_C)
        valid = lowbit & (page_index * PAGE_SIZE + offs_n < context_len)           # [N]
        # keys -> scores [M, N]
        k_op = unpack(k_lo_cur, k_hi_cur, K_BITS, CODES, PERM, SPREAD)
        if K_CHANNEL:
            s_max = tl.max(k_s, axis=0)
            s_max = tl.where(s_max > 0, s_max, 1.0)
            qs_op = (qn * (k_s / s_max)[None, :]).to(low_dtype)
            if HALF and BIAS_DOT:
                # q . Z by the tensor cores (a row sum across lanes costs ~5 shuffles per row): Z is exact
                # in fp16, qn = hi + lo; every column of the [M, 16] result holds the row's q . Z / |q|max
                z_op = tl.broadcast_to(k_z[:, None], (HEAD_DIM, 16))
                bias = tl.max(tl.dot(qn_op, z_op) + tl.dot(qn_lo, z_op), axis=1)
            else:
                bias = tl.sum(qn * k_z.to(tl.float32)[None, :], axis=1)
            s = (tl.dot(qs_op, tl.trans(k_op), input_precision="ieee") * (s_max * CODE_SCALE)
                 + bias[:, None]) * q_max[:, None]
        else:
            s = (tl.dot(qn_op, tl.trans(k_op), input_precision="ieee") * ((k_b * CODE_SCALE) * k_rel)[None, :]
                 + q_sum[:, None] * k_zt[None, :]) * q_max[:, None]
        if L2_PREFETCH:                      # the next block's bytes into L2 (its page id has arrived by now)
            prefetch_block(next_page * NUM_KV_HEADS + kv_head, following % SUBS * BLOCK_N + offs_b, k_codes, k_scale,
                           k_zero, k_base, k_oidx, k_ovals, k_ocount, v_codes, v_scale, v_zero, v_base, v_oidx,
                           v_ovals, v_ocount, PAGE_SIZE, HEAD_DIM, K_CHANNEL, K_WORDS, K_CAP, V_WORDS, V_CAP,
                           PRE * BLOCK_C)
        if K_CAP > 0:
            s_out = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if PRE >= 1:
                s_out = key_chunk(s_out, k_count > 0, k_i0, k_r0, k_l0, offs_n, q_sel_rows, q_inv_p2, HEAD_DIM,
                                  OUTLIERS, HALF)
            if PRE >= 2:
                s_out = key_chunk(s_out, k_count > BLOCK_C, k_i1, k_r1, k_l1, offs_n, q_sel_rows, q_inv_p2, HEAD_DIM,
                                  OUTLIERS, HALF)
            if PRE >= 3:
                s_out = key_chunk(s_out, k_count > 2 * BLOCK_C, k_i2, k_r2, k_l2, offs_n, q_sel_rows, q_inv_p2,
                                  HEAD_DIM, OUTLIERS, HALF)
            if PRE >= 4:
                s_out = key_chunk(s_out, k_count > 3 * BLOCK_C, k_i3, k_r3, k_l3, offs_n, q_sel_rows, q_inv_p2,
                                  HEAD_DIM, OUTLIERS, HALF)
            for c0 in range(PRE * BLOCK_C, k_count, BLOCK_C):                      # the rest, BLOCK_C at a time
                idx, resid, live = outlier_slots(k_oidx, k_ovals, page_head, c0, k_count, K_CAP, BLOCK_C)
                s_out = key_outliers(s_out, idx, resid, live, offs_n, q_sel_rows, q_inv_p2, HEAD_DIM, OUTLIERS, HALF)
            if HALF and OUTLIERS == 1:
                s += s_out * q_p2_scale[:, None]
            else:
                s += s_out * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)                      # p [M, N] in [0, 1]
        # values (token axis, one group) -> [M, D]
        v_op = unpack(v_lo_cur, v_hi_cur, V_BITS, CODES, PERM, SPREAD)
        ps_op = (p * v_rel[None, :]).to(low_dtype)
        # computed transposed, V^T [D, N] @ (p S / base)^T [N, M]: the code tile is then the A operand,
        # which Triton loads with plain ldmatrix (as [M, N] @ [N, D] the probabilities come from the
        # score MMA's registers and Triton picks kWidth = 4 operands: ~150 register moves per page)
        pv = tl.trans(tl.dot(tl.trans(v_op), tl.trans(ps_op), input_precision="ieee")) * (v_b * CODE_SCALE) \
            + tl.sum(p * v_zt[None, :], axis=1)[:, None]
        if V_CAP > 0:
            if HALF:
                p_op = p.to(tl.float16)                     # what the outlier corrections see of p
            else:
                p_op = p
            if PRE >= 1:
                pv = value_chunk(pv, v_count > 0, p, p_op, v_i0, v_r0, v_l0, row0, offs_b, offs_d, HEAD_DIM, BLOCK_M,
                                 BLOCK_N, V_BITS, PERM, OUTLIERS, HALF, GATHER_P)
            if PRE >= 2:
                pv = value_chunk(pv, v_count > BLOCK_C, p, p_op, v_i1, v_r1, v_l1, row0, offs_b, offs_d, HEAD_DIM,
                                 BLOCK_M, BLOCK_N, V_BITS, PERM, OUTLIERS, HALF, GATHER_P)
            if PRE >= 3:
                pv = value_chunk(pv, v_count > 2 * BLOCK_C, p, p_op, v_i2, v_r2, v_l2, row0, offs_b, offs_d, HEAD_DIM,
                                 BLOCK_M, BLOCK_N, V_BITS, PERM, OUTLIERS, HALF, GATHER_P)
            if PRE >= 4:
                pv = value_chunk(pv, v_count > 3 * BLOCK_C, p, p_op, v_i3, v_r3, v_l3, row0, offs_b, offs_d, HEAD_DIM,
                                 BLOCK_M, BLOCK_N, V_BITS, PERM, OUTLIERS, HALF, GATHER_P)
            for c0 in range(PRE * BLOCK_C, v_count, BLOCK_C):
                idx, resid, live = outlier_slots(v_oidx, v_ovals, page_head, c0, v_count, V_CAP, BLOCK_C)
                pv = value_outliers(pv, p, p_op, idx, resid, live, row0, offs_b, offs_d, HEAD_DIM, BLOCK_M, BLOCK_N,
                                    V_BITS, PERM, OUTLIERS, HALF, GATHER_P)
        pv = tl.where(lowbit, pv, 0.0)                                              # staged: stale storage
        acc = acc * alpha[:, None] + pv

    # ---- staged pages of the split (fp rows), found a vector of table entries at a time ----
    if FP_HALF:
        q_op = q32.to(q_ptr.dtype.element_ty)
    else:
        q_op = q32
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
                    s = tl.dot(q_op.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(q_op, tl.trans(k.to(q_op.dtype)))
                s = tl.where(n_valid[None, :], s, float("-inf"))
                p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
                v = tl.load(staging_v + rows[:, None] + chan_v[None, :])
                if UPCAST:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(q_op.dtype), v.to(q_op.dtype))
                acc = acc * alpha[:, None] + pv

    # ---- the step's new token, full precision (split 0) ----
    if split == 0:
        k_new = tl.load(new_k_ptr + q_row * stride_kt + kv_head * stride_kh + chan_k).to(tl.float32)
        v_new = tl.load(new_v_ptr + q_row * stride_vt + kv_head * stride_vh + chan_v).to(tl.float32)
        s_new = tl.sum(q32 * k_new[None, :], axis=1)
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new[None, :]
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        tl.store(out_ptr + q_row * stride_ot + head[:, None] * stride_oh + split * stride_os
                 + chan_v[None, :], out, mask=row_mask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + q_row * stride_lt + head * stride_lh + split, lse, mask=row_mask)
    else:
        tl.store(out_ptr + q_row * stride_ot + head[:, None] * stride_oh + chan_v[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def paged_attention_lowbit_decode_tc(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pages,
                                     value_pages, key_spec, value_spec, staging_keys: torch.Tensor,
                                     staging_values: torch.Tensor, staging_slot_of_page: torch.Tensor, meta,
                                     scale: float, **launch_overrides) -> torch.Tensor:
    """Decode (one new token per sequence) attention over low-bit pages; query [B, Hq, D] -> [B, Hq, D].

    `meta.fixed_num_splits` (an int) switches to device-side split ranges: no host list is read and
    nothing syncs (CUDA-graph safe); otherwise the split count is planned on the host.
    launch_overrides (defaults in brackets; all give the same results within rounding):
      num_warps [4], num_stages [1] (no loop here is pipelined by Triton), maxnreg [None],
      BLOCK_N [128, capped to the page]: low-bit tokens per step (a divisor of the page size, >= 16),
      STAGE_N [32]: staged fp tokens per step, SCAN [32]: block-table entries scanned per step,
      BLOCK_C [16]: outlier slots per step (>= 16),
      (defaults: the fastest measured on the H200, the v5.1 run of 2026-11-30 in
      docs/attention-kernels.md, "Superseded result files": int3 B=32 L=16k 0.99 ms vs 1.26 ms with magic codes,
      no preload, no L2 prefetch)
      codes ["subnormal"] | "magic": fp16 codes as (code | 0x6400) - 1024, or the code's bits read as an
          fp16 subnormal (code * 2^-24; ~1 instruction per value less; needs tensor cores that keep
          fp16 subnormal inputs -- the tests check it),
      prefetch [False]: load the next block's code words one iteration ahead (register double buffer),
      spread [True], perm [True]: operand layouts (module docstring), off = the v5 layout,
      outlier_pre [3]: outlier slot chunks (BLOCK_C each, up to 4) loaded with the block's code words
          and corrected by preloaded passes (each run only if the count reaches it),
      l2_prefetch [True]: prefetch the next block's bytes into L2 (CUDA only; no-op in the interpreter),
      outliers ["dot"] | "elementwise", gather_p [False]: value outliers pick p by tl.gather (warp
          shuffles, p kept to 22 bits) instead of an exact 0/1 dot on fp16(p),
      bias_dot [True]: channel-axis keys' q . Z by two small MMAs instead of a cross-lane row sum,
      num_splits [None: planned] (host mode only), waves [2] (host planning).
    """
    cfg = {"num_warps": 4, "num_stages": 1, "maxnreg": None, "BLOCK_N": 128, "STAGE_N": 32, "SCAN": 32,
           "BLOCK_C": 16, "codes": "subnormal", "prefetch": False, "outliers": "dot", "gather_p": False,
           "bias_dot": True, "num_splits": None, "waves": 2, "spread": True, "perm": True, "outlier_pre": 3,
           "l2_prefetch": True}
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    page_size = key_spec.page_size
    if not supports(key_spec, value_spec, head_dim):
        raise NotImplementedError(f"lowbit decode_tc: unsupported format {key_spec} / {value_spec} at D={head_dim}")
    cfg = launch_config(cfg, launch_overrides)
    if cfg["outlier_pre"] not in (0, 1, 2, 3, 4):
        raise ValueError(f"outlier_pre must be 0..4 (chunks of BLOCK_C slots), not {cfg['outlier_pre']}")
    batch = decode_batch(meta, num_tokens, "paged_attention_lowbit_decode_tc")
    fixed = getattr(meta, "fixed_num_splits", None)
    out = torch.empty_like(query)
    if num_tokens == 0 or batch == 0:
        return out
    check_launchable(_decode_tc_kernel, query)
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
    assert staging_keys.is_contiguous() and staging_values.is_contiguous()
    half, upcast = dot_modes(query, staging_keys.dtype)
    codes = code_mode(query, cfg["codes"])
    num_splits, pages_per_split = decode_splits(meta, batch, num_kv_heads, page_size, query.device,
                                                cfg["num_splits"], cfg["waves"])
    partial, lse, target, strides = split_outputs(out, num_splits)
    _decode_tc_kernel[(batch, num_kv_heads, num_splits)](
        query, key, value, target, lse, *page_tensors(key_pages, "K"), *page_tensors(value_pages, "V"),
        staging_keys, staging_values, staging_slot_of_page,
        meta.block_tables, meta.query_start_loc, meta.context_lens,
        scale * LOG2E, pages_per_split, num_splits,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *strides, meta.block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        GROUP=num_heads // num_kv_heads, BLOCK_M=pow2(num_heads // num_kv_heads),
        BLOCK_N=min(cfg["BLOCK_N"], page_size), STAGE_N=min(cfg["STAGE_N"], page_size),
        K_CHANNEL=key_spec.axis == "channel", K_BITS=key_spec.bits, K_WORDS=key_spec.words_per_row,
        K_CAP=key_spec.outlier_capacity,
        V_BITS=value_spec.bits, V_WORDS=value_spec.words_per_row, V_CAP=value_spec.outlier_capacity,
        CODES=codes, CODE_SCALE=2.0 ** 24 if codes == CODES_SUBNORMAL else 1.0, FP_HALF=half, UPCAST=upcast,
        BLOCK_C=cfg["BLOCK_C"], OUTLIERS={"dot": OUTLIERS_DOT, "elementwise": OUTLIERS_ELEMENTWISE}[cfg["outliers"]],
        PREFETCH=bool(cfg["prefetch"]), GATHER_P=bool(cfg["gather_p"]), BIAS_DOT=bool(cfg["bias_dot"]),
        FIXED=fixed is not None, SPLIT=num_splits > 1, SCAN=cfg["SCAN"], SPREAD=bool(cfg["spread"]),
        PERM=bool(cfg["perm"]), PRE=cfg["outlier_pre"],
        L2_PREFETCH=bool(cfg["l2_prefetch"]) and type(_decode_tc_kernel).__name__ != "InterpretedFunction",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}))
    if num_splits > 1:
        combine_splits(partial, lse, out)
    return out

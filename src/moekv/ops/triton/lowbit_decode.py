"""Decode attention over the low-bit paged KV cache on CUDA cores (no tensor cores), field-major.

The Triton twin of ops.reference.lowbit.paged_attention_lowbit for decode steps (one new token per
sequence). Byte format: docs/kv-format.md. One program per (sequence, kv head, split of the context);
its rows are the GROUP query heads of the kv head (padded to a power of two GP, not to 16: nothing
here is a tl.dot). All arithmetic is fp32 whatever the query dtype (fp32 queries match the reference
to ~1e-6 relative).

Why CUDA cores: a decode step has GROUP (1..8) query rows per kv head, so a tensor-core dot is mostly
padding plus layout conversions of the unpacked codes (the old kernel: 255 registers, spills, the
unpacked tile crossing shared memory). Here the unpacked codes never change layout.

Field-major unpack, no reshape. A k-bit plane has F = 32 / k fields per word; field f of word w is
channel w * F + f, so `code_f` = field f of a word tile [rows, words] holds channels {w * F + f}.
int3 is read as one 16-field tile: the 2-bit word w plus, for each of its 16 channels, the high bit
taken from 1-bit word w // 2 shifted right by (w % 2) * 16 (code = lo + 4 * hi, merged with two
LOP3s). Codes become floats without a shift or convert: `(word & (mask << sh)) | 0x4B000000` read as
fp32 is 2^23 + code * 2^sh (exact while sh + 3 <= 23; fields whose bits sit in the upper half use
`word >> 16`, computed once per word), minus 2^23 (exact); the 2^-sh factor is folded into q'
(keys) or applied to the finished per-field sums (values). About 2 instructions per code (4 for
int3) plus the GROUP FMAs. CODE_CVT=True: shift, mask and int->fp32 convert instead (comparison).

Per-program scratch in global memory (L1-resident, GP * (D + P) floats, one buffer): Triton has no
explicit shared memory, and register tiles cannot be sliced by field, so per page
  q' = q * scale * log2(e) * S_key * 2^-sh is stored field-major (qs[(f * WP + w) * GP + g]), and
  p' = p * S_value (the softmax weights with the per-token value scale folded in) token-major
  (ps[n * GP + g]); a barrier after each store. Each thread then reads exactly the GP values of
  the (field, word) or row it works on, instead of reloading and rescaling q per field.

Keys, channel axis: score[g, n] = sum_d q'[g, d] code[n, d] * 2^sh + q . Z. The words of a row are
read as K_WT tiles [N, WL] (word = wl * K_WT + t), so a thread holds K_WT words of its rows and, per
(t, field), `acc[g, n, wl] += q'_f[g, wl] * code_f[n, wl]` is one FMA per (code, query row); one
reduction over wl (lanes) per page. Token-axis keys (one group): q' = q once, then
score = S_n * (q . code_n) + Z_n * sum(q).

Values, token axis (one group): sum_t p_t (S_t code_t + Z_t) = sum_t p'_t code_t + sum_t p_t Z_t.
Rows in blocks of V_NL (lanes x warps), one word per thread: per block and field,
`acc4[g, f, nl, w] += p'[row, g] * code_f[row, w]`, again one FMA per (code, query row), into a
per-thread accumulator (GP x F registers; the static field index selects the register, no
reduction). The reduction over nl happens once, after the page loop; then [GP, F, WP] is permuted to
[GP, WP, F] = [GP, D] (channel w * F + f) and merged with the natural-layout accumulator that holds
the zero-point sum, the outliers, the staging pages and the new token.

Outliers (sorted by t * D + d; up to the page-head's count, BLOCK_C slots at a time, no tl.dot):
keys: v[g, c] = q[g, d_c] * r_c (q re-read from L1), score[g, n] += sum_c [t_c == n] v[g, c];
values: p_c = p[g, t_c] (tl.gather or a compare-and-sum), out[g, d] += sum_c [d_c == d] p_c r_c.

Staging pages (staging_slot_of_page[page] >= 0) stay out of the low-bit loop: the main loop masks
their scores to -inf (no branch; their low-bit storage is stale but finite) and skips their
outliers; a second loop finds the staged pages of the split with a vector scan of the slot table
(SCAN pages at a time) and attends their rows in full precision, BLOCK_S rows at a time. The step's
new token (passed in full precision, not yet cached) is attended by split 0.

Split-K: partial outputs + base-2 log-sum-exp, combined by split_k.combine_splits. With
`meta.fixed_num_splits` (an int) the split count is fixed and each sequence's page range is computed
on the device from its context length (pages_per_split = cdiv(cdiv(len, P), splits)), so the
wrapper reads no host list and never syncs (CUDA-graph capturable). Otherwise split_k.plan_splits
plans on the host from the host lengths.

Layout steering: Triton picks register layouts itself; the word tiles are loaded with their word
offsets multiplied by a runtime 1 (`one`, not specialised) so the coalescer does not vectorise them
along the row (which would give each thread 4 words and a different layout from the compute tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.common import LOG2E, check_launchable
from moekv.ops.triton.split_k import combine_splits, plan_splits

MAGIC = tl.constexpr(0x4B000000)          # fp32 bits of 2^23
MAGIC_F = tl.constexpr(8388608.0)         # 2^23


@triton.jit
def _field(words, words_hi, hi8, f: tl.constexpr, BITS: tl.constexpr, CODE_CVT: tl.constexpr):
    """Field f of every element of a word tile as fp32: (code * 2^sh, 2^-sh).

    int4 / int2: words = the plane's words, F = 32 / BITS fields. int3: words = 2-bit plane words
    (16 fields), hi8 = for each 2-bit word w the 16 high bits of its channels (1-bit word w // 2
    shifted right by (w % 2) * 16): field f is channel w * 16 + f in both, code = lo + 4 * hi.
    words_hi = words >> 16 (fields whose bits sit in the upper half). CODE_CVT: shift, mask, convert."""
    WIDTH: tl.constexpr = 2 if BITS == 3 else BITS
    MASK: tl.constexpr = (1 << WIDTH) - 1
    s: tl.constexpr = f * WIDTH
    if CODE_CVT:
        code = ((words >> s) & MASK)
        if BITS == 3:
            code = code | (((hi8 >> f) & 1) << 2)
        code = code.to(tl.float32)
        inv = 1.0
    else:
        if s + WIDTH <= 16:
            src = words
            sh: tl.constexpr = s
        else:
            src = words_hi
            sh: tl.constexpr = s - 16
        bits = src & (MASK << sh)
        if BITS == 3:                                   # the high bit (channel bit f of hi8) to bit sh + 2
            if sh + 2 >= f:
                hi = hi8 << (sh + 2 - f)
            else:
                hi = hi8 >> (f - sh - 2)
            bits = bits | (hi & (4 << sh))
        code = (bits | MAGIC).to(tl.float32, bitcast=True) - MAGIC_F
        inv = 1.0 / (1 << sh)
    return code, inv


@triton.jit
def _shift_of(f, BITS: tl.constexpr):
    """Bit offset sh of field f (a tensor) as the fast unpack reads it: code * 2^sh (see _field)."""
    WIDTH: tl.constexpr = 2 if BITS == 3 else BITS
    s = f * WIDTH
    return tl.where(s + WIDTH <= 16, s, s - 16)


@triton.jit
def _keys(page_ptr, offs_n, one, qs_ptr, BITS: tl.constexpr, WORDS: tl.constexpr, WT: tl.constexpr,
          WL: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
          CODE_CVT: tl.constexpr):
    """sum_d q'[g, d] code[n, d] over a page: [GP, BLOCK_N] fp32, q' = the page's folded query.

    Word w = wl * WT + t of every row: WT [N, WL] tiles (t static), so a thread holds WT words of its
    rows and every product lands in one accumulator acc[g, n, wl] by a plain FMA; one reduction over
    wl per page. qs_ptr: q' stored field-major, qs[(f * WP + w) * GP + g] (so one thread's GP values
    of a (field, word) are one vector load)."""
    F: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    WP: tl.constexpr = HEAD_DIM // F
    offs_l = tl.arange(0, WL)
    offs_g = tl.arange(0, GP)
    acc = tl.zeros([GP, BLOCK_N, WL], tl.float32)
    for t in tl.static_range(WT):
        word = offs_l * WT + t                                                         # [WL]
        words = tl.load(page_ptr + offs_n[:, None] * WORDS + word[None, :] * one)      # [N, WL]
        words_hi = words >> 16
        if BITS == 3:
            hi8 = tl.load(page_ptr + offs_n[:, None] * WORDS + (HEAD_DIM // 16 + word // 2)[None, :] * one) \
                >> ((word % 2) * 16)[None, :]
        else:
            hi8 = words
        for f in tl.static_range(F):
            code, inv = _field(words, words_hi, hi8, f, BITS, CODE_CVT)                # [N, WL]
            q_f = tl.load(qs_ptr + (f * WP + word)[None, :] * GP + offs_g[:, None])    # [GP, WL]
            acc += q_f[:, None, :] * code[None, :, :]
    return tl.sum(acc, axis=2)


@triton.jit
def _values(page_ptr, one, zero, ps_ptr, acc4, BITS: tl.constexpr, WORDS: tl.constexpr, NL: tl.constexpr,
            GP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CODE_CVT: tl.constexpr):
    """acc4[g, f, nl, w] += sum_j p'[j * NL + nl, g] * code[j * NL + nl, w * F + f] * 2^sh(f).

    Rows in blocks of NL (j static): a [NL, WP] word tile, one word per thread, and the block's
    p' [NL, GP] (ps_ptr: p' stored token-major, one vector load); every product is a plain FMA into
    the per-thread accumulator; the reduction over nl is deferred to the end of the kernel."""
    F: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    WP: tl.constexpr = HEAD_DIM // F
    offs_f = tl.arange(0, F)
    offs_l = tl.arange(0, NL)
    offs_w = tl.arange(0, WP)
    offs_g = tl.arange(0, GP)
    for j in tl.static_range(BLOCK_N // NL):
        rows = j * NL + offs_l                                                         # [NL]
        words = tl.load(page_ptr + rows[:, None] * WORDS + offs_w[None, :] * one)      # [NL, WP]
        words_hi = words >> 16
        if BITS == 3:
            hi8 = tl.load(page_ptr + rows[:, None] * WORDS + (HEAD_DIM // 16 + offs_w // 2)[None, :] * one) \
                >> ((offs_w % 2) * 16)[None, :]
        else:
            hi8 = words
        for g in tl.static_range(GP):
            # p'[row, g] for every word of the row: the words' own layout, no conversion
            p_jg = tl.load(ps_ptr + rows[:, None] * GP + g + offs_w[None, :] * zero)   # [NL, WP]
            for f in tl.static_range(F):
                code, inv = _field(words, words_hi, hi8, f, BITS, CODE_CVT)            # [NL, WP]
                acc4 = tl.where((offs_g[:, None, None, None] == g) & (offs_f[None, :, None, None] == f),
                                acc4 + (p_jg * code)[None, None, :, :], acc4)
    return acc4


@triton.jit
def _token_scale_zero(scale_ptr, zero_ptr, base, BITS: tl.constexpr):
    """Token-axis scale/zero codes (uint8 pointers, one group) -> (S, Z) fp32 (docs/kv-format.md section 3)."""
    scale = base * tl.exp2(-tl.load(scale_ptr).to(tl.float32) * (1.0 / 16.0))
    zero = -(scale * tl.load(zero_ptr).to(tl.float32)) * (1.0 / (1 << (8 - BITS)))
    return scale, zero


@triton.jit
def _online(s, m_i, l_i):
    """Scores [GP, N] (base 2, -inf = masked) -> (p, alpha, m, l); safe when a whole block is masked."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit(do_not_specialize=["one"])
def _lowbit_decode_kernel(
    q_ptr, new_k_ptr, new_v_ptr, out_ptr, lse_ptr, scratch_ptr,
    k_codes, k_scale, k_zero, k_base, k_outlier_vals, k_outlier_idx, k_outlier_count,
    v_codes, v_scale, v_zero, v_base, v_outlier_vals, v_outlier_idx, v_outlier_count,
    staging_k, staging_v, slot_of_page, block_tables, context_lens,
    qk_scale, pages_per_split_host, one,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, GP: tl.constexpr, NUM_SPLITS: tl.constexpr, DEVICE_SPLITS: tl.constexpr,
    K_TOKEN: tl.constexpr, K_BITS: tl.constexpr, K_WORDS: tl.constexpr, K_CAP: tl.constexpr,
    V_BITS: tl.constexpr, V_WORDS: tl.constexpr, V_CAP: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, SCAN: tl.constexpr, CODE_CVT: tl.constexpr,
    GATHER_P: tl.constexpr, K_WT: tl.constexpr, V_NL: tl.constexpr, SKIP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens + seq)
    num_pages = tl.cdiv(context_len, PAGE_SIZE)
    if DEVICE_SPLITS:
        pages_per_split = tl.cdiv(num_pages, NUM_SPLITS)
    else:
        pages_per_split = pages_per_split_host
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, num_pages)

    offs_g = tl.arange(0, GP)
    offs_n = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, BLOCK_C)
    g_mask = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    q_rows = q_ptr + seq.to(tl.int64) * stride_qt + head * stride_qh                   # [GP] pointers
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32) * qk_scale
    q_sum = tl.sum(q, axis=1)                                                          # [GP]

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc_z = tl.zeros([GP], tl.float32)                                                 # sum_t p_t Z_t
    acc_o = tl.zeros([GP, HEAD_DIM], tl.float32)                                       # value outliers
    # tiles: 16 fields per word for int3 (2-bit plane + matching high bits), else 32 // bits
    K_F: tl.constexpr = 16 if K_BITS == 3 else 32 // K_BITS
    K_WP: tl.constexpr = HEAD_DIM // K_F
    K_WL: tl.constexpr = K_WP // K_WT
    V_F: tl.constexpr = 16 if V_BITS == 3 else 32 // V_BITS
    V_WP: tl.constexpr = HEAD_DIM // V_F
    acc4 = tl.zeros([GP, V_F, V_NL, V_WP], tl.float32)                                 # field-major values
    # this program's scratch (L1-resident): the page's q' (field-major) and p' (token-major)
    pid = (seq * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split
    qs_ptr = scratch_ptr + pid.to(tl.int64) * (GP * HEAD_DIM + GP * PAGE_SIZE)
    ps_ptr = qs_ptr + GP * HEAD_DIM
    # q' = q * S * 2^-sh written field-major: channel d = w * F + f goes to (f * WP + w) * GP + g
    k_field = offs_d % K_F
    qs_offs = (k_field * K_WP + offs_d // K_F)[None, :] * GP + offs_g[:, None]        # [GP, D]
    q_inv = tl.exp2(-_shift_of(k_field, K_BITS).to(tl.float32))                        # [D]
    if CODE_CVT:
        q_inv = q_inv * 0.0 + 1.0
    q_fold = q * q_inv[None, :]
    v_inv = tl.exp2(-_shift_of(tl.arange(0, V_F), V_BITS).to(tl.float32))               # [V_F]
    if CODE_CVT:
        v_inv = v_inv * 0.0 + 1.0

    table = block_tables + seq.to(tl.int64) * stride_bt
    # ---- main loop: low-bit pages (staged pages masked out, handled below) ----
    for page_index in range(first, last):
        page = tl.load(table + page_index).to(tl.int64)
        slot = tl.load(slot_of_page + page)
        lowbit = slot < 0
        n_valid = (page_index * PAGE_SIZE + offs_n < context_len) & lowbit              # [N]
        page_head = page * NUM_KV_HEADS + kv_head
        # keys -> scores [GP, N]
        k_page = k_codes + page_head * (PAGE_SIZE * K_WORDS)
        # (one buffer suffices: q' is rewritten after the previous page's p' barrier, p' after this q' barrier)
        if K_TOKEN:
            if page_index == first:                                                    # q' is the same for all pages
                tl.store(qs_ptr + qs_offs, q_fold)
        else:
            k_scale_ch = tl.load(k_scale + page_head * HEAD_DIM + offs_d).to(tl.float32)
            tl.store(qs_ptr + qs_offs, q_fold * k_scale_ch[None, :])
        tl.debug_barrier()
        if SKIP & 1:                                                                   # diagnostic only
            s = tl.zeros([GP, PAGE_SIZE], tl.float32)
        else:
            s = _keys(k_page, offs_n, one, qs_ptr, K_BITS, K_WORDS, K_WT, K_WL, GP, PAGE_SIZE, HEAD_DIM,
                      CODE_CVT)
        if K_TOKEN:
            k_s, k_z = _token_scale_zero(k_scale + page_head * PAGE_SIZE + offs_n,
                                         k_zero + page_head * PAGE_SIZE + offs_n,
                                         tl.load(k_base + page_head).to(tl.float32), K_BITS)
            s = s * k_s[None, :] + q_sum[:, None] * k_z[None, :]
        else:
            k_z = tl.load(k_zero + page_head * HEAD_DIM + offs_d).to(tl.float32)
            s += tl.sum(q * k_z[None, :], axis=1)[:, None]
        if K_CAP > 0:
            k_count = tl.where(lowbit, tl.load(k_outlier_count + page_head).to(tl.int32), 0)
            for c0 in range(0, k_count, BLOCK_C):
                cc = c0 + offs_c
                c_mask = cc < k_count
                idx = tl.load(k_outlier_idx + page_head * K_CAP + cc, mask=c_mask, other=0).to(tl.int32) & 0xFFFF
                resid = tl.load(k_outlier_vals + page_head * K_CAP + cc, mask=c_mask, other=0.0).to(tl.float32)
                token = idx // HEAD_DIM
                q_sel = tl.load(q_rows[:, None] + (idx % HEAD_DIM)[None, :], mask=g_mask[:, None],
                                other=0.0).to(tl.float32)                              # [GP, C]
                v_c = q_sel * (resid * qk_scale)[None, :]
                hit = token[:, None] == offs_n[None, :]                                # [C, N]
                s += tl.sum(tl.where(hit[None, :, :], v_c[:, :, None], 0.0), axis=1)
        s = tl.where(n_valid[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = _online(s, m_i, l_i)                                      # p [GP, N]
        # values: token axis, one group
        v_s, v_z = _token_scale_zero(v_scale + page_head * PAGE_SIZE + offs_n, v_zero + page_head * PAGE_SIZE + offs_n,
                                     tl.load(v_base + page_head).to(tl.float32), V_BITS)
        tl.store(ps_ptr + offs_n[None, :] * GP + offs_g[:, None], p * v_s[None, :])
        tl.debug_barrier()
        acc_z = acc_z * alpha + tl.sum(p * v_z[None, :], axis=1)
        v_page = v_codes + page_head * (PAGE_SIZE * V_WORDS)
        if SKIP & 2:                                                                   # diagnostic only
            acc4 = acc4 * alpha[:, None, None, None]
        else:
            acc4 = _values(v_page, one, one - 1, ps_ptr, acc4 * alpha[:, None, None, None], V_BITS, V_WORDS, V_NL, GP,
                           PAGE_SIZE, HEAD_DIM, CODE_CVT)
        acc_o = acc_o * alpha[:, None]
        if V_CAP > 0:
            v_count = tl.where(lowbit, tl.load(v_outlier_count + page_head).to(tl.int32), 0)
            for c0 in range(0, v_count, BLOCK_C):
                cc = c0 + offs_c
                c_mask = cc < v_count
                idx = tl.load(v_outlier_idx + page_head * V_CAP + cc, mask=c_mask, other=0).to(tl.int32) & 0xFFFF
                resid = tl.load(v_outlier_vals + page_head * V_CAP + cc, mask=c_mask, other=0.0).to(tl.float32)
                token = idx // HEAD_DIM
                if GATHER_P:
                    p_sel = tl.gather(p, tl.broadcast_to(token[None, :], (GP, BLOCK_C)), axis=1)   # [GP, C]
                else:
                    hit_t = token[:, None] == offs_n[None, :]                          # [C, N]
                    p_sel = tl.sum(tl.where(hit_t[None, :, :], p[:, None, :], 0.0), axis=2)
                w_c = p_sel * resid[None, :]                                           # [GP, C]
                hit_d = (idx % HEAD_DIM)[:, None] == offs_d[None, :]                   # [C, D]
                acc_o += tl.sum(tl.where(hit_d[None, :, :], w_c[:, :, None], 0.0), axis=1)

    # merge the field-major accumulator into the natural layout, once
    acc_v = tl.sum(acc4, axis=2) * v_inv[None, :, None]                                # [GP, F, WP]
    acc = acc_o + tl.reshape(tl.permute(acc_v, (0, 2, 1)), [GP, HEAD_DIM]) + acc_z[:, None]

    # ---- staged pages of this split (full-precision rows) ----
    offs_scan = tl.arange(0, SCAN)
    offs_s = tl.arange(0, BLOCK_S)
    for c0 in range(first, last, SCAN):
        in_range = c0 + offs_scan < last
        pages = tl.load(table + c0 + offs_scan, mask=in_range, other=0)
        slots = tl.load(slot_of_page + pages, mask=in_range, other=-1)
        staged = slots >= 0
        prev = -1
        for _ in range(tl.sum(staged.to(tl.int32), axis=0)):
            j = tl.min(tl.where(staged & (offs_scan > prev), offs_scan, SCAN), axis=0)
            prev = j
            slot = tl.sum(tl.where(offs_scan == j, slots, 0), axis=0).to(tl.int64)
            base_row = (c0 + j) * PAGE_SIZE
            for r0 in range(0, PAGE_SIZE, BLOCK_S):
                rows = r0 + offs_s
                r_valid = base_row + rows < context_len
                ptrs = ((slot * PAGE_SIZE + rows) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM)[:, None] \
                    + offs_d[None, :]
                k = tl.load(staging_k + ptrs, mask=r_valid[:, None], other=0.0).to(tl.float32)   # [S, D]
                s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                    # [GP, S]
                s = tl.where(r_valid[None, :], s, float("-inf"))
                p, alpha, m_i, l_i = _online(s, m_i, l_i)
                v = tl.load(staging_v + ptrs, mask=r_valid[:, None], other=0.0).to(tl.float32)
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)

    # ---- the step's new token, full precision (split 0) ----
    if split == 0:
        k_new = tl.load(new_k_ptr + seq.to(tl.int64) * stride_kt + kv_head * stride_kh + offs_d).to(tl.float32)
        v_new = tl.load(new_v_ptr + seq.to(tl.int64) * stride_vt + kv_head * stride_vh + offs_d).to(tl.float32)
        s_new = tl.sum(q * k_new[None, :], axis=1)                                     # [GP]
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        m_i = m_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new[None, :]

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_rows = seq.to(tl.int64)
    if NUM_SPLITS > 1:
        tl.store(out_ptr + out_rows * stride_ot + head[:, None] * stride_oh + split * stride_os + offs_d[None, :],
                 out, mask=g_mask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + out_rows * stride_lt + head * stride_lh + split, lse, mask=g_mask)
    else:
        tl.store(out_ptr + out_rows * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def supports(key_spec, value_spec, head_dim: int) -> bool:
    """Whether this kernel handles the formats (else the caller falls back to the general kernel)."""
    page_size = key_spec.page_size
    return (page_size == value_spec.page_size and page_size >= 16 and page_size & (page_size - 1) == 0
            and page_size * head_dim <= 65536
            and key_spec.head_dim == value_spec.head_dim == head_dim and head_dim in (64, 128)
            and key_spec.bits in (2, 3, 4) and value_spec.bits in (2, 3, 4)
            and value_spec.axis == "token" and value_spec.num_groups == 1
            and (key_spec.axis == "channel" or key_spec.num_groups == 1))


def _fields(bits: int) -> int:
    return 16 if bits == 3 else 32 // bits


def _tile_shapes(key_spec, value_spec, head_dim: int, cfg: dict) -> tuple[int, int]:
    """(K_WT: key words per thread, V_NL: value token positions across lanes and warps)."""
    key_words = head_dim // _fields(key_spec.bits)
    k_wt = min(cfg["K_WT"] or 4, key_words)
    value_words = head_dim // _fields(value_spec.bits)
    v_nl = cfg["V_NL"] or max(1, 32 // value_words) * cfg["num_warps"]
    return k_wt, min(v_nl, value_spec.page_size)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def paged_attention_lowbit_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pages,
                                  value_pages, key_spec, value_spec, staging_keys: torch.Tensor,
                                  staging_values: torch.Tensor, staging_slot_of_page: torch.Tensor, meta,
                                  scale: float, **launch_overrides) -> torch.Tensor:
    """Decode-only twin of ops.reference.lowbit.paged_attention_lowbit: query [B, Hq, D] (one new token per
    sequence) -> [B, Hq, D] in query's dtype.

    Launch overrides: num_warps (4), num_stages (1), maxnreg (None: ptxas register cap, e.g. 128),
    BLOCK_C (16: outlier slots per step), BLOCK_S (8: staging rows per step), SCAN (64: pages per
    slot-table scan), code_cvt (False: magic-number unpack; True: shift, mask and int->fp32 convert),
    gather_p (True: value outliers pick p by tl.gather, else a compare-and-sum), num_splits (host-planned
    mode only: force a split count), waves (2: split planning),
    K_WT (key words per thread, default min(4, words)), V_NL (value rows across threads, default
    32 // words * num_warps); diagnostics with wrong output: skip="keys" | "values" | "both".
    `meta.fixed_num_splits` (int) selects the capture-safe mode (no host lists, no sync).
    """
    cfg = {"num_warps": 4, "num_stages": 1, "maxnreg": None, "BLOCK_C": 16, "BLOCK_S": 8, "SCAN": 64,
           "code_cvt": False, "gather_p": True, "num_splits": None, "waves": 2,
           "K_WT": None, "V_NL": None, "skip": None}
    unknown = set(launch_overrides) - set(cfg)
    if unknown:
        raise TypeError(f"unknown launch overrides {sorted(unknown)}")
    cfg.update(launch_overrides)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    page_size = key_spec.page_size
    if not supports(key_spec, value_spec, head_dim):
        raise NotImplementedError(f"lowbit decode kernel: unsupported format (keys {key_spec}, values {value_spec}, "
                                  f"head_dim {head_dim})")
    fixed = getattr(meta, "fixed_num_splits", None)
    batch = meta.context_lens.shape[0]
    if fixed is not None:
        if num_tokens != batch:
            raise ValueError("lowbit decode kernel: one query token per sequence expected")
    elif not meta.is_decode:
        raise ValueError("lowbit decode kernel: query lengths other than 1 (use the prefill kernel)")
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    check_launchable(_lowbit_decode_kernel, query)
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
    assert staging_keys.is_contiguous() and staging_values.is_contiguous()
    for pages in (key_pages, value_pages):
        for name, tensor in pages.tensors().items():
            assert tensor.is_contiguous(), f"{name} must be contiguous"
    group = num_heads // num_kv_heads
    if fixed is not None:
        num_splits, pages_per_split, device_splits = int(fixed), 0, True
    else:
        max_context = max(meta.context_lens_host, default=0)
        if cfg["num_splits"] is None:
            num_splits, tokens_per_split = plan_splits(batch, num_kv_heads, max_context, page_size, query.device,
                                                       waves=cfg["waves"])
        else:
            num_splits = cfg["num_splits"]
            tokens_per_split = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), page_size) * page_size
        pages_per_split, device_splits = tokens_per_split // page_size, False
    if num_splits > 1:
        partial = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32,
                              device=query.device)
        lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        target, out_strides = partial, (partial.stride(0), partial.stride(1), partial.stride(2),
                                        lse.stride(0), lse.stride(1))
    else:
        lse, target, out_strides = out, out, (out.stride(0), out.stride(1), 0, 0, 0)
    k_wt, v_nl = _tile_shapes(key_spec, value_spec, head_dim, cfg)
    gp = _pow2(group)
    scratch = torch.empty(batch * num_kv_heads * num_splits * gp * (head_dim + page_size), dtype=torch.float32,
                          device=query.device)
    k_base = key_pages.scale_base if key_pages.scale_base is not None else key_pages.scale
    _lowbit_decode_kernel[(batch, num_kv_heads, num_splits)](
        query, key, value, target, lse, scratch,
        key_pages.codes, key_pages.scale, key_pages.zero, k_base, key_pages.outlier_vals, key_pages.outlier_idx,
        key_pages.outlier_count,
        value_pages.codes, value_pages.scale, value_pages.zero, value_pages.scale_base, value_pages.outlier_vals,
        value_pages.outlier_idx, value_pages.outlier_count,
        staging_keys, staging_values, staging_slot_of_page, meta.block_tables, meta.context_lens,
        scale * LOG2E, pages_per_split, 1,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *out_strides, meta.block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim, GROUP=group, GP=gp,
        NUM_SPLITS=num_splits, DEVICE_SPLITS=device_splits,
        K_TOKEN=key_spec.axis == "token", K_BITS=key_spec.bits, K_WORDS=key_spec.words_per_row,
        K_CAP=key_spec.outlier_capacity,
        V_BITS=value_spec.bits, V_WORDS=value_spec.words_per_row, V_CAP=value_spec.outlier_capacity,
        BLOCK_C=cfg["BLOCK_C"], BLOCK_S=min(cfg["BLOCK_S"], page_size), SCAN=cfg["SCAN"],
        CODE_CVT=bool(cfg["code_cvt"]), GATHER_P=bool(cfg["gather_p"]), K_WT=k_wt, V_NL=v_nl,
        SKIP={None: 0, "keys": 1, "values": 2, "both": 3}[cfg["skip"]],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}))
    if num_splits > 1:
        combine_splits(partial, lse, out)
    return out

"""Pieces of the tensor-core low-bit decode kernel (lowbit_decode_tc.py): loading and unpacking a
block's code words into a dot operand, the channel order of that operand, per-token scales, and the
exact 0/1-dot outlier corrections. The module docstring of lowbit_decode_tc.py has the math."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _leaf(lo, hi, F: tl.constexpr, K: tl.constexpr, THREE: tl.constexpr, CODES: tl.constexpr):
    """Field F of every word of `lo` [N, W] (k = K bits, 32 / K fields per word) as a dot operand tile.

    Fields f and f + 16 / K (bits K*f and K*f + 16) are cut out of a word as one packed pair by a
    shift and a mask (shared by the two leaves after CSE); 16-bit modes then read each 16-bit half as
    fp16: CODES 1 (magic) ORs 0x6400 into both halves (fp16 1024 + code) and subtracts 1024, CODES 2
    (subnormal) reads the code itself as an fp16 subnormal (code * 2^-24, exact, no instruction: the
    2^24 comes back on the fp32 dot result). THREE (int3): `hi` holds the high bits pre-spread (bit
    g + 2 for field g < 8, bit g + 18 for field g + 8)."""
    HALF_F: tl.constexpr = 16 // K
    G: tl.constexpr = F % HALF_F
    MASK: tl.constexpr = (1 << K) - 1
    pair = (lo >> (K * G)) & (MASK | (MASK << 16))
    if THREE:
        pair = pair | ((hi >> G) & 0x00040004)
    if CODES == 1:
        pair = pair | 0x64006400
    if F >= HALF_F:
        pair = pair >> 16
    if CODES == 0:
        return pair & 0xFFFF
    elif CODES == 1:
        return pair.to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:
        return pair.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _fields(lo, hi, SHIFT: tl.constexpr, STEP: tl.constexpr, COUNT: tl.constexpr, K: tl.constexpr,
            THREE: tl.constexpr, CODES: tl.constexpr):
    """Fields SHIFT, SHIFT+STEP, ... (COUNT of them) of the words `lo` [N, W] as one tile [N, W*COUNT],
    field i of word w at column w*COUNT + i: interleave(even fields, odd fields), recursively (each
    join adds an axis held in registers; the reshape only renames registers)."""
    if COUNT == 1:
        return _leaf(lo, hi, SHIFT, K, THREE, CODES)
    else:
        even = _fields(lo, hi, SHIFT, STEP * 2, COUNT // 2, K, THREE, CODES)
        odd = _fields(lo, hi, SHIFT + STEP, STEP * 2, COUNT // 2, K, THREE, CODES)
        return tl.interleave(even, odd)


@triton.jit
def load_words(codes_ptr, page_head, offs_n, BITS: tl.constexpr, WORDS: tl.constexpr, PAGE_SIZE: tl.constexpr,
               HEAD_DIM: tl.constexpr, SPREAD: tl.constexpr):
    """Packed rows offs_n [N] of one page: int3 -> (2-bit plane [N, D/16], 1-bit plane [N, D/32]),
    else (words [N, D*BITS/32], the same tile again).

    int3 without SPREAD: the 2-bit plane as even / odd words interleaved, the 1-bit plane plainly (at 4
    warps and 128 rows every thread then holds a whole row, and the unpacked tile goes to shared memory
    one 16-bit store per value: Triton orders the shared copy by lanes, i.e. tokens fastest); SPREAD:
    both planes in a layout with two lanes per row, so the unpacked tile is stored 16 bytes at a time."""
    rows = codes_ptr + page_head * (PAGE_SIZE * WORDS) + offs_n * WORDS             # [N] pointers
    if BITS == 3:
        LO: tl.constexpr = HEAD_DIM // 16
        if SPREAD:
            # the 2-bit plane plainly: 16-byte vectors, two lanes per row (D = 128); the 1-bit plane's
            # offsets spelled (j // 2) * 2 + j % 2, contiguous in pairs only for the compiler's analysis:
            # 8-byte vectors, again two lanes per row -- the same rows-over-lanes layout as the 2-bit plane
            lo = tl.load(rows[:, None] + tl.arange(0, LO)[None, :])
            j = tl.arange(0, HEAD_DIM // 32)
            hi = tl.load(rows[:, None] + LO + ((j // 2) * 2 + j % 2)[None, :])
        else:
            even = tl.arange(0, LO // 2) * 2
            lo = tl.interleave(tl.load(rows[:, None] + even[None, :]), tl.load(rows[:, None] + 1 + even[None, :]))
            hi = tl.load(rows[:, None] + LO + tl.arange(0, HEAD_DIM // 32)[None, :])
        return lo, hi
    else:
        words = tl.load(rows[:, None] + tl.arange(0, HEAD_DIM * BITS // 32)[None, :])
        return words, words


@triton.jit
def channels(offs, BITS: tl.constexpr, PERM: tl.constexpr):
    """The channel held by operand column `offs`: itself, or with PERM the pair order of unpack
    (column w*F + 2g + h holds channel w*F + g + h*F/2; F fields per word of the (2-bit) plane)."""
    if PERM:
        F: tl.constexpr = 16 if BITS == 3 else 32 // BITS
        c = offs % F
        return offs - c + c // 2 + (c % 2) * (F // 2)
    else:
        return offs


@triton.jit
def columns(channel, BITS: tl.constexpr, PERM: tl.constexpr):
    """The inverse of `channels`: the operand column that holds `channel`."""
    if PERM:
        F: tl.constexpr = 16 if BITS == 3 else 32 // BITS
        c = channel % F
        return channel - c + 2 * (c % (F // 2)) + c // (F // 2)
    else:
        return channel


@triton.jit
def unpack(lo, hi, BITS: tl.constexpr, CODES: tl.constexpr, PERM: tl.constexpr, SPREAD: tl.constexpr):
    """Word tiles from load_words -> [N, HEAD_DIM] dot operand holding the codes (fp32 for CODES 0,
    else fp16: exact codes (magic) or codes * 2^-24 (subnormal)), columns in channel order, or with
    PERM in `channels` order: the two halves of each packed pair side by side, so the tile's 32-bit
    registers are the pairs themselves (no byte permutes before the shared-memory stores)."""
    K: tl.constexpr = 2 if BITS == 3 else BITS                                       # bits of a (2-bit plane) field
    if BITS == 3:
        hi = tl.interleave(hi, hi >> 16)                                             # bit f: high bit of lo's field f
        hi = ((hi & 0xFF) | ((hi & 0xFF00) << 8)) << 2                               # fields g, g+8 -> bits g+2, g+18
    if PERM:
        codes = tl.interleave(_fields(lo, hi, 0, 1, 16 // K, K, BITS == 3, CODES),
                              _fields(lo, hi, 16 // K, 1, 16 // K, K, BITS == 3, CODES))
    else:
        codes = _fields(lo, hi, 0, 1, 32 // K, K, BITS == 3, CODES)
    if CODES == 0:
        codes = codes.to(tl.float32)
    return codes


@triton.jit
def outlier_slots(idx_ptr, val_ptr, page_head, c0, count, CAP: tl.constexpr, C: tl.constexpr):
    """Slots c0 .. c0+C-1 of a page-head as [1, C] rows (they broadcast into [N, C] / [M, C] tiles
    without layout conversions): (flat index t*D + d, fp16 residual, live = slot < count). Loads are
    masked by the capacity only, so they never wait for `count`."""
    offs_c = c0 + tl.arange(0, C)[None, :]
    c_mask = offs_c < CAP
    idx = tl.load(idx_ptr + page_head * CAP + offs_c, mask=c_mask, other=0).to(tl.int32) & 0xFFFF
    resid = tl.load(val_ptr + page_head * CAP + offs_c, mask=c_mask, other=0.0)
    return idx, resid, offs_c < count


@triton.jit
def key_outliers(s_out, idx, resid, live, offs_n, q_sel_rows, q_inv_p2, HEAD_DIM: tl.constexpr,
                 OUTLIERS: tl.constexpr, HALF: tl.constexpr):
    """s_out [M, N] += q[h, d] r for the slots (token t, channel d, residual r) whose token is a row of
    offs_n; in units of 2^e (HALF, dots: q / 2^e and r are exact fp16, one exact MMA) or of qk_scale
    (the caller scales s_out once per block)."""
    q_sel = tl.load(q_sel_rows[:, None] + idx % HEAD_DIM).to(tl.float32)           # [M, C] raw q (L1)
    token = tl.where(live, idx // HEAD_DIM, -1)
    hit = offs_n[:, None] == token                                                   # [N, C]: few slots per thread
    if OUTLIERS == 2:
        w = q_sel * resid.to(tl.float32)
        s_out += tl.sum(tl.where(tl.trans(hit)[None, :, :], w[:, :, None], 0.0), axis=1)
    elif HALF:
        a_op = (q_sel * q_inv_p2[:, None]).to(tl.float16)
        s_out = tl.dot(a_op, tl.trans(tl.where(hit, resid, 0.0).to(tl.float16)), s_out)
    else:
        s_out += tl.dot(q_sel, tl.trans(tl.where(hit, resid.to(tl.float32), 0.0)), input_precision="ieee")
    return s_out


@triton.jit
def value_outliers(pv, p, p_op, idx, resid, live, row0, offs_b, offs_d, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_BITS: tl.constexpr, PERM: tl.constexpr,
                   OUTLIERS: tl.constexpr, HALF: tl.constexpr, GATHER_P: tl.constexpr):
    """pv [M, D] += p[h, t] r at (h, column of channel d) for the slots whose token t is in the block
    (rows row0 + offs_b); p_op = fp16(p) (HALF) or p."""
    column = idx // HEAD_DIM - row0                                                  # token in this block
    in_block = live & (column >= 0) & (column < BLOCK_N)
    channel = tl.where(in_block, columns(idx % HEAD_DIM, V_BITS, PERM), -1)
    if GATHER_P:                                                                     # warp shuffles
        column = tl.minimum(tl.maximum(column, 0), BLOCK_N - 1)
        p_sel = tl.gather(p, tl.broadcast_to(column, (BLOCK_M, column.shape[1])), axis=1)   # [M, C]
    else:                                                                            # an exact 0/1 dot
        pick = offs_b[:, None] == column                                             # [N, C]
        if HALF:
            p_sel = tl.dot(p_op, pick.to(tl.float16))                                # = fp16(p) at the slots
        else:
            p_sel = tl.dot(p_op, pick.to(tl.float32), input_precision="ieee")
    hit = offs_d[:, None] == channel                                                 # [D, C]
    if OUTLIERS == 2:
        w = p_sel * resid.to(tl.float32)
        pv += tl.sum(tl.where(tl.trans(hit)[None, :, :], w[:, :, None], 0.0), axis=1)
    elif HALF:
        b_op = tl.trans(tl.where(hit, resid, 0.0).to(tl.float16))                   # fp16 residual: exact
        if GATHER_P:
            # p <= 1 as fp16 hi + lo (22 bits): two MMAs sharing b
            p_hi = p_sel.to(tl.float16)
            p_lo = (p_sel - p_hi.to(tl.float32)).to(tl.float16)
            pv = tl.dot(p_lo, b_op, tl.dot(p_hi, b_op, pv))
        else:
            # fp16(p) as in the main value dot (which rounds p * S_t / base to fp16): exact MMA
            pv = tl.dot(p_sel.to(tl.float16), b_op, pv)
    else:
        pv += tl.dot(p_sel, tl.trans(tl.where(hit, resid.to(tl.float32), 0.0)), input_precision="ieee")
    return pv


@triton.jit
def key_chunk(s_out, run, idx, resid, live, offs_n, q_sel_rows, q_inv_p2, HEAD_DIM: tl.constexpr,
              OUTLIERS: tl.constexpr, HALF: tl.constexpr):
    """key_outliers for preloaded slots, if `run` (a uniform branch: the page-head has slots there)."""
    if run:
        s_out = key_outliers(s_out, idx, resid, live, offs_n, q_sel_rows, q_inv_p2, HEAD_DIM, OUTLIERS, HALF)
    return s_out


@triton.jit
def value_chunk(pv, run, p, p_op, idx, resid, live, row0, offs_b, offs_d, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_BITS: tl.constexpr, PERM: tl.constexpr,
                OUTLIERS: tl.constexpr, HALF: tl.constexpr, GATHER_P: tl.constexpr):
    """value_outliers for preloaded slots, if `run`."""
    if run:
        pv = value_outliers(pv, p, p_op, idx, resid, live, row0, offs_b, offs_d, HEAD_DIM, BLOCK_M, BLOCK_N, V_BITS,
                            PERM, OUTLIERS, HALF, GATHER_P)
    return pv


@triton.jit
def l2_prefetch(ptrs):
    """prefetch.global.L2 of the line holding each address (a hint: nothing returns, nothing waits).
    CUDA only (inline PTX): the interpreter never runs it."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_block(page_head, rows, k_codes, k_scale, k_zero, k_base, k_oidx, k_ovals, k_ocount,
                   v_codes, v_scale, v_zero, v_base, v_oidx, v_ovals, v_ocount, PAGE_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, K_CHANNEL: tl.constexpr, K_WORDS: tl.constexpr, K_CAP: tl.constexpr,
                   V_WORDS: tl.constexpr, V_CAP: tl.constexpr, SLOTS: tl.constexpr):
    """Pull a block's bytes into L2 (code words of `rows`, scales, zero points, counts and the first
    SLOTS outlier slots of each side), so that its loads, issued one iteration later, hit L2."""
    l2_prefetch(k_codes + page_head * (PAGE_SIZE * K_WORDS) + rows * K_WORDS)        # a row per thread: every line
    l2_prefetch(v_codes + page_head * (PAGE_SIZE * V_WORDS) + rows * V_WORDS)
    two = tl.arange(0, 2)
    if K_CHANNEL:
        l2_prefetch(k_scale + page_head * HEAD_DIM + two * (HEAD_DIM // 2))          # fp16 [D]: up to 2 lines
        l2_prefetch(k_zero + page_head * HEAD_DIM + two * (HEAD_DIM // 2))
    else:
        l2_prefetch(k_scale + page_head * PAGE_SIZE + rows)
        l2_prefetch(k_zero + page_head * PAGE_SIZE + rows)
        l2_prefetch(k_base + page_head + two * 0)
    l2_prefetch(v_scale + page_head * PAGE_SIZE + rows)
    l2_prefetch(v_zero + page_head * PAGE_SIZE + rows)
    l2_prefetch(v_base + page_head + two * 0)
    if K_CAP > 0:
        l2_prefetch(k_ocount + page_head + two * 0)
        if SLOTS > 0:
            l2_prefetch(k_oidx + page_head * K_CAP + two * (SLOTS // 2))
            l2_prefetch(k_ovals + page_head * K_CAP + two * (SLOTS // 2))
    if V_CAP > 0:
        l2_prefetch(v_ocount + page_head + two * 0)
        if SLOTS > 0:
            l2_prefetch(v_oidx + page_head * V_CAP + two * (SLOTS // 2))
            l2_prefetch(v_ovals + page_head * V_CAP + two * (SLOTS // 2))

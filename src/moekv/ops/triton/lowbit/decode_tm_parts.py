"""Pieces of the token-major low-bit decode kernel (lowbit_decode_tm.py): the order in which a code
tile's rows (tokens) and columns (channels) are held so that the unpacked tile *is* the register A
operand of a Hopper wgmma (no shared-memory trip), the word loads and the unpack into that order,
and the outlier corrections. The module docstring of lowbit_decode_tm.py has the math.

Register A operand of wgmma (16-bit types), per warpgroup of 4 warps and 64 rows (m64nNk16):
  row bits 0-2 <- lanes 2-4, row bit 3 <- a register, row bits 4-5 <- the warp in the warpgroup,
  further row bits <- further warps (warpgroups), then registers (repeats);
  column bit 0 <- a register (the two halves of a 32-bit register), column bits 1-2 <- lanes 0-1,
  further column bits <- registers.
The unpack below produces exactly that, from word loads that Triton coalesces into
  [BLOCK_N * 4, V] words (V contiguous words per thread, 4 lanes per token, 8 tokens per warp,
  then warps, then registers),
by views only (reshape / permute / join, which move no data):
  * rows: the loaded token order (lanes, warps, registers) is permuted into (lanes, a register,
    warps, registers) -- so MMA row r holds token `row_tokens(r)` of the block, not token r;
  * columns: lane l of a token holds its words l*V .. l*V+V-1 (of the 2-bit or only plane); a word's
    k-bit fields f and f + F/2 (F = 32 / k fields per word) form one packed pair (one shift and one
    mask, 16 bits apart), which is one 32-bit register of the operand: column bit 0 = which half,
    bits 1-2 = the lane, the rest = (pair, word of the lane) -- so operand column c holds channel
    `channels(c)`, and the query rows are loaded in that order instead.
Token and channel orders are free: softmax statistics are sums/maxima over tokens, the probability
tile keeps the code tile's row order, the output rows are stored at their channels.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def channels(col, BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The channel held by operand column `col` (any int tensor) of an unpacked tile."""
    K: tl.constexpr = 2 if BITS == 3 else BITS              # bits of a field of the (2-bit) plane
    F: tl.constexpr = 32 // K                               # fields per word
    G: tl.constexpr = F // 2                                # packed pairs per word
    V: tl.constexpr = HEAD_DIM * K // 32 // 4               # words per lane
    half = col % 2
    lane = (col // 2) % 4
    pair = (col // 8) % G
    word = lane * V + col // (8 * G)
    return word * F + pair + half * G


@triton.jit
def columns(channel, BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The inverse of `channels`: the operand column holding `channel`."""
    K: tl.constexpr = 2 if BITS == 3 else BITS
    F: tl.constexpr = 32 // K
    G: tl.constexpr = F // 2
    V: tl.constexpr = HEAD_DIM * K // 32 // 4
    word = channel // F
    field = channel % F
    lane = word // V
    return (field // G) + 2 * lane + 8 * (field % G) + 8 * G * (word % V)


@triton.jit
def row_tokens(r, BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr):
    """The token (row of the block) held by MMA row r (see rows_view)."""
    if BLOCK_N >= 16 * NUM_WARPS:
        low = r % 8
        b = (r // 8) % 2
        w = (r // 16) % NUM_WARPS
        a = r // (16 * NUM_WARPS)
        return ((a * 2 + b) * NUM_WARPS + w) * 8 + low
    else:
        return r


@triton.jit
def token_rows(t, BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr):
    """The inverse of row_tokens: the MMA row holding token t of the block."""
    if BLOCK_N >= 16 * NUM_WARPS:
        low = t % 8
        w = (t // 8) % NUM_WARPS
        b = (t // (8 * NUM_WARPS)) % 2
        a = t // (16 * NUM_WARPS)
        return ((a * NUM_WARPS + w) * 2 + b) * 8 + low
    else:
        return t


@triton.jit
def rows_view(x, BLOCK_N: tl.constexpr, X: tl.constexpr, NUM_WARPS: tl.constexpr):
    """Rows of x [BLOCK_N, X] from the loaded order (token bits: lanes, warps, registers) into the MMA
    order (lanes, one register, warps, registers): row r of the result is row row_tokens(r) of x."""
    if BLOCK_N >= 16 * NUM_WARPS:
        y = tl.reshape(x, (BLOCK_N // (16 * NUM_WARPS), 2, NUM_WARPS, 8, X))
        y = tl.permute(y, (0, 2, 1, 3, 4))
        return tl.reshape(y, (BLOCK_N, X))
    else:
        return x


@triton.jit
def load_words(codes_ptr, page_head, tok0, BITS: tl.constexpr, WORDS: tl.constexpr, PAGE_SIZE: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The packed rows tok0 .. tok0 + BLOCK_N - 1 of one page as (lo [BLOCK_N*4, V] words of the 2-bit or
    only plane, hi [BLOCK_N*4, 1] words of the int3 1-bit plane shifted so that bit 0 is the lane's
    first channel; for other widths `hi` is lo again). Row 4*t + l holds lane l's words of token t."""
    K: tl.constexpr = 2 if BITS == 3 else BITS
    V: tl.constexpr = HEAD_DIM * K // 32 // 4
    rho = tl.arange(0, BLOCK_N * 4)
    token = tok0 + rho // 4
    lane = rho % 4
    base = page_head * (PAGE_SIZE * WORDS) + token * WORDS                          # [N*4]
    if V == 1:
        # one word per lane (head_dim 64 at 2 / 3 bits): the hint goes on the 1-D offsets -- on the [N*4, 1] form
        # it lands on an add of zeros that the canonicalizer folds away, and without it the coalescer sees the 4
        # lanes' words as contiguous and loads 2 or 4 lanes per thread, which is not the MMA operand order
        offs = tl.max_contiguous(base + lane, [1])[:, None]
    else:
        offs = tl.max_contiguous((base + lane * V)[:, None] + tl.arange(0, V)[None, :], [1, V])
    lo = tl.load(codes_ptr + offs)
    if BITS == 3:
        first = lane * (V * 16)                                                      # the lane's first channel
        if V == 1:
            hoffs = tl.max_contiguous(base + HEAD_DIM // 16 + first // 32, [1])[:, None]
        else:
            hoffs = tl.max_contiguous((base + HEAD_DIM // 16 + first // 32)[:, None] + tl.zeros([1, 1], tl.int32),
                                      [1, 1])
        hi = tl.load(codes_ptr + hoffs) >> (first % 32)[:, None]
        return lo, hi
    else:
        return lo, lo


@triton.jit
def _pair(lo, odd, G: tl.constexpr, K: tl.constexpr, THREE: tl.constexpr, CODES: tl.constexpr):
    """Fields G and G + F/2 of every word as one packed pair (16 bits apart): one shift and one mask (magic
    codes OR in 0x6400 in the same LOP3). int3: `lo` / `odd` are the words E / O of _three_words, where
    fields 2j / 2j+1 sit as whole 3-bit codes at bits 4j (and 4j + 16)."""
    if THREE:
        if G % 2 == 0:
            pair = (lo >> (4 * (G // 2))) & 0x00070007
        else:
            pair = (odd >> (4 * (G // 2))) & 0x00070007
    else:
        MASK: tl.constexpr = (1 << K) - 1
        pair = (lo >> (K * G)) & (MASK | (MASK << 16))
    if CODES == 1:
        pair = pair | 0x64006400
    return pair


@triton.jit
def _pairs(lo, odd, START: tl.constexpr, STEP: tl.constexpr, COUNT: tl.constexpr, K: tl.constexpr,
           THREE: tl.constexpr, CODES: tl.constexpr):
    """Pairs START, START + STEP, ... (COUNT of them) along a new last axis, pair START + i*STEP at index i
    (tl.join appends its selector as the fastest axis, so the tree splits even / odd)."""
    if COUNT == 1:
        return _pair(lo, odd, START, K, THREE, CODES)
    else:
        return tl.join(_pairs(lo, odd, START, STEP * 2, COUNT // 2, K, THREE, CODES),
                       _pairs(lo, odd, START + STEP, STEP * 2, COUNT // 2, K, THREE, CODES))


@triton.jit
def _three_words(lo, h):
    """int3: a 2-bit-plane word `lo` (field f at bits 2f) and its fields' high bits `h` (bit f, 16 bits) ->
    E, O with field 2j (E) / 2j + 1 (O) as a 3-bit code at bits 4j, field 2j + 8 / 2j + 9 at 4j + 16: the
    high bits are spread once per word (bit g -> 2g, g + 8 -> 2g + 16: a byte move and three shift-or-mask
    steps), then each pair costs one shift and one mask, as for int4."""
    x = (h & 0xFF) | ((h & 0xFF00) << 8)
    x = (x | (x << 4)) & 0x0F0F0F0F
    x = (x | (x << 2)) & 0x33333333
    x = (x | (x << 1)) & 0x55555555
    even = (lo & 0x33333333) | ((x << 2) & -0x33333334)           # -0x33333334 = 0xCCCCCCCC as int32
    odd = ((lo >> 2) & 0x33333333) | (x & -0x33333334)
    return even, odd


@triton.jit
def unpack(lo, hi, BITS: tl.constexpr, CODES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
           NUM_WARPS: tl.constexpr):
    """Words from load_words -> the code tile [BLOCK_N, HEAD_DIM] (row r = token row_tokens(r), column c =
    channel channels(c)): fp32 codes (CODES 0), fp16 codes (1, magic), or fp16 code * 2^-24 (2)."""
    K: tl.constexpr = 2 if BITS == 3 else BITS
    F: tl.constexpr = 32 // K
    G: tl.constexpr = F // 2
    V: tl.constexpr = HEAD_DIM * K // 32 // 4
    lo = tl.reshape(rows_view(tl.reshape(lo, (BLOCK_N, 4 * V)), BLOCK_N, 4 * V, NUM_WARPS), (BLOCK_N, 4, V))
    if BITS == 3:
        hi = tl.reshape(rows_view(tl.reshape(hi, (BLOCK_N, 4)), BLOCK_N, 4, NUM_WARPS), (BLOCK_N, 4, 1))
        lo, odd = _three_words(lo, (hi >> (tl.arange(0, V) * 16)[None, None, :]) & 0xFFFF)     # [N, 4, V]
    else:
        odd = lo
    pairs = _pairs(lo, odd, 0, 1, G, K, BITS == 3, CODES)                             # [N, 4, V, G]
    pairs = tl.permute(tl.reshape(pairs, (BLOCK_N, 4, V, G)), (0, 2, 3, 1))           # [N, V, G, 4]
    if CODES == 0:
        low = (pairs & 0xFFFF).to(tl.float32)
        high = (pairs >> 16).to(tl.float32)
    else:
        low = pairs.to(tl.int16).to(tl.float16, bitcast=True)
        high = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        if CODES == 1:
            low = low - 1024.0
            high = high - 1024.0
    return tl.reshape(tl.join(low, high), (BLOCK_N, HEAD_DIM))


@triton.jit
def widen(x, ROWS: tl.constexpr, HS: tl.constexpr, H: tl.constexpr):
    """x [ROWS, HS] -> [ROWS, H] (H = HS or 2 * HS), zeros appended: the second half is the MMA's column bit
    log2(HS), a register, so the join moves nothing."""
    if H == HS:
        return x
    else:
        return tl.reshape(tl.permute(tl.join(x, tl.zeros_like(x)), (0, 2, 1)), (ROWS, H))


@triton.jit
def narrow(x, ROWS: tl.constexpr, HS: tl.constexpr, H: tl.constexpr):
    """x [ROWS, H] -> its first HS columns (the inverse of widen)."""
    if H == HS:
        return x
    else:
        first, second = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, HS)), (0, 2, 1)))
        return first


@triton.jit
def outlier_slots(idx_ptr, val_ptr, page_head, c0, count, CAP: tl.constexpr, C: tl.constexpr):
    """Slots c0 .. c0+C-1 of a page-head: (flat index t*D + d, fp16 residual, live = slot < count), [C]."""
    offs_c = c0 + tl.arange(0, C)
    c_mask = offs_c < CAP
    idx = tl.load(idx_ptr + page_head * CAP + offs_c, mask=c_mask, other=0).to(tl.int32) & 0xFFFF
    resid = tl.load(val_ptr + page_head * CAP + offs_c, mask=c_mask, other=0.0)
    return idx, resid, offs_c < count


@triton.jit
def key_outliers(s_out, idx, resid, live, tok, q_cols, q_inv_p2, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                 HS: tl.constexpr, H: tl.constexpr):
    """s_out [N, H] += r * q[h, d] for the slots (token t, channel d, residual r) whose token is in `tok` [N]
    (the block's tokens in row order). HALF: one exact fp16 MMA, r x (q / 2^e) (result in units of 2^e);
    else fp32 (ieee). q_cols [1, HS]: pointers to the raw query rows of the heads (clamped), q_inv_p2 [1, HS]."""
    token = tl.where(live, idx // HEAD_DIM, -1)
    hit = tok[:, None] == token[None, :]                                             # [N, C]
    q_sel = tl.load(q_cols + (idx % HEAD_DIM)[:, None]).to(tl.float32)               # [C, HS] raw q (L1)
    C: tl.constexpr = idx.shape[0]
    if HALF:
        a_op = tl.where(hit, resid[None, :], 0.0).to(tl.float16)
        b_op = widen((q_sel * q_inv_p2).to(tl.float16), C, HS, H)
        return tl.dot(a_op, b_op, s_out)
    else:
        a_op = tl.where(hit, resid.to(tl.float32)[None, :], 0.0)
        return tl.dot(a_op, widen(q_sel, C, HS, H), s_out, input_precision="ieee")


@triton.jit
def value_outliers(pv, p, p_op, idx, resid, live, tok, row0, col_d, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                   GATHER: tl.constexpr, BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr, HS: tl.constexpr,
                   H: tl.constexpr):
    """pv [D, H] (rows in operand column order col_d -> channels) += p[t, h] r at channel d for the slots
    whose token t is in `tok` [N] (the block's tokens in row order; the block starts at page row row0).
    p [N, HS] fp32, p_op [N, H]: widened fp16(p) (HALF) or p. The slots' p: GATHER picks fp16(p) at each slot's
    row with tl.gather (through shared memory), else an exact 0/1 dot; then one dot spreads r onto the
    channel rows (exact: fp16 r x fp16(p), fp32 accumulation)."""
    C: tl.constexpr = idx.shape[0]
    token = tl.where(live, idx // HEAD_DIM, -1)
    channel = tl.where(live, idx % HEAD_DIM, -1)
    hit = col_d[:, None] == channel[None, :]                                         # [D, C]
    if GATHER:
        in_block = (token >= row0) & (token < row0 + BLOCK_N)
        row = token_rows(tl.where(in_block, token - row0, 0), BLOCK_N, NUM_WARPS)
        p_sel = tl.gather(p, tl.broadcast_to(row[:, None], (C, HS)), axis=0)          # [C, HS]
        p_sel = widen(tl.where(in_block[:, None], p_sel, 0.0), C, HS, H)
        if HALF:
            p_sel = p_sel.to(tl.float16)
    else:
        pick = token[:, None] == tok[None, :]                                        # [C, N]
        if HALF:
            p_sel = tl.dot(pick.to(tl.float16), p_op).to(tl.float16)                 # [C, H] = fp16(p) exactly
        else:
            p_sel = tl.dot(pick.to(tl.float32), p_op, input_precision="ieee")
    if HALF:
        spread = tl.where(hit, resid[None, :], 0.0).to(tl.float16)
        return tl.dot(spread, p_sel, pv)
    else:
        spread = tl.where(hit, resid.to(tl.float32)[None, :], 0.0)
        return tl.dot(spread, p_sel, pv, input_precision="ieee")



# ---------------------------------------------------------------- outliers through a per-program scratch ("scatter")
@triton.jit
def rows_unview(x, BLOCK_N: tl.constexpr, X: tl.constexpr, NUM_WARPS: tl.constexpr):
    """The inverse of rows_view: row t of the result is row token_rows(t) of x (MMA order -> loaded order)."""
    if BLOCK_N >= 16 * NUM_WARPS:
        y = tl.reshape(x, (BLOCK_N // (16 * NUM_WARPS), NUM_WARPS, 2, 8, X))
        y = tl.permute(y, (0, 2, 1, 3, 4))
        return tl.reshape(y, (BLOCK_N, X))
    else:
        return x


@triton.jit
def scratch_offsets(ROWS: tl.constexpr, HS: tl.constexpr):
    """Offsets [ROWS, HS] of a row-major fp32 scratch tile, declared contiguous in pairs only: Triton then loads
    and stores it in the layout sizePerThread [1, 2], threadsPerWarp [8, 4], warps along rows -- the loaded order
    of rows_view -- so rows_view / rows_unview turn it into the MMA accumulator layout of an [ROWS, HS] tile
    (HS = 8) without moving data."""
    return tl.max_contiguous(tl.arange(0, ROWS)[:, None] * HS + tl.arange(0, HS)[None, :], [1, 2])


@triton.jit
def _slots(idx, live, row0, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """(token in the block, channel, live and in the block) of slots with flat indices idx (>= 0)."""
    flat = idx.to(tl.uint32)
    token = (flat // HEAD_DIM).to(tl.int32)
    channel = (flat % HEAD_DIM).to(tl.int32)
    if BLOCK_N < PAGE_SIZE:
        token = token - row0
        take = live & (token >= 0) & (token < BLOCK_N)
        token = tl.where(take, token, 0)
    else:
        take = live
    return token, channel, take


@triton.jit
def _heads(HG: tl.constexpr):
    """Head offsets [1, HG] of a scratch row, declared contiguous in pairs (see scratch_offsets): the slot tiles
    [C, HG] then share one layout (sizePerThread [1, 2]) for their loads and two-wide atomics."""
    return tl.max_contiguous(tl.arange(0, HG), [2])[None, :]


@triton.jit
def scatter_keys(buf, q_buf, idx, resid, live, row0, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HS: tl.constexpr, HG: tl.constexpr):
    """buf [BLOCK_N, HS] (row = token in the block, fp32, score units) += r * q[h, d] for the slots (token t,
    channel d, residual r) and the GROUP heads (HG = GROUP rounded up to a power of two, >= 2, <= HS): one fp32
    atomic per (slot, head). q_buf [D, HS]: the scaled query by channel (this program's copy in the scratch)."""
    token, channel, take = _slots(idx, live, row0, HEAD_DIM, BLOCK_N, PAGE_SIZE)
    heads = _heads(HG)
    fix = resid.to(tl.float32)[:, None] * tl.load(q_buf + channel[:, None] * HS + heads)     # [C, HG]
    tl.atomic_add(buf + token[:, None] * HS + heads, fix, mask=take[:, None] & (heads < GROUP), sem="relaxed",
                  scope="cta")


@triton.jit
def pick_values(p_buf, idx, live, row0, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_WARPS: tl.constexpr, HS: tl.constexpr,
                HG: tl.constexpr):
    """For the value slots (token t, channel d) and the GROUP heads: (p[t, h] [C, HG] from p_buf [BLOCK_N, HS],
    the block's probabilities by token, stored by this program before a barrier and read from L2; the row of
    each slot's correction in the value scratch; the mask of live (slot, head)s). The scratch row of channel d
    is row_tokens(columns(d)), so that rows_view of the loaded scratch is out^T's accumulator (rows columns(d))."""
    token, channel, take = _slots(idx, live, row0, HEAD_DIM, BLOCK_N, PAGE_SIZE)
    heads = _heads(HG)
    p_sel = tl.load(p_buf + token[:, None] * HS + heads, cache_modifier=".cg")
    row = row_tokens(columns(channel.to(tl.uint32), BITS, HEAD_DIM), HEAD_DIM, NUM_WARPS).to(tl.int32)
    return p_sel, row, take[:, None] & (heads < GROUP)


@triton.jit
def add_values(buf, p_sel, row, mask, resid, HS: tl.constexpr, HG: tl.constexpr):
    """buf [D, HS] += p[t, h] * r at the slots' rows (from pick_values): one fp32 atomic per live (slot, head)."""
    tl.atomic_add(buf + row[:, None] * HS + _heads(HG), p_sel * resid.to(tl.float32)[:, None], mask=mask,
                  sem="relaxed", scope="cta")


@triton.jit
def first_slots(idx_ptr, val_ptr, page_head, CAP: tl.constexpr, C: tl.constexpr):
    """Slots 0 .. C-1 of a page-head (flat index, fp16 residual), loaded before its count is known."""
    offs_c = tl.arange(0, C)
    c_mask = offs_c < CAP
    idx = tl.load(idx_ptr + page_head * CAP + offs_c, mask=c_mask, other=0).to(tl.int32) & 0xFFFF
    resid = tl.load(val_ptr + page_head * CAP + offs_c, mask=c_mask, other=0.0)
    return idx, resid

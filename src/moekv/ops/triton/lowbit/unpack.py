"""Device helpers that read the low-bit page format (docs/kv-format.md) inside attention kernels:
unpack a tile of packed code rows, turn codes into a tensor-core operand, and apply the sparse
fp16 outliers as corrections. Nothing here writes a dequantized page anywhere.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekv.ops.triton.lowbit.order import ORDER_ROWS, load_plane_word, load_triplet_word

# How codes become a dot operand (UNPACK_MODE).
UNPACK_FP32 = 0          # int -> fp32 (exact path: fp32 / mixed dtypes)
UNPACK_FP16_MAGIC = 1    # (code | 0x6400) read as fp16 = 1024 + code, minus 1024: no int->float convert
UNPACK_FP16_CVT = 2      # int -> fp16 by a plain convert (kept for comparison in the benchmark)


@triton.jit
def unpack_codes(page_ptr, offs_n, row_mask, BITS: tl.constexpr, WORDS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr, ORDER: tl.constexpr):
    """Rows offs_n [BLOCK_N] of the page-head at int32 `page_ptr` (WORDS words a row) -> codes [BLOCK_N, BLOCK_D]
    int32. ORDER (ops.triton.lowbit.order): rows in token order, or int3 in fragment order (core.lowbit_order).

    int4 / int2: one plane of k-bit fields, 32 // k per word, field j in word j // (32 // k) at bit
    (j % (32 // k)) * k. int3: triplets (core.lowbit_pack): group j = d // 32 owns words 2j, 2j + 1 and 2G + j;
    local channel 16h + m (m < 15) sits in word m // 5 at bit 16h + triplet_field_bit(m), m = 15 has bit i of
    its code at bit 16h + 9 of word i. Columns >= HEAD_DIM (padding up to BLOCK_D) read as 0. Two ways to the
    same int4 / int2 tile: GATHER=False loads each word once and splits it with a [N, W, fields] -> [N, D]
    reshape; GATHER=True loads, for every column, the word holding it (repeats hit L1) and shifts per column.
    int3 always gathers (three words per column).
    """
    row_ptrs = page_ptr + offs_n * WORDS
    if BITS == 3:
        codes = _triplets(page_ptr, offs_n, row_ptrs, row_mask, HEAD_DIM, BLOCK_D, ORDER)
    elif ORDER != ORDER_ROWS:                   # int4 / int2 in fragment order: each column's word from its place
        per_word: tl.constexpr = 32 // BITS
        offs_d = tl.arange(0, BLOCK_D)
        words = load_plane_word(page_ptr, offs_n[:, None], offs_d[None, :],
                                row_mask[:, None] & (offs_d[None, :] < HEAD_DIM), BITS, ORDER)
        codes = (words >> ((offs_d % per_word) * BITS)[None, :]) & ((1 << BITS) - 1)
    else:
        codes = _plane(row_ptrs, row_mask, 0, BITS, HEAD_DIM, BLOCK_N, BLOCK_D, GATHER)
    return codes


@triton.jit
def triplet_field_bit(m):
    """int3: bit of the whole field of local channel m % 16 (< 15) inside its 16-bit half
    (core.lowbit_pack.TRIPLET_BITS: 0, 3, 6, 10, 13 for m % 5 = 0 .. 4)."""
    f = m % 5
    return tl.where(f < 3, 3 * f, 3 * f + 1)


@triton.jit
def _triplets(page_ptr, offs_n, row_ptrs, row_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              ORDER: tl.constexpr):
    """int3 codes of every column: [N, BLOCK_D] int32."""
    groups: tl.constexpr = (HEAD_DIM + 31) // 32
    offs_d = tl.arange(0, BLOCK_D)
    group = offs_d // 32
    m = offs_d % 16
    half = (offs_d // 16) % 2
    base = 16 * half
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    if ORDER == ORDER_ROWS:
        w0 = tl.load(row_ptrs[:, None] + (2 * group)[None, :], mask=mask, other=0)
        w1 = tl.load(row_ptrs[:, None] + (2 * group + 1)[None, :], mask=mask, other=0)
        w2 = tl.load(row_ptrs[:, None] + (2 * groups + group)[None, :], mask=mask, other=0)
    else:
        tokens = offs_n[:, None]
        w0 = load_triplet_word(page_ptr, tokens, group[None, :], half[None, :], 0, mask, ORDER)
        w1 = load_triplet_word(page_ptr, tokens, group[None, :], half[None, :], 1, mask, ORDER)
        w2 = load_triplet_word(page_ptr, tokens, group[None, :], half[None, :], 2, mask, ORDER)
    word = m // 5
    held = tl.where((word == 0)[None, :], w0, tl.where((word == 1)[None, :], w1, w2))
    whole = (held >> (base + triplet_field_bit(m))[None, :]) & 7
    spare_bit = (base + 9)[None, :]
    spare = ((w0 >> spare_bit) & 1) | (((w1 >> spare_bit) & 1) << 1) | (((w2 >> spare_bit) & 1) << 2)
    return tl.where((m == 15)[None, :], spare, whole)


@triton.jit
def field_shifts(WIDTH: tl.constexpr):
    """[32 // WIDTH]: the bit of every field of a one-plane word, in field order."""
    return tl.arange(0, 32 // WIDTH) * WIDTH


@triton.jit
def _plane(row_ptrs, row_mask, FIRST_WORD: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr):
    """The WIDTH-bit fields of one bit plane starting at word FIRST_WORD of each row: [N, BLOCK_D] int32."""
    per_word: tl.constexpr = 32 // WIDTH
    field_mask: tl.constexpr = (1 << WIDTH) - 1
    if GATHER:
        offs_d = tl.arange(0, BLOCK_D)
        words = tl.load(row_ptrs[:, None] + FIRST_WORD + (offs_d // per_word)[None, :],
                        mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0)
        fields = (words >> ((offs_d % per_word) * WIDTH)[None, :]) & field_mask
    else:
        offs_w = tl.arange(0, BLOCK_D // per_word)
        words = tl.load(row_ptrs[:, None] + FIRST_WORD + offs_w[None, :],
                        mask=row_mask[:, None] & (offs_w[None, :] < (HEAD_DIM + per_word - 1) // per_word),
                        other=0)
        fields = (words[:, :, None] >> field_shifts(WIDTH)[None, None, :]) & field_mask
        fields = tl.reshape(fields, (BLOCK_N, BLOCK_D))
    return fields


@triton.jit
def code_operand(codes, UNPACK_MODE: tl.constexpr):
    """int32 codes -> a dot operand holding the codes exactly (fp16 for the 16-bit modes).

    The magic mode ORs the code into the mantissa of 1024.0 (fp16 0x6400) and subtracts 1024 in fp16,
    which is exact. (Keeping the +1024 and taking it out through row sums after the dot was tried
    first: the tensor cores' fp32 accumulation then loses ~1e-3 relative on int2 values.)
    """
    if UNPACK_MODE == 1:                    # UNPACK_FP16_MAGIC
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    elif UNPACK_MODE == 2:                  # UNPACK_FP16_CVT
        return codes.to(tl.float16)
    else:
        return codes.to(tl.float32)


@triton.jit
def token_scale_zero(scale_code, zero_code, scale_base, BITS: tl.constexpr):
    """Token-axis codes (uint8) and the page's scale_base (fp32) -> (S / scale_base, S, Z) in fp32:
    S = scale_base * 2 ** (-scale_code / 16), Z = -(S * zero_code) / 2 ** (8 - BITS) (docs/kv-format.md)."""
    relative = tl.exp2(-scale_code.to(tl.float32) * (1.0 / 16.0))
    scale = scale_base * relative
    zero = -(scale * zero_code.to(tl.float32)) * (1.0 / (1 << (8 - BITS)))
    return relative, scale, zero


@triton.jit
def key_outlier_scores(s, vals_ptr, idx_ptr, count, q_rows, row_mask, qk_scale, offs_n,
                       HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    """s [M, N] += q . residual for each key outlier (token t, channel d): s[:, t] += q[:, d] * r.

    q_rows [M]: pointers to the rows' query vectors (read again from L1/L2: only BLOCK_C columns).
    The scatter onto tokens is a dot with a one-hot [BLOCK_C, N] matrix, BLOCK_C outliers at a time.
    """
    for c0 in range(0, count, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_mask = offs_c < count
        idx = tl.load(idx_ptr + offs_c, mask=c_mask, other=0).to(tl.int32) & 0xFFFF
        resid = tl.load(vals_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        token = idx // HEAD_DIM
        channel = idx % HEAD_DIM
        q_sel = tl.load(q_rows[:, None] + channel[None, :], mask=row_mask[:, None] & c_mask[None, :],
                        other=0.0).to(tl.float32)                              # [M, BLOCK_C]
        weighted = q_sel * (resid * qk_scale)[None, :]
        onehot = tl.where(token[:, None] == offs_n[None, :], 1.0, 0.0)          # [BLOCK_C, N]
        s += tl.dot(weighted, onehot, input_precision=PRECISION)
    return s


@triton.jit
def value_outlier_output(pv, p, vals_ptr, idx_ptr, count, offs_n, offs_d,
                         HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr,
                         GATHER_P: tl.constexpr):
    """pv [M, D] += p[:, t] * r at column d for each value outlier (token t, channel d).

    Gather p[:, t] by tl.gather (GATHER_P) or a dot with a one-hot [N, BLOCK_C]; scatter onto
    channels by a dot with a one-hot [BLOCK_C, D]. offs_n: the block's token rows within the page.
    """
    for c0 in range(0, count, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_mask = offs_c < count
        idx = tl.load(idx_ptr + offs_c, mask=c_mask, other=0).to(tl.int32) & 0xFFFF
        resid = tl.load(vals_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        token = idx // HEAD_DIM
        channel = idx % HEAD_DIM
        if GATHER_P:
            first = tl.min(offs_n, axis=0)                                     # block's first row
            column = tl.minimum(tl.maximum(token - first, 0), p.shape[1] - 1)  # block-local column
            in_block = (token >= first) & (token < first + p.shape[1])
            p_sel = tl.gather(p, tl.broadcast_to(column[None, :], (p.shape[0], BLOCK_C)), axis=1)
            p_sel = tl.where(in_block[None, :], p_sel, 0.0)                    # [M, BLOCK_C]
        else:
            pick_token = tl.where(offs_n[:, None] == token[None, :], 1.0, 0.0)  # [N, BLOCK_C]
            p_sel = tl.dot(p, pick_token, input_precision=PRECISION)           # [M, BLOCK_C]
        put_channel = tl.where(channel[:, None] == offs_d[None, :], 1.0, 0.0)  # [BLOCK_C, D]
        pv += tl.dot(p_sel * resid[None, :], put_channel, input_precision=PRECISION)
    return pv

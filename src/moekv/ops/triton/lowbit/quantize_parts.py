"""Device helpers of the page-fill quantizer (quantize.py, quantize_layers.py): fp16 rounding in a set direction,
round half to even, per-group statistics and extremes on either axis, packing one bit plane, the range search
(docs/kv-format.md), and `quantize_page_head`, the body of one (page, kv head) that every quantizer kernel runs."""

from __future__ import annotations

import triton
import triton.language as tl

from moekv.ops.triton.lowbit.order import ORDER_ROWS, store_plane_words, store_triplet_word
from moekv.ops.triton.lowbit.unpack import field_shifts, triplet_field_bit


@triton.jit
def fp16_rounded(x, UP: tl.constexpr):
    """fp32 x -> fp16 rounded toward +inf (UP) or -inf, saturated to +-65504 (as the reference)."""
    h = tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)
    negative = bits < 0
    if UP:
        wrong = h.to(tl.float32) < x
        step = tl.where(negative, -1, 1)
    else:
        wrong = h.to(tl.float32) > x
        step = tl.where(negative, 1, -1)
    bits = tl.where(wrong, bits + step, bits)
    h = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.minimum(tl.maximum(h, -65504.0), 65504.0)


@triton.jit
def round_half_even(y):
    """torch.round for |y| < 2**22 (y is clamped to a few levels around the code range first)."""
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def group_stat(x, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """Sum of x [P, D] over each quantization group, broadcast back to [P, D]."""
    if AXIS_CHANNEL:
        return tl.broadcast_to(tl.sum(x, axis=0)[None, :], (P, D))
    else:
        grouped = tl.reshape(x, (P, G, D // G))
        return tl.reshape(tl.broadcast_to(tl.sum(grouped, axis=2)[:, :, None], (P, G, D // G)), (P, D))


@triton.jit
def group_extreme(x, IS_MAX: tl.constexpr, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                   G: tl.constexpr):
    """Min or max of x [P, D] over each group: [D] (channel axis) or [P, G] (token axis)."""
    if AXIS_CHANNEL:
        if IS_MAX:
            return tl.max(x, axis=0)
        else:
            return tl.min(x, axis=0)
    else:
        grouped = tl.reshape(x, (P, G, D // G))
        if IS_MAX:
            return tl.max(grouped, axis=2)
        else:
            return tl.min(grouped, axis=2)


@triton.jit
def pack_plane(fields, P: tl.constexpr, D: tl.constexpr, WIDTH: tl.constexpr):
    """fields [P, D] int32 (< 2**WIDTH) -> words [P, D * WIDTH // 32] int32: field j at bit
    core.lowbit_pack.field_bit(WIDTH, j % (32/W)) = (j % (32/W)) * W (int4 / int2)."""
    per_word: tl.constexpr = 32 // WIDTH
    grouped = tl.reshape(fields, (P, D // per_word, per_word))
    shifted = grouped << field_shifts(WIDTH)[None, None, :]
    return tl.sum(shifted, axis=2)                       # disjoint fields: the sum is the bitwise or


@triton.jit
def pack_triplet_word(codes, WORD: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    """int3 codes [P, D] int32 -> word WORD (0, 1, 2) of every triplet group: [P, D // 32] int32
    (core.lowbit_pack: local channel l = 16h + m; m < 15 in word m // 5 at bit 16h + triplet_field_bit(m),
    m = 15 contributes bit WORD of its code at bit 16h + 9)."""
    grouped = tl.reshape(codes, (P, D // 32, 32))
    lane = tl.arange(0, 32)
    m = lane % 16
    base = 16 * (lane // 16)
    whole = (m < 15) & (m // 5 == WORD)
    shift = tl.where(m == 15, base + 9, base + triplet_field_bit(m))
    piece = tl.where((m == 15)[None, None, :], (grouped >> WORD) & 1, grouped)
    contrib = tl.where((whole | (m == 15))[None, None, :], piece << shift[None, None, :], 0)
    return tl.sum(contrib, axis=2)                       # disjoint fields: the sum is the bitwise or


@triton.jit
def range_candidate(x, outlier, lo, hi, base, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                    G: tl.constexpr, BITS: tl.constexpr, WITH_ERROR: tl.constexpr):
    """Scale, zero point and codes of x [P, D] for group ranges [lo, hi] ([D] channel axis, [P, G] token axis,
    the reference's _scale_zero): (stored scale, stored zero, S [P, D], Z [P, D], codes [P, D] fp32, squared
    error over the inliers per group, like lo; 0 unless WITH_ERROR)."""
    levels: tl.constexpr = (1 << BITS) - 1
    if AXIS_CHANNEL:
        zero = fp16_rounded(lo, False)                                             # [D]
        scale = fp16_rounded(tl.maximum(tl.math.div_rn(hi - zero, tl.full([D], levels, tl.float32)),
                                        2.0 ** -24), True)
        stored_scale = scale
        stored_zero = zero
        scale_full = tl.broadcast_to(scale[None, :], (P, D))
        zero_full = tl.broadcast_to(zero[None, :], (P, D))
    else:
        frac: tl.constexpr = 1 << (8 - BITS)
        needed = tl.maximum(tl.math.div_rn(hi - lo, tl.full([P, G], levels - 1.0 / frac, tl.float32)), 2.0 ** -24)
        code = tl.floor(-16.0 * tl.log2(tl.math.div_rn(needed, tl.full([P, G], 1.0, tl.float32) * base)))
        code = tl.minimum(tl.maximum(code, 0.0), 255.0)
        step_scale = base * tl.exp2(-code / 16.0)
        code = tl.where(step_scale < needed, tl.maximum(code, 1.0) - 1.0, code)    # guard log2 rounding
        step_scale = base * tl.exp2(-code / 16.0)
        zero_code = tl.minimum(tl.maximum(tl.ceil(tl.math.div_rn(-lo * frac, step_scale)), 0.0), 255.0)
        zero_group = -(step_scale * zero_code) * (1.0 / frac)
        stored_scale = code
        stored_zero = zero_code
        scale_full = tl.reshape(tl.broadcast_to(step_scale[:, :, None], (P, G, D // G)), (P, D))
        zero_full = tl.reshape(tl.broadcast_to(zero_group[:, :, None], (P, G, D // G)), (P, D))
    ratio = tl.math.div_rn(x - zero_full, scale_full)
    ratio = tl.minimum(tl.maximum(ratio, -1.0), levels + 1.0)
    codes_f = tl.minimum(tl.maximum(round_half_even(ratio), 0.0), levels * 1.0)
    error = lo * 0.0
    if WITH_ERROR:
        diff = codes_f * scale_full + zero_full - x
        squared = tl.where(outlier, 0.0, diff * diff)
        if AXIS_CHANNEL:
            error = tl.sum(squared, axis=0)
        else:
            error = tl.sum(tl.reshape(squared, (P, G, D // G)), axis=2)
    return stored_scale, stored_zero, scale_full, zero_full, codes_f, error


@triton.jit
def _keep_better(better, c_scale, c_zero, c_scale_full, c_zero_full, c_codes, c_error, stored_scale, stored_zero,
                 scale_full, zero_full, codes_f, error, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                 G: tl.constexpr):
    """Per group, the candidate where `better` ([D] or [P, G]) holds, else the current best."""
    if AXIS_CHANNEL:
        better_full = tl.broadcast_to(better[None, :], (P, D))
    else:
        better_full = tl.reshape(tl.broadcast_to(better[:, :, None], (P, G, D // G)), (P, D))
    return (tl.where(better, c_scale, stored_scale), tl.where(better, c_zero, stored_zero),
            tl.where(better_full, c_scale_full, scale_full), tl.where(better_full, c_zero_full, zero_full),
            tl.where(better_full, c_codes, codes_f), tl.where(better, c_error, error))


@triton.jit
def choose_ranges(x, outlier, lo, hi, base, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                  G: tl.constexpr, BITS: tl.constexpr, CLIP_STEPS: tl.constexpr, CLIP_REFINE: tl.constexpr):
    """The reference's _choose_ranges: candidates (a, b) shrink the low end of [lo, hi] by a/16 and the high end
    by b/16 of its half width; per group the least squared error over the inliers wins, a later candidate only
    when strictly better. Stage 1: a = b = k, k = 0..CLIP_STEPS; then (CLIP_REFINE > 0) the low end alone
    a = A + j, j = -R..R, j != 0, clamped to [0, CLIP_STEPS], from each group's best (A, B); then the high end."""
    stored_scale, stored_zero, scale_full, zero_full, codes_f, error = range_candidate(
        x, outlier, lo, hi, base, AXIS_CHANNEL, P, D, G, BITS, CLIP_STEPS > 0)
    half = (hi - lo) * 0.5
    best_a = lo * 0.0
    best_b = lo * 0.0
    for k in tl.static_range(1, CLIP_STEPS + 1):
        shrink = k * 0.0625                              # a constexpr (k is): not re-annotated per step
        c_scale, c_zero, c_scale_full, c_zero_full, c_codes, c_error = range_candidate(
            x, outlier, lo + shrink * half, hi - shrink * half, base, AXIS_CHANNEL, P, D, G, BITS, True)
        better = c_error < error
        stored_scale, stored_zero, scale_full, zero_full, codes_f, error = _keep_better(
            better, c_scale, c_zero, c_scale_full, c_zero_full, c_codes, c_error, stored_scale, stored_zero,
            scale_full, zero_full, codes_f, error, AXIS_CHANNEL, P, D, G)
        best_a = tl.where(better, k * 1.0, best_a)
        best_b = tl.where(better, k * 1.0, best_b)
    if CLIP_REFINE > 0:
        for end in tl.static_range(2):               # 0: the low end moves alone, then 1: the high end
            if end == 0:
                start = best_a
            else:
                start = best_b
            for step in tl.static_range(2 * CLIP_REFINE + 1):
                if step != CLIP_REFINE:
                    moved = tl.minimum(tl.maximum(start + (step - CLIP_REFINE), 0.0), CLIP_STEPS * 1.0)
                    if end == 0:
                        a = moved
                        b = best_b
                    else:
                        a = best_a
                        b = moved
                    c_scale, c_zero, c_scale_full, c_zero_full, c_codes, c_error = range_candidate(
                        x, outlier, lo + (a * 0.0625) * half, hi - (b * 0.0625) * half, base, AXIS_CHANNEL, P, D,
                        G, BITS, True)
                    better = c_error < error
                    stored_scale, stored_zero, scale_full, zero_full, codes_f, error = _keep_better(
                        better, c_scale, c_zero, c_scale_full, c_zero_full, c_codes, c_error, stored_scale,
                        stored_zero, scale_full, zero_full, codes_f, error, AXIS_CHANNEL, P, D, G)
                    best_a = tl.where(better, a, best_a)
                    best_b = tl.where(better, b, best_b)
    return stored_scale, stored_zero, scale_full, zero_full, codes_f


@triton.jit
def group_broadcast(v, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """A per-group value ([D] channel axis, [P, G] token axis) broadcast to every element [P, D]."""
    if AXIS_CHANNEL:
        return tl.broadcast_to(v[None, :], (P, D))
    else:
        return tl.reshape(tl.broadcast_to(v[:, :, None], (P, G, D // G)), (P, D))


@triton.jit
def group_count(flags, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """Sum of int32 flags [P, D] over each group: [D] (channel axis) or [P, G] (token axis)."""
    if AXIS_CHANNEL:
        return tl.sum(flags, axis=0)
    else:
        return tl.sum(tl.reshape(flags, (P, G, D // G)), axis=2)


@triton.jit
def select_by_range(x, flat_index, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                    CAPACITY: tl.constexpr):
    """The reference's _select_outliers_by_range (outlier_select "range"): CAPACITY greedy steps, each removing
    the group end (largest or smallest inlier; among equal values the lowest flat index) whose removal lowers its
    group's squared range (token axis: widened to include 0) the most; groups keep one inlier; ties between
    candidates go to the lowest flat index; a step with no gain >= 0 removes nothing. Returns the mask [P, D].
    One loop body (not unrolled): compiled once whatever the capacity."""
    big: tl.constexpr = P * D
    out = tl.zeros([P, D], tl.int32)
    for _ in range(CAPACITY):
        inlier = out == 0
        count = group_count(inlier.to(tl.int32), AXIS_CHANNEL, P, D, G)
        hi1 = group_extreme(tl.where(inlier, x, float("-inf")), True, AXIS_CHANNEL, P, D, G)
        lo1 = group_extreme(tl.where(inlier, x, float("inf")), False, AXIS_CHANNEL, P, D, G)
        at_hi = group_extreme(tl.where(inlier & (x == group_broadcast(hi1, AXIS_CHANNEL, P, D, G)), flat_index, big),
                              False, AXIS_CHANNEL, P, D, G)
        at_lo = group_extreme(tl.where(inlier & (x == group_broadcast(lo1, AXIS_CHANNEL, P, D, G)), flat_index, big),
                              False, AXIS_CHANNEL, P, D, G)
        hi2 = group_extreme(tl.where(inlier & (flat_index != group_broadcast(at_hi, AXIS_CHANNEL, P, D, G)), x,
                                     float("-inf")), True, AXIS_CHANNEL, P, D, G)
        lo2 = group_extreme(tl.where(inlier & (flat_index != group_broadcast(at_lo, AXIS_CHANNEL, P, D, G)), x,
                                     float("inf")), False, AXIS_CHANNEL, P, D, G)
        if not AXIS_CHANNEL:                                                       # the range includes 0
            hi1 = tl.where(hi1 > 0.0, hi1, 0.0)
            hi2 = tl.where(hi2 > 0.0, hi2, 0.0)
            lo1 = tl.where(lo1 < 0.0, lo1, 0.0)
            lo2 = tl.where(lo2 < 0.0, lo2, 0.0)
        span = hi1 - lo1
        top_span = hi2 - lo1
        bottom_span = hi1 - lo2
        gain_top = tl.where(count > 1, span * span - top_span * top_span, -1.0)
        gain_bottom = tl.where(count > 1, span * span - bottom_span * bottom_span, -1.0)
        if AXIS_CHANNEL:
            best = tl.maximum(tl.max(gain_top, axis=0), tl.max(gain_bottom, axis=0))
            pick = tl.minimum(tl.min(tl.where(gain_top == best, at_hi, big), axis=0),
                              tl.min(tl.where(gain_bottom == best, at_lo, big), axis=0))
        else:
            best = tl.maximum(tl.max(tl.max(gain_top, axis=1), axis=0), tl.max(tl.max(gain_bottom, axis=1), axis=0))
            pick = tl.minimum(tl.min(tl.min(tl.where(gain_top == best, at_hi, big), axis=1), axis=0),
                              tl.min(tl.min(tl.where(gain_bottom == best, at_lo, big), axis=1), axis=0))
        pick = tl.where(best >= 0.0, pick, big)
        out = tl.where(flat_index == pick, 1, out)
    return out != 0


@triton.jit
def quantize_page_head(
    x_ptr, stride_xn, stride_xh, stride_xp,
    codes_ptr, scale_ptr, zero_ptr, base_ptr, outlier_vals_ptr, outlier_idx_ptr, outlier_count_ptr,
    qualifying_ptr, tau, counters_ptr, entry, head, page, source, blocks_ptr,
    COUNT: tl.constexpr, CNT_BUDGET: tl.constexpr, CNT_OUTLIERS: tl.constexpr, CNT_QUALIFYING: tl.constexpr,
    CNT_PAGES: tl.constexpr, STAGE_NB: tl.constexpr, STAGE_BLOCK: tl.constexpr,
    NUM_HEADS: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    BITS: tl.constexpr, AXIS_CHANNEL: tl.constexpr, GROUP_LEN: tl.constexpr, CAPACITY: tl.constexpr,
    BLOCK_C: tl.constexpr, WORDS: tl.constexpr, CLIP_STEPS: tl.constexpr, CLIP_REFINE: tl.constexpr,
    OUTLIER_RANGE: tl.constexpr,
):
    """Quantize rows `source` of x (head `head`) into page `page` of the output: the body of every quantizer
    kernel (quantize.py's `_quantize_kernel`, quantize_layers.py's `_quantize_kv_staged_kernel`), so their
    codes are the same bits. STAGE_NB > 1: the page's rows are in STAGE_NB blocks of STAGE_BLOCK rows whose
    ids are at blocks_ptr (row r: block blocks_ptr[r // STAGE_BLOCK], its row r % STAGE_BLOCK; stride_xn
    steps blocks); else rows 0..P-1 of x[source]. COUNT: statistics added to `counters_ptr` at the CNT_*
    indices with atomics, else the qualifying count stored at qualifying_ptr[entry, head]."""
    page_head = page * NUM_HEADS + head
    offs_p = tl.arange(0, P)
    offs_d = tl.arange(0, D)
    if STAGE_NB > 1:
        row_block = tl.maximum(tl.load(blocks_ptr + offs_p // STAGE_BLOCK).to(tl.int64), 0)
        rows = row_block * stride_xn + (offs_p % STAGE_BLOCK) * stride_xp                # [P]
    else:
        rows = source * stride_xn + offs_p * stride_xp
    x = tl.load(x_ptr + head * stride_xh + rows[:, None] + offs_d[None, :])
    x = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0)                # [P, D]
    levels: tl.constexpr = (1 << BITS) - 1
    flat_index = offs_p[:, None] * D + offs_d[None, :]                              # [P, D]

    # ---- outliers: deviation beyond tau * std of the group, at most CAPACITY ----
    mean = tl.math.div_rn(group_stat(x, AXIS_CHANNEL, P, D, G), tl.full([P, D], GROUP_LEN, tl.float32))
    centered = x - mean
    var = tl.math.div_rn(group_stat(centered * centered, AXIS_CHANNEL, P, D, G),
                         tl.full([P, D], GROUP_LEN, tl.float32))
    std = tl.sqrt_rn(var)
    deviation = tl.math.div_rn(tl.abs(centered), tl.where(std > 0, std, 1.0))
    qualifies = deviation > tau
    num_qualifying = tl.sum(tl.sum(qualifies.to(tl.int32), axis=1), axis=0)
    if COUNT:       # statistics straight into the cache's int64 counters (no qualifying output)
        tl.atomic_add(counters_ptr + CNT_QUALIFYING, num_qualifying.to(tl.int64), sem="relaxed")
        tl.atomic_add(counters_ptr + CNT_BUDGET, (num_qualifying > CAPACITY).to(tl.int64), sem="relaxed")
        if not OUTLIER_RANGE:
            tl.atomic_add(counters_ptr + CNT_OUTLIERS, tl.minimum(num_qualifying, CAPACITY).to(tl.int64),
                          sem="relaxed")                      # outliers stored: min(qualifying, capacity)
        if CNT_PAGES >= 0:
            tl.atomic_add(counters_ptr + CNT_PAGES, tl.full([], 1, tl.int64), sem="relaxed")
    else:
        tl.store(qualifying_ptr + entry * NUM_HEADS + head, num_qualifying)
    if CAPACITY == 0:
        outlier = flat_index < 0
    elif OUTLIER_RANGE:
        outlier = select_by_range(x, flat_index, AXIS_CHANNEL, P, D, G, CAPACITY)
    elif num_qualifying <= CAPACITY:
        outlier = qualifies
    else:
        # the CAPACITY largest deviations: binary search over the (monotonic) bits of the non-negative
        # fp32 deviations for the CAPACITY-th largest, ties at the cut going to the lowest indices
        bits = deviation.to(tl.int32, bitcast=True)
        lo = tl.full([], 0, tl.int32)
        hi = tl.full([], 0x7F800000, tl.int32)
        for _ in range(31):
            mid = lo + (hi - lo + 1) // 2
            enough = tl.sum(tl.sum((bits >= mid).to(tl.int32), axis=1), axis=0) >= CAPACITY
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
        above = bits > lo
        at_cut = bits == lo
        room = CAPACITY - tl.sum(tl.sum(above.to(tl.int32), axis=1), axis=0)
        tie_rank = tl.reshape(tl.cumsum(tl.reshape(at_cut.to(tl.int32), (P * D,)), axis=0), (P, D))
        outlier = above | (at_cut & (tie_rank <= room))

    if COUNT and OUTLIER_RANGE:     # outliers stored: the greedy steps that removed a value
        stored = tl.sum(tl.sum(outlier.to(tl.int32), axis=1), axis=0)
        tl.atomic_add(counters_ptr + CNT_OUTLIERS, stored.to(tl.int64), sem="relaxed")

    # ---- scale and zero point over the inliers ----
    lo_x = group_extreme(tl.where(outlier, float("inf"), x), False, AXIS_CHANNEL, P, D, G)
    hi_x = group_extreme(tl.where(outlier, float("-inf"), x), True, AXIS_CHANNEL, P, D, G)
    lo_x = tl.where(lo_x == float("inf"), 0.0, lo_x)                               # a group of outliers only
    hi_x = tl.where(hi_x == float("-inf"), 0.0, hi_x)
    base = 0.0
    if not AXIS_CHANNEL:
        frac: tl.constexpr = 1 << (8 - BITS)
        lo_x = tl.minimum(lo_x, 0.0)                                               # [P, G]: the range includes 0
        hi_x = tl.maximum(hi_x, 0.0)
        needed = tl.maximum(tl.math.div_rn(hi_x - lo_x, tl.full([P, G], levels - 1.0 / frac, tl.float32)),
                            2.0 ** -24)
        base = fp16_rounded(tl.maximum(tl.max(tl.max(needed, axis=1), axis=0), 2.0 ** -14), True)
        tl.store(base_ptr + page_head, base.to(tl.float16))
    stored_scale, stored_zero, scale_full, zero_full, codes_f = choose_ranges(
        x, outlier, lo_x, hi_x, base, AXIS_CHANNEL, P, D, G, BITS, CLIP_STEPS, CLIP_REFINE)
    if AXIS_CHANNEL:
        tl.store(scale_ptr + page_head * D + offs_d, stored_scale.to(tl.float16))
        tl.store(zero_ptr + page_head * D + offs_d, stored_zero.to(tl.float16))
    else:
        token_rows = page_head * (P * G) + offs_p[:, None] * G + tl.arange(0, G)[None, :]
        tl.store(scale_ptr + token_rows, stored_scale.to(tl.uint8))
        tl.store(zero_ptr + token_rows, stored_zero.to(tl.uint8))

    # ---- codes ----
    codes = codes_f.to(tl.int32)
    ORDER: tl.constexpr = (D == 128) * (P % 32 == 0) * (2 - AXIS_CHANNEL)   # order.code_order
    rows = codes_ptr + page_head * (P * WORDS) + offs_p[:, None] * WORDS
    if BITS != 3 and ORDER != ORDER_ROWS:                                        # int4 / int2 in fragment order
        store_plane_words(codes_ptr + page_head * (P * WORDS), pack_plane(codes, P, D, BITS), offs_p[:, None],
                          tl.arange(0, D * BITS // 32)[None, :], BITS, ORDER)
    elif BITS != 3:
        tl.store(rows + tl.arange(0, D * BITS // 32)[None, :], pack_plane(codes, P, D, BITS))
    elif ORDER != ORDER_ROWS:                                                     # int3 in fragment order
        page_codes = codes_ptr + page_head * (P * WORDS)
        for i in tl.static_range(3):
            store_triplet_word(page_codes, pack_triplet_word(codes, i, P, D), offs_p[:, None],
                               tl.arange(0, D // 32)[None, :], i, ORDER)
    else:
        first = tl.join(pack_triplet_word(codes, 0, P, D), pack_triplet_word(codes, 1, P, D))   # [P, D // 32, 2]
        tl.store(rows + tl.arange(0, D // 16)[None, :], tl.reshape(first, (P, D // 16)))
        tl.store(rows + D // 16 + tl.arange(0, D // 32)[None, :], pack_triplet_word(codes, 2, P, D))

    # ---- outliers: fp16 residuals, compacted in ascending index order ----
    if CAPACITY > 0:
        dequantized = codes_f * scale_full + zero_full
        residual = tl.minimum(tl.maximum(x - dequantized, -65504.0), 65504.0)
        flat_outlier = tl.reshape(outlier.to(tl.int32), (P * D,))
        position = tl.reshape(tl.cumsum(flat_outlier, axis=0), (P, D)) - 1
        count = tl.sum(flat_outlier, axis=0)
        slot_base = page_head * CAPACITY
        tl.store(outlier_vals_ptr + slot_base + position, residual.to(tl.float16), mask=outlier)
        index16 = tl.where(flat_index >= 32768, flat_index - 65536, flat_index).to(tl.int16)
        tl.store(outlier_idx_ptr + slot_base + position, index16, mask=outlier)
        tl.store(outlier_count_ptr + page_head, count.to(tl.int16))
        for c0 in range(0, CAPACITY, BLOCK_C):                                    # unused slots: 0 at index 0
            offs_c = c0 + tl.arange(0, BLOCK_C)
            unused = (offs_c >= count) & (offs_c < CAPACITY)
            tl.store(outlier_vals_ptr + slot_base + offs_c, tl.zeros([BLOCK_C], tl.float16), mask=unused)
            tl.store(outlier_idx_ptr + slot_base + offs_c, tl.zeros([BLOCK_C], tl.int16), mask=unused)

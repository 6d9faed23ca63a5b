"""Page-fill quantization into the low-bit format, the Triton twin of ops.reference.lowbit.quantize_pages.

One program per (page, kv head): the page's [P, D] values stay in registers while the kernel finds
the outliers (|x - mean| > tau * std of the group, at most `outlier_capacity`, the largest
deviations winning), takes min/max over the inliers, derives the fp16 (channel axis) or uint8-coded
(token axis) scale and zero point exactly as the reference does, rounds the codes, packs them into
32-bit words and writes the outliers' fp16 residuals compacted in ascending index order.

Two launch modes of one kernel: `quantize_pages` (page n of a dense [N, H, P, D] input into a new
PackedPages) and `quantize_staged_pages` (the decode step of the cache, CUDA-graph safe: entry i reads
its page id and staging slot from device tensors, returns at once for page -1, reads the slot's rows
from the staging pool and stores straight into the layer's PackedPages at that page), plus the
counted variants the decode step uses: `quantize_staged_pages_counted` (statistics added to int64
counters with atomics instead of a qualifying output), `quantize_staged_kv_counted`, keys and
values of one layer in one launch, and `quantize_staged_kv_counted_layers`, keys and values of every
layer in one launch (both `_quantize_kv_staged_kernel`, grid [B, H, 2 * L]; the body `_quantize_page_head`
is shared by both kernels, so the codes are the same bits).

Agreement with the reference run on the CPU (tests/ops/test_lowbit_quantize.py; on an H200 by
benchmarks/bench_attention.py --check): bit-exact codes, scales, zero points and outliers on the
channel axis; on the token axis the GPU's exp2/log2 differ from torch's in the last ulp, so a few
codes and residuals differ (each value within one quantization step; bit-exact in the CPU
interpreter). Two more places may differ at ties: a deviation that lands exactly on tau * std after
different summation orders, and (budget exceeded) equal deviations at the capacity cut, where the
kernel keeps the lowest indices and torch.topk leaves the order unspecified. (torch's CUDA run of
the reference is not bit-identical to its CPU run: CUDA division by a scalar uses the reciprocal.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.core.lowbit_layout import SCALE_CODE_STEPS, PackedPages
from moekv.ops.triton.common import check_launchable
from moekv.ops.triton.lowbit.quantize_parts import (choose_ranges, fp16_rounded, group_extreme, group_stat, pack_plane,
                                                    pack_triplet_word)

FP16_MAX = 65504.0


@triton.jit
def _quantize_kernel(
    x_ptr, stride_xn, stride_xh, stride_xp,
    codes_ptr, scale_ptr, zero_ptr, base_ptr, outlier_vals_ptr, outlier_idx_ptr, outlier_count_ptr,
    qualifying_ptr, tau, pages_ptr, slots_ptr, counters_ptr,
    COUNT: tl.constexpr, CNT_BUDGET: tl.constexpr, CNT_OUTLIERS: tl.constexpr, CNT_QUALIFYING: tl.constexpr,
    CNT_PAGES: tl.constexpr,
    STAGED: tl.constexpr, NUM_HEADS: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
    AXIS_CHANNEL: tl.constexpr, GROUP_LEN: tl.constexpr, CAPACITY: tl.constexpr, BLOCK_C: tl.constexpr, WORDS: tl.constexpr,
    CLIP_STEPS: tl.constexpr, CLIP_REFINE: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if STAGED:      # entry -> (page id, staging slot) from device tensors; page -1: nothing to do
        page = tl.load(pages_ptr + entry).to(tl.int64)
        if page < 0:
            return
        source = tl.load(slots_ptr + entry).to(tl.int64)
    else:           # entry n quantizes x[n] into output page n
        page = entry
        source = entry
    _quantize_page_head(
        x_ptr, stride_xn, stride_xh, stride_xp,
        codes_ptr, scale_ptr, zero_ptr, base_ptr, outlier_vals_ptr, outlier_idx_ptr, outlier_count_ptr,
        qualifying_ptr, tau, counters_ptr, entry, head, page, source,
        COUNT, CNT_BUDGET, CNT_OUTLIERS, CNT_QUALIFYING, CNT_PAGES,
        NUM_HEADS, P, D, G, BITS, AXIS_CHANNEL, GROUP_LEN, CAPACITY, BLOCK_C, WORDS, CLIP_STEPS, CLIP_REFINE)


@triton.jit
def _quantize_kv_staged_kernel(
    pages_ptr, slots_ptr, counters_ptr, k_tau, v_tau,
    kx_ptr, vx_ptr, stride_xl, stride_xn, stride_xh, stride_xp,
    k_codes, k_scale, k_zero, k_base, k_ovals, k_oidx, k_ocount,
    v_codes, v_scale, v_zero, v_base, v_ovals, v_oidx, v_ocount,
    kl_codes, kl_scale, kl_zero, kl_base, kl_ovals, kl_oidx, kl_ocount,
    vl_codes, vl_scale, vl_zero, vl_base, vl_ovals, vl_oidx, vl_ocount,
    NUM_HEADS: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    K_G: tl.constexpr, K_BITS: tl.constexpr, K_AXIS_CHANNEL: tl.constexpr, K_GROUP_LEN: tl.constexpr,
    K_CAPACITY: tl.constexpr, K_BLOCK_C: tl.constexpr, K_WORDS: tl.constexpr, K_CLIP_STEPS: tl.constexpr,
    K_CLIP_REFINE: tl.constexpr,
    V_G: tl.constexpr, V_BITS: tl.constexpr, V_AXIS_CHANNEL: tl.constexpr, V_GROUP_LEN: tl.constexpr,
    V_CAPACITY: tl.constexpr, V_BLOCK_C: tl.constexpr, V_WORDS: tl.constexpr, V_CLIP_STEPS: tl.constexpr,
    V_CLIP_REFINE: tl.constexpr,
    K_CNT_BUDGET: tl.constexpr, K_CNT_OUTLIERS: tl.constexpr, K_CNT_QUALIFYING: tl.constexpr,
    K_CNT_PAGES: tl.constexpr, V_CNT_BUDGET: tl.constexpr, V_CNT_OUTLIERS: tl.constexpr,
    V_CNT_QUALIFYING: tl.constexpr, V_CNT_PAGES: tl.constexpr,
):
    """Keys and values of the decode step, all layers, in one launch: grid [B, H, 2 * L], axis 2 = 2 * layer +
    (0 keys, 1 values). Layer l reads staging at l * stride_xl and writes each output tensor at l times its
    layer stride (kl_* / vl_*, in elements); statistics always go to the counters (COUNT mode). Entries of
    page -1 exit after one load."""
    entry = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    page = tl.load(pages_ptr + entry).to(tl.int64)
    if page >= 0:
        layer = (tl.program_id(2) // 2).to(tl.int64)
        source = tl.load(slots_ptr + entry).to(tl.int64)
        if tl.program_id(2) % 2 == 0:
            _quantize_page_head(
                kx_ptr + layer * stride_xl, stride_xn, stride_xh, stride_xp,
                k_codes + layer * kl_codes, k_scale + layer * kl_scale, k_zero + layer * kl_zero,
                k_base + layer * kl_base, k_ovals + layer * kl_ovals, k_oidx + layer * kl_oidx,
                k_ocount + layer * kl_ocount,
                counters_ptr, k_tau, counters_ptr, entry, head, page, source,
                True, K_CNT_BUDGET, K_CNT_OUTLIERS, K_CNT_QUALIFYING, K_CNT_PAGES,
                NUM_HEADS, P, D, K_G, K_BITS, K_AXIS_CHANNEL, K_GROUP_LEN, K_CAPACITY, K_BLOCK_C, K_WORDS,
                K_CLIP_STEPS, K_CLIP_REFINE)
        else:
            _quantize_page_head(
                vx_ptr + layer * stride_xl, stride_xn, stride_xh, stride_xp,
                v_codes + layer * vl_codes, v_scale + layer * vl_scale, v_zero + layer * vl_zero,
                v_base + layer * vl_base, v_ovals + layer * vl_ovals, v_oidx + layer * vl_oidx,
                v_ocount + layer * vl_ocount,
                counters_ptr, v_tau, counters_ptr, entry, head, page, source,
                True, V_CNT_BUDGET, V_CNT_OUTLIERS, V_CNT_QUALIFYING, V_CNT_PAGES,
                NUM_HEADS, P, D, V_G, V_BITS, V_AXIS_CHANNEL, V_GROUP_LEN, V_CAPACITY, V_BLOCK_C, V_WORDS,
                V_CLIP_STEPS, V_CLIP_REFINE)


@triton.jit
def _quantize_page_head(
    x_ptr, stride_xn, stride_xh, stride_xp,
    codes_ptr, scale_ptr, zero_ptr, base_ptr, outlier_vals_ptr, outlier_idx_ptr, outlier_count_ptr,
    qualifying_ptr, tau, counters_ptr, entry, head, page, source,
    COUNT: tl.constexpr, CNT_BUDGET: tl.constexpr, CNT_OUTLIERS: tl.constexpr, CNT_QUALIFYING: tl.constexpr,
    CNT_PAGES: tl.constexpr, NUM_HEADS: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    BITS: tl.constexpr, AXIS_CHANNEL: tl.constexpr, GROUP_LEN: tl.constexpr, CAPACITY: tl.constexpr,
    BLOCK_C: tl.constexpr, WORDS: tl.constexpr, CLIP_STEPS: tl.constexpr, CLIP_REFINE: tl.constexpr,
):
    """Quantize rows `source` of x (head `head`) into page `page` of the output: the body of both kernels."""
    page_head = page * NUM_HEADS + head
    offs_p = tl.arange(0, P)
    offs_d = tl.arange(0, D)
    x = tl.load(x_ptr + source * stride_xn + head * stride_xh + offs_p[:, None] * stride_xp + offs_d[None, :])
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
        tl.atomic_add(counters_ptr + CNT_OUTLIERS, tl.minimum(num_qualifying, CAPACITY).to(tl.int64),
                      sem="relaxed")                          # outliers stored: min(qualifying, capacity)
        if CNT_PAGES >= 0:
            tl.atomic_add(counters_ptr + CNT_PAGES, tl.full([], 1, tl.int64), sem="relaxed")
    else:
        tl.store(qualifying_ptr + entry * NUM_HEADS + head, num_qualifying)
    if CAPACITY == 0:
        outlier = flat_index < 0
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
    rows = codes_ptr + page_head * (P * WORDS) + offs_p[:, None] * WORDS
    if BITS == 4:
        tl.store(rows + tl.arange(0, D // 8)[None, :], pack_plane(codes, P, D, 4))
    elif BITS == 2:
        tl.store(rows + tl.arange(0, D // 16)[None, :], pack_plane(codes, P, D, 2))
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


def supports(spec) -> bool:
    """Page sizes and head dims the kernel handles (powers of two; head_dim a multiple of 32)."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    return (pow2(spec.page_size) and spec.page_size >= 16 and pow2(spec.head_dim) and spec.head_dim >= 32
            and spec.page_size * spec.head_dim <= 32768 and SCALE_CODE_STEPS == 16
            and (spec.axis == "channel" or pow2(spec.num_groups)))


def quantize_pages(x: torch.Tensor, spec) -> tuple[PackedPages, torch.Tensor]:
    """Same contract as ops.reference.lowbit.quantize_pages: x [N, H, P, D] (any float dtype, finite)
    -> (PackedPages of N pages, num_qualifying [N, H] int32)."""
    num_pages, num_heads, page_size, head_dim = x.shape
    if (page_size, head_dim) != (spec.page_size, spec.head_dim):
        raise ValueError(f"pages of shape [P={page_size}, D={head_dim}] do not match the spec's "
                         f"[{spec.page_size}, {spec.head_dim}]")
    assert x.stride(-1) == 1
    packed = PackedPages.empty(spec, num_pages, num_heads, x.device)
    qualifying = torch.empty((num_pages, num_heads), dtype=torch.int32, device=x.device)
    if num_pages == 0:
        return packed, qualifying
    _launch(x, (x.stride(0), x.stride(1), x.stride(2)), packed, qualifying, spec, num_pages, num_heads,
            pages=None, slots=None)
    return packed, qualifying


def quantize_staged_pages(staging: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, spec,
                          out: PackedPages) -> torch.Tensor:
    """Same contract as ops.reference.lowbit.quantize_staged_pages: staging [S, P, H, D], slots/pages [B]
    (int32/int64 device tensors; pages[i] < 0 skips entry i) -> num_qualifying [B, H] int32 (0 when
    skipped); the packed pages are stored straight into `out` at their page ids.

    Fixed launch shape [B, H] and no host reads of the indices: safe to capture in a CUDA graph. Each
    program reads its page id, returns at once for -1, loads the P rows of its staging slot through
    the strided [S, P, H, D] view and writes codes / scale / zero / outliers at that page of `out`.
    """
    num_slots, page_size, num_heads, head_dim = staging.shape
    if (page_size, head_dim) != (spec.page_size, spec.head_dim):
        raise ValueError(f"staging pages of shape [P={page_size}, D={head_dim}] do not match the spec's "
                         f"[{spec.page_size}, {spec.head_dim}]")
    if slots.shape != pages.shape or pages.dim() != 1:
        raise ValueError(f"slots {tuple(slots.shape)} and pages {tuple(pages.shape)} must both be [B]")
    if out.codes.shape[1:] != (num_heads, page_size, spec.words_per_row):
        raise ValueError(f"out holds pages of shape {tuple(out.codes.shape[1:])}, expected "
                         f"{(num_heads, page_size, spec.words_per_row)}")
    assert staging.stride(-1) == 1
    assert all(t.is_contiguous() for t in out.tensors().values()), "out must be dense PackedPages"
    count = pages.shape[0]
    qualifying = torch.zeros((count, num_heads), dtype=torch.int32, device=staging.device)
    if count == 0:
        return qualifying
    _launch(staging, (staging.stride(0), staging.stride(2), staging.stride(1)), out, qualifying, spec, count,
            num_heads, pages=pages, slots=slots)
    return qualifying


def quantize_staged_pages_counted(staging: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, spec,
                                  out: PackedPages, counters: torch.Tensor, budget_index: int, outliers_index: int,
                                  qualifying_index: int, pages_index: int = -1) -> None:
    """Same contract as ops.reference.lowbit.quantize_staged_pages_counted: quantize_staged_pages whose
    programs add their statistics to the int64 `counters` with atomics (integers: exact in any order),
    so the decode step needs no qualifying tensor and no counter kernels after it."""
    num_slots, page_size, num_heads, head_dim = staging.shape
    if (page_size, head_dim) != (spec.page_size, spec.head_dim):
        raise ValueError(f"staging pages of shape [P={page_size}, D={head_dim}] do not match the spec's "
                         f"[{spec.page_size}, {spec.head_dim}]")
    if slots.shape != pages.shape or pages.dim() != 1:
        raise ValueError(f"slots {tuple(slots.shape)} and pages {tuple(pages.shape)} must both be [B]")
    if out.codes.shape[1:] != (num_heads, page_size, spec.words_per_row):
        raise ValueError(f"out holds pages of shape {tuple(out.codes.shape[1:])}, expected "
                         f"{(num_heads, page_size, spec.words_per_row)}")
    if counters.dtype != torch.int64 or not counters.is_contiguous():
        raise ValueError("counters must be a contiguous int64 tensor")
    if (min(budget_index, outliers_index, qualifying_index) < 0
            or max(budget_index, outliers_index, qualifying_index, pages_index) >= counters.numel()):
        raise ValueError("counter index out of range")
    assert staging.stride(-1) == 1
    assert all(t.is_contiguous() for t in out.tensors().values()), "out must be dense PackedPages"
    if pages.shape[0] == 0:
        return
    _launch(staging, (staging.stride(0), staging.stride(2), staging.stride(1)), out, counters, spec, pages.shape[0],
            num_heads, pages=pages, slots=slots,
            count_at=(budget_index, outliers_index, qualifying_index, pages_index))


def _launch(x: torch.Tensor, strides: tuple[int, int, int], out: PackedPages, qualifying: torch.Tensor, spec,
            count: int, num_heads: int, pages: torch.Tensor | None, slots: torch.Tensor | None,
            count_at: tuple[int, int, int, int] | None = None) -> None:
    """One program per (entry, head); `strides` are x's (source, head, row) strides. With `count_at`
    (budget, outliers, qualifying, pages indices), `qualifying` is the int64 counters tensor instead."""
    check_launchable(_quantize_kernel, x)
    base = out.scale_base if out.scale_base is not None else out.scale
    staged = pages is not None
    elements = spec.page_size * spec.head_dim
    counting = count_at is not None
    cnt = count_at if counting else (0, 0, 0, -1)
    _quantize_kernel[(count, num_heads)](
        x, *strides,
        out.codes, out.scale, out.zero, base, out.outlier_vals, out.outlier_idx,
        out.outlier_count, qualifying, float(spec.outlier_tau),
        pages if staged else qualifying, slots if staged else qualifying,     # unread unless STAGED
        qualifying,                                                           # the counters when COUNT
        COUNT=counting, CNT_BUDGET=cnt[0], CNT_OUTLIERS=cnt[1], CNT_QUALIFYING=cnt[2], CNT_PAGES=cnt[3],
        STAGED=staged, NUM_HEADS=num_heads, P=spec.page_size, D=spec.head_dim,
        G=spec.num_groups if spec.axis == "token" else 1,
        BITS=spec.bits, AXIS_CHANNEL=spec.axis == "channel",
        GROUP_LEN=spec.page_size if spec.axis == "channel" else spec.group_size, CAPACITY=spec.outlier_capacity,
        BLOCK_C=min(1024, triton.next_power_of_2(max(spec.outlier_capacity, 1))), WORDS=spec.words_per_row,
        CLIP_STEPS=spec.clip_steps, CLIP_REFINE=spec.clip_refine, num_warps=8 if elements >= 8192 else 4, enable_fp_fusion=False)


def quantize_staged_kv_counted(staging_keys: torch.Tensor, staging_values: torch.Tensor, slots: torch.Tensor,
                               pages: torch.Tensor, key_spec, value_spec, key_out: PackedPages,
                               value_out: PackedPages, counters: torch.Tensor, key_counters: tuple[int, int, int, int],
                               value_counters: tuple[int, int, int, int]) -> None:
    """Same contract as ops.reference.lowbit.quantize_staged_kv_counted: the key and the value
    quantize_staged_pages_counted of one decode step in one launch (grid [B, H, 2]; CUDA-graph safe)."""
    if staging_keys.dim() != 4 or staging_values.dim() != 4:
        raise ValueError(f"staging pages must be [S, P, H, D], got {tuple(staging_keys.shape)}")
    one = [PackedPages(**{name: t.unsqueeze(0) for name, t in out.tensors().items()},
                       **({"scale_base": None} if out.scale_base is None else {})) for out in (key_out, value_out)]
    quantize_staged_kv_counted_layers(staging_keys.unsqueeze(0), staging_values.unsqueeze(0), slots, pages,
                                      key_spec, value_spec, *one, counters, key_counters, value_counters)


def quantize_staged_kv_counted_layers(staging_keys: torch.Tensor, staging_values: torch.Tensor, slots: torch.Tensor,
                                      pages: torch.Tensor, key_spec, value_spec, key_out: PackedPages,
                                      value_out: PackedPages, counters: torch.Tensor,
                                      key_counters: tuple[int, int, int, int],
                                      value_counters: tuple[int, int, int, int]) -> None:
    """Same contract as ops.reference.lowbit.quantize_staged_kv_counted_layers: quantize_staged_kv_counted of
    every layer (staging [L, S, P, H, D], stacked outputs [L, N, H, ...]) in one launch (grid [B, H, 2 * L])."""
    if staging_keys.dim() != 5 or staging_values.shape != staging_keys.shape or staging_keys.shape[0] < 1:
        raise ValueError(f"staging pages must be [L, S, P, H, D] (keys and values alike, L >= 1), got "
                         f"{tuple(staging_keys.shape)} and {tuple(staging_values.shape)}")
    num_layers, num_slots, page_size, num_heads, head_dim = staging_keys.shape
    for spec, out in ((key_spec, key_out), (value_spec, value_out)):
        if (page_size, head_dim) != (spec.page_size, spec.head_dim):
            raise ValueError(f"staging pages of shape {tuple(staging_keys.shape)} do not match the spec's "
                             f"[P={spec.page_size}, D={spec.head_dim}]")
        codes = out.codes.shape
        if len(codes) != 5 or codes[0] != num_layers or codes[2:] != (num_heads, page_size, spec.words_per_row):
            raise ValueError(f"out holds pages of shape {tuple(codes)}, expected "
                             f"[L={num_layers}, N, {num_heads}, {page_size}, {spec.words_per_row}]")
        assert all(t.shape[:2] == codes[:2] and t[0].is_contiguous() for t in out.tensors().values()), \
            "out must be stacked PackedPages of dense layers"
    if key_out.codes.shape[1] != value_out.codes.shape[1]:
        raise ValueError("key_out and value_out must hold the same number of pages")
    if slots.shape != pages.shape or pages.dim() != 1:
        raise ValueError(f"slots {tuple(slots.shape)} and pages {tuple(pages.shape)} must both be [B]")
    if counters.dtype != torch.int64 or not counters.is_contiguous():
        raise ValueError("counters must be a contiguous int64 tensor")
    indices = (*key_counters, *value_counters)
    if min(key_counters[:3] + value_counters[:3]) < 0 or max(indices) >= counters.numel():
        raise ValueError("counter index out of range")
    assert staging_keys.stride() == staging_values.stride() and staging_keys.stride(-1) == 1
    if pages.shape[0] == 0:
        return
    _launch_kv(staging_keys, staging_values, slots, pages, key_spec, value_spec, key_out, value_out, counters,
               key_counters, value_counters)


def _launch_kv(staging_keys, staging_values, slots, pages, key_spec, value_spec, key_out, value_out, counters,
               key_counters, value_counters) -> None:
    check_launchable(_quantize_kv_staged_kernel, staging_keys)
    num_layers, num_heads = staging_keys.shape[0], staging_keys.shape[3]

    def spec_args(prefix: str, spec) -> dict:
        return {f"{prefix}G": spec.num_groups if spec.axis == "token" else 1, f"{prefix}BITS": spec.bits,
                f"{prefix}AXIS_CHANNEL": spec.axis == "channel",
                f"{prefix}GROUP_LEN": spec.page_size if spec.axis == "channel" else spec.group_size,
                f"{prefix}CAPACITY": spec.outlier_capacity,
                f"{prefix}BLOCK_C": min(1024, triton.next_power_of_2(max(spec.outlier_capacity, 1))),
                f"{prefix}WORDS": spec.words_per_row, f"{prefix}CLIP_STEPS": spec.clip_steps,
                f"{prefix}CLIP_REFINE": spec.clip_refine}

    def out_args(out: PackedPages) -> tuple:
        base = out.scale_base if out.scale_base is not None else out.scale
        return (out.codes, out.scale, out.zero, base, out.outlier_vals, out.outlier_idx, out.outlier_count)

    def layer_strides(out: PackedPages) -> tuple:
        return tuple(t.stride(0) for t in out_args(out))

    names = ("CNT_BUDGET", "CNT_OUTLIERS", "CNT_QUALIFYING", "CNT_PAGES")
    counter_args = {**{f"K_{n}": i for n, i in zip(names, key_counters)},
                    **{f"V_{n}": i for n, i in zip(names, value_counters)}}
    elements = key_spec.page_size * key_spec.head_dim
    _quantize_kv_staged_kernel[(pages.shape[0], num_heads, 2 * num_layers)](
        pages, slots, counters, float(key_spec.outlier_tau), float(value_spec.outlier_tau),
        staging_keys, staging_values, staging_keys.stride(0), staging_keys.stride(1), staging_keys.stride(3),
        staging_keys.stride(2),
        *out_args(key_out), *out_args(value_out), *layer_strides(key_out), *layer_strides(value_out),
        NUM_HEADS=num_heads, P=key_spec.page_size, D=key_spec.head_dim,
        **spec_args("K_", key_spec), **spec_args("V_", value_spec), **counter_args,
        num_warps=8 if elements >= 8192 else 4, enable_fp_fusion=False)

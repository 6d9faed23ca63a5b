"""Page-fill quantization into the low-bit format, the Triton twin of ops.reference.lowbit.quantize_pages.

One program per (page, kv head): the page's [P, D] values stay in registers while the kernel finds
the outliers (|x - mean| > tau * std of the group, at most `outlier_capacity`, the largest
deviations winning), takes min/max over the inliers, derives the fp16 (channel axis) or uint8-coded
(token axis) scale and zero point exactly as the reference does, rounds the codes, packs them into
32-bit words and writes the outliers' fp16 residuals compacted in ascending index order.

Two launch modes of one kernel: `quantize_pages` (page n of a dense [N, H, P, D] input into a new
PackedPages) and `quantize_staged_pages` (the decode step of the cache, CUDA-graph safe: entry i reads
its page id and staging blocks from device tensors, returns at once for page -1, reads the blocks' rows
from the staging pool and stores straight into the layer's PackedPages at that page), plus the
counted variant `quantize_staged_pages_counted` (statistics added to int64 counters with atomics
instead of a qualifying output). The decode step's keys-and-values quantizer, one launch for every
layer (`quantize_staged_kv_counted_layers`, and `quantize_staged_kv_counted` for one layer), lives in
quantize_layers.py and is importable from here too. All kernels run one body per (page, kv head),
quantize_parts.quantize_page_head, so the codes are the same bits.

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
# the decode step's all-layers quantizer: its own module, named here too (ops.op_table's targets, tests)
from moekv.ops.triton.lowbit.quantize_layers import (quantize_staged_kv_counted,  # noqa: F401
                                                     quantize_staged_kv_counted_layers)  # noqa: F401
from moekv.ops.triton.lowbit.quantize_parts import quantize_page_head

FP16_MAX = 65504.0


@triton.jit
def _quantize_kernel(
    x_ptr, stride_xn, stride_xh, stride_xp,
    codes_ptr, scale_ptr, zero_ptr, base_ptr, outlier_vals_ptr, outlier_idx_ptr, outlier_count_ptr,
    qualifying_ptr, tau, pages_ptr, slots_ptr, counters_ptr,
    COUNT: tl.constexpr, CNT_BUDGET: tl.constexpr, CNT_OUTLIERS: tl.constexpr, CNT_QUALIFYING: tl.constexpr,
    CNT_PAGES: tl.constexpr,
    STAGED: tl.constexpr, STAGE_NB: tl.constexpr, STAGE_BLOCK: tl.constexpr, NUM_HEADS: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
    AXIS_CHANNEL: tl.constexpr, GROUP_LEN: tl.constexpr, CAPACITY: tl.constexpr, BLOCK_C: tl.constexpr, WORDS: tl.constexpr,
    CLIP_STEPS: tl.constexpr, CLIP_REFINE: tl.constexpr, OUTLIER_RANGE: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    blocks_ptr = slots_ptr + entry * STAGE_NB
    if STAGED:      # entry -> (page id, its staging blocks) from device tensors; page -1: nothing to do
        page = tl.load(pages_ptr + entry).to(tl.int64)
        if page < 0:
            return
        source = tl.load(blocks_ptr).to(tl.int64)
    else:           # entry n quantizes x[n] into output page n
        page = entry
        source = entry
    quantize_page_head(
        x_ptr, stride_xn, stride_xh, stride_xp,
        codes_ptr, scale_ptr, zero_ptr, base_ptr, outlier_vals_ptr, outlier_idx_ptr, outlier_count_ptr,
        qualifying_ptr, tau, counters_ptr, entry, head, page, source, blocks_ptr,
        COUNT, CNT_BUDGET, CNT_OUTLIERS, CNT_QUALIFYING, CNT_PAGES, STAGE_NB, STAGE_BLOCK,
        NUM_HEADS, P, D, G, BITS, AXIS_CHANNEL, GROUP_LEN, CAPACITY, BLOCK_C, WORDS, CLIP_STEPS, CLIP_REFINE,
        OUTLIER_RANGE)


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


def _staged_blocks(staging: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, spec, out: PackedPages
                   ) -> torch.Tensor:
    """Checks of the staged quantizers' arguments; the entries' blocks as a contiguous [B, nb] tensor."""
    num_blocks, block, num_heads, head_dim = staging.shape
    slots = slots[:, None] if slots.dim() == 1 else slots
    if slots.dim() != 2 or pages.dim() != 1 or slots.shape[0] != pages.shape[0]:
        raise ValueError(f"slots {tuple(slots.shape)} must be [B] or [B, nb] and pages {tuple(pages.shape)} [B]")
    if (slots.shape[1] * block, head_dim) != (spec.page_size, spec.head_dim):
        raise ValueError(f"{slots.shape[1]} staging blocks of [{block}, D={head_dim}] do not make the spec's pages "
                         f"[P={spec.page_size}, D={spec.head_dim}]")
    if out.codes.shape[1:] != (num_heads, spec.page_size, spec.words_per_row):
        raise ValueError(f"out holds pages of shape {tuple(out.codes.shape[1:])}, expected "
                         f"{(num_heads, spec.page_size, spec.words_per_row)}")
    assert staging.stride(-1) == 1
    assert all(t.is_contiguous() for t in out.tensors().values()), "out must be dense PackedPages"
    return slots.contiguous()


def quantize_staged_pages(staging: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, spec,
                          out: PackedPages) -> torch.Tensor:
    """Same contract as ops.reference.lowbit.quantize_staged_pages: staging [num_blocks, SB, H, D], slots [B, P / SB]
    (or [B] when SB = P), pages [B] (int32/int64 device tensors; pages[i] < 0 skips entry i) -> num_qualifying
    [B, H] int32 (0 when skipped); the packed pages are stored straight into `out` at their page ids.

    Fixed launch shape [B, H] and no host reads of the indices: safe to capture in a CUDA graph. Each
    program reads its page id, returns at once for -1, loads the P rows of its staging blocks through
    the strided view and writes codes / scale / zero / outliers at that page of `out`.
    """
    slots = _staged_blocks(staging, slots, pages, spec, out)
    count = pages.shape[0]
    qualifying = torch.zeros((count, staging.shape[2]), dtype=torch.int32, device=staging.device)
    if count == 0:
        return qualifying
    _launch(staging, (staging.stride(0), staging.stride(2), staging.stride(1)), out, qualifying, spec, count,
            staging.shape[2], pages=pages, slots=slots)
    return qualifying


def quantize_staged_pages_counted(staging: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, spec,
                                  out: PackedPages, counters: torch.Tensor, budget_index: int, outliers_index: int,
                                  qualifying_index: int, pages_index: int = -1) -> None:
    """Same contract as ops.reference.lowbit.quantize_staged_pages_counted: quantize_staged_pages whose
    programs add their statistics to the int64 `counters` with atomics (integers: exact in any order),
    so the decode step needs no qualifying tensor and no counter kernels after it."""
    slots = _staged_blocks(staging, slots, pages, spec, out)
    if counters.dtype != torch.int64 or not counters.is_contiguous():
        raise ValueError("counters must be a contiguous int64 tensor")
    if (min(budget_index, outliers_index, qualifying_index) < 0
            or max(budget_index, outliers_index, qualifying_index, pages_index) >= counters.numel()):
        raise ValueError("counter index out of range")
    if pages.shape[0] == 0:
        return
    _launch(staging, (staging.stride(0), staging.stride(2), staging.stride(1)), out, counters, spec, pages.shape[0],
            staging.shape[2], pages=pages, slots=slots,
            count_at=(budget_index, outliers_index, qualifying_index, pages_index))


def _launch(x: torch.Tensor, strides: tuple[int, int, int], out: PackedPages, qualifying: torch.Tensor, spec,
            count: int, num_heads: int, pages: torch.Tensor | None, slots: torch.Tensor | None,
            count_at: tuple[int, int, int, int] | None = None) -> None:
    """One program per (entry, head); `strides` are x's (source or block, head, row) strides; staged: slots
    [B, nb] contiguous, x's blocks of x.shape[1] rows. With `count_at`
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
        STAGED=staged, STAGE_NB=slots.shape[1] if staged else 1, STAGE_BLOCK=x.shape[1] if staged else 1,
        NUM_HEADS=num_heads, P=spec.page_size, D=spec.head_dim,
        G=spec.num_groups if spec.axis == "token" else 1,
        BITS=spec.bits, AXIS_CHANNEL=spec.axis == "channel",
        GROUP_LEN=spec.page_size if spec.axis == "channel" else spec.group_size, CAPACITY=spec.outlier_capacity,
        BLOCK_C=min(1024, triton.next_power_of_2(max(spec.outlier_capacity, 1))), WORDS=spec.words_per_row,
        CLIP_STEPS=spec.clip_steps, CLIP_REFINE=spec.clip_refine,
        OUTLIER_RANGE=spec.outlier_select == "range", num_warps=8 if elements >= 8192 else 4, enable_fp_fusion=False)

"""The decode step's page-fill quantizer of keys and values, every layer in one launch (the Triton twin of
ops.reference.lowbit.quantize_staged_kv_counted_layers).

`quantize_staged_kv_counted_layers`: staging pools [L, S, P, H, D] and stacked PackedPages [L, N, H, ...]
(`PackedPages.empty(..., num_layers=L)`: every layer dense, LAYER_ALIGN-byte aligned); entry i reads its page
id and staging blocks from device tensors (page -1: the program exits after that one load) and quantizes the
blocks' rows of layer l into layer l's pages at that id, statistics added to the cache's int64 counters with
atomics. One fixed-shape launch, grid [B, H, 2 * L] (axis 2 = 2 * layer + (0 keys, 1 values)), no host reads:
CUDA-graph safe; LowBitKVCache runs it once per decode step, after the last layer's attention
(kvcache/formats/lowbit_decode.py). `quantize_staged_kv_counted` is the same for one layer ([S, P, H, D],
PackedPages [N, H, ...]: run as L = 1). The body of each program is quantize_parts.quantize_page_head, the
one `quantize_pages` and the staged quantizers of quantize.py run, so the codes are the same bits (agreement
with the reference: quantize.py's docstring; tests/ops/test_quantize_staged_layers.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.core.lowbit_layout import PackedPages
from moekv.ops.triton.common import check_launchable
from moekv.ops.triton.lowbit.quantize_parts import quantize_page_head


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
    K_CLIP_REFINE: tl.constexpr, K_OUTLIER_RANGE: tl.constexpr,
    V_G: tl.constexpr, V_BITS: tl.constexpr, V_AXIS_CHANNEL: tl.constexpr, V_GROUP_LEN: tl.constexpr,
    V_CAPACITY: tl.constexpr, V_BLOCK_C: tl.constexpr, V_WORDS: tl.constexpr, V_CLIP_STEPS: tl.constexpr,
    V_CLIP_REFINE: tl.constexpr, V_OUTLIER_RANGE: tl.constexpr,
    K_CNT_BUDGET: tl.constexpr, K_CNT_OUTLIERS: tl.constexpr, K_CNT_QUALIFYING: tl.constexpr,
    K_CNT_PAGES: tl.constexpr, V_CNT_BUDGET: tl.constexpr, V_CNT_OUTLIERS: tl.constexpr,
    V_CNT_QUALIFYING: tl.constexpr, V_CNT_PAGES: tl.constexpr, STAGE_NB: tl.constexpr, STAGE_BLOCK: tl.constexpr,
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
        blocks_ptr = slots_ptr + entry * STAGE_NB
        source = tl.load(blocks_ptr).to(tl.int64)
        if tl.program_id(2) % 2 == 0:
            quantize_page_head(
                kx_ptr + layer * stride_xl, stride_xn, stride_xh, stride_xp,
                k_codes + layer * kl_codes, k_scale + layer * kl_scale, k_zero + layer * kl_zero,
                k_base + layer * kl_base, k_ovals + layer * kl_ovals, k_oidx + layer * kl_oidx,
                k_ocount + layer * kl_ocount,
                counters_ptr, k_tau, counters_ptr, entry, head, page, source, blocks_ptr,
                True, K_CNT_BUDGET, K_CNT_OUTLIERS, K_CNT_QUALIFYING, K_CNT_PAGES, STAGE_NB, STAGE_BLOCK,
                NUM_HEADS, P, D, K_G, K_BITS, K_AXIS_CHANNEL, K_GROUP_LEN, K_CAPACITY, K_BLOCK_C, K_WORDS,
                K_CLIP_STEPS, K_CLIP_REFINE, K_OUTLIER_RANGE)
        else:
            quantize_page_head(
                vx_ptr + layer * stride_xl, stride_xn, stride_xh, stride_xp,
                v_codes + layer * vl_codes, v_scale + layer * vl_scale, v_zero + layer * vl_zero,
                v_base + layer * vl_base, v_ovals + layer * vl_ovals, v_oidx + layer * vl_oidx,
                v_ocount + layer * vl_ocount,
                counters_ptr, v_tau, counters_ptr, entry, head, page, source, blocks_ptr,
                True, V_CNT_BUDGET, V_CNT_OUTLIERS, V_CNT_QUALIFYING, V_CNT_PAGES, STAGE_NB, STAGE_BLOCK,
                NUM_HEADS, P, D, V_G, V_BITS, V_AXIS_CHANNEL, V_GROUP_LEN, V_CAPACITY, V_BLOCK_C, V_WORDS,
                V_CLIP_STEPS, V_CLIP_REFINE, V_OUTLIER_RANGE)


def quantize_staged_kv_counted(staging_keys: torch.Tensor, staging_values: torch.Tensor, slots: torch.Tensor,
                               pages: torch.Tensor, key_spec, value_spec, key_out: PackedPages,
                               value_out: PackedPages, counters: torch.Tensor, key_counters: tuple[int, int, int, int],
                               value_counters: tuple[int, int, int, int]) -> None:
    """Same contract as ops.reference.lowbit.quantize_staged_kv_counted: the key and the value
    quantize_staged_pages_counted of one decode step in one launch (grid [B, H, 2]; CUDA-graph safe)."""
    if staging_keys.dim() != 4 or staging_values.dim() != 4:
        raise ValueError(f"staging pools must be [num_blocks, SB, H, D], got {tuple(staging_keys.shape)}")
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
    every layer (staging [L, num_blocks, SB, H, D], slots [B, P / SB] or [B] when SB = P, stacked outputs
    [L, N, H, ...]) in one launch (grid [B, H, 2 * L])."""
    if staging_keys.dim() != 5 or staging_values.shape != staging_keys.shape or staging_keys.shape[0] < 1:
        raise ValueError(f"staging pools must be [L, num_blocks, SB, H, D] (keys and values alike, L >= 1), got "
                         f"{tuple(staging_keys.shape)} and {tuple(staging_values.shape)}")
    num_layers, num_blocks, block, num_heads, head_dim = staging_keys.shape
    slots = slots[:, None] if slots.dim() == 1 else slots
    page_size = block * slots.shape[1]
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
    if slots.dim() != 2 or pages.dim() != 1 or slots.shape[0] != pages.shape[0]:
        raise ValueError(f"slots {tuple(slots.shape)} must be [B] or [B, nb] and pages {tuple(pages.shape)} [B]")
    if counters.dtype != torch.int64 or not counters.is_contiguous():
        raise ValueError("counters must be a contiguous int64 tensor")
    indices = (*key_counters, *value_counters)
    if min(key_counters[:3] + value_counters[:3]) < 0 or max(indices) >= counters.numel():
        raise ValueError("counter index out of range")
    assert staging_keys.stride() == staging_values.stride() and staging_keys.stride(-1) == 1
    if pages.shape[0] == 0:
        return
    _launch_kv(staging_keys, staging_values, slots.contiguous(), pages, key_spec, value_spec, key_out, value_out, counters,
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
                f"{prefix}CLIP_REFINE": spec.clip_refine, f"{prefix}OUTLIER_RANGE": spec.outlier_select == "range"}

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
        STAGE_NB=slots.shape[1], STAGE_BLOCK=staging_keys.shape[2],
        num_warps=8 if elements >= 8192 else 4, enable_fp_fusion=False)

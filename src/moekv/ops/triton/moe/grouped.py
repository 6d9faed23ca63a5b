"""The grouped path of the routed experts (larger batches, prefill): align, then two grouped GEMMs.

Same contract as ops.reference.moe.moe_experts_reference. Launches (no host synchronisation; the
grids are sized from shapes alone, blocks past num_padded exit at once):

1. align (ops.triton.moe.align): token-slots sorted by expert and padded to BLOCK_M per expert.
2. gate_up: one program per (BLOCK_M rows of the aligned layout, BLOCK_N of I). The rows gather their
   tokens' hidden states, tl.dot against the expert's gate and up rows (two fp32 accumulators), and the
   epilogue writes act = silu(gate) * up per slot ([T*k, I], model dtype).
3. down: one program per (BLOCK_M rows, BLOCK_N of H): act rows @ W_down^T, per slot, model dtype
   (as the reference rounds each expert's output).
4. combine (ops.triton.moe.decode.combine): out[t] = sum_j w[t, j] * y[t*k + j] in fp32, fixed order.

Program ids are swizzled in groups of GROUP_M row blocks so that consecutive programs share weight
tiles in L2 (row blocks of one expert are adjacent in the aligned layout). FP8 weights (W8A16) as in
ops.triton.moe.decode (weight_dot: codes widened in registers, products scaled per K tile). W8A8 (`act_fp8`,
FP8 weights only): the hidden rows and the activation rows are quantized to e4m3 per row first
(core.fp8.quantize_rows), the dots are fp8 x fp8 (Hopper's fp8 tensor cores; no widening in registers) and each
row's scale multiplies its fp32 accumulator (before the silu, and at the end of the down launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.core.fp8 import Fp8Weight, quantize_rows
from moekv.ops.reference.moe import padded_capacity
from moekv.ops.triton.common import check_launchable, weight_dot
from moekv.ops.triton.moe.align import moe_align
from moekv.ops.triton.moe.configs import get_config
from moekv.ops.triton.moe.decode import (combine, fp8_block_k, gate_up_tile, moe_shapes, upcast_dots, weight_args,
                                         weight_format)


@triton.jit
def _swizzle(num_row_blocks, num_col_blocks, GROUP_M: tl.constexpr):
    """(row block, column block) of this program, GROUP_M row blocks at a time."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_col_blocks
    group = pid // per_group
    first_row = group * GROUP_M
    group_size = tl.minimum(num_row_blocks - first_row, GROUP_M)
    row_block = first_row + (pid % per_group) % group_size
    col_block = (pid % per_group) // group_size
    return row_block, col_block


@triton.jit(do_not_specialize=["num_slots", "num_row_blocks"])   # one binary for every T
def _grouped_gate_up_kernel(
    x_ptr,                  # [T, H]
    w_ptr,                  # [E, 2I, H] gate rows then up rows
    sorted_ptr,             # [P] int32 slot of each aligned row (N: none)
    block_experts_ptr,      # [P / BLOCK_M] int32
    num_padded_ptr,         # [1] int32
    act_ptr,                # [N, I] out
    s_ptr,                  # FP8: [E, 2I / SCALE_BN, H / scale_block_k] fp32 scales (else unused)
    xs_ptr,                 # A8: [T] fp32 per-token scales of x's e4m3 codes (else unused)
    num_slots, hidden, inter, num_row_blocks,
    stride_xt, stride_we, stride_wn, stride_wk, stride_at,
    stride_se, stride_sn, stride_sk, scale_block_k,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr, A8: tl.constexpr,
):
    row_block, col_block = _swizzle(num_row_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if row_block * BLOCK_M < tl.load(num_padded_ptr):
        expert = tl.load(block_experts_ptr + row_block).to(tl.int64)
        slots = tl.load(sorted_ptr + row_block * BLOCK_M + tl.arange(0, BLOCK_M))            # [BLOCK_M]
        s_mask = slots < num_slots
        tokens = (slots // TOP_K).to(tl.int64)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = cols < inter
        x_rows = x_ptr + tokens[:, None] * stride_xt                                        # [BLOCK_M, 1]
        w_gate = w_ptr + expert * stride_we + cols[None, :] * stride_wn                     # [1, BLOCK_N]
        w_up = w_gate + inter * stride_wn
        s_gate = s_ptr + expert * stride_se + (cols // SCALE_BN) * stride_sn                # [BLOCK_N]
        s_up = s_ptr + expert * stride_se + ((cols + inter) // SCALE_BN) * stride_sn
        row_scale = tl.load(xs_ptr + tokens, mask=s_mask, other=0.0) if A8 else 1.0                # [BLOCK_M]
        act = gate_up_tile(x_rows, s_mask, w_gate, w_up, hidden, n_mask, stride_wk, s_gate, s_up, stride_sk,
                           scale_block_k, row_scale, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, FP8, A8)
        act = act.to(act_ptr.dtype.element_ty)
        rows = act_ptr + slots[:, None].to(tl.int64) * stride_at + cols[None, :]
        tl.store(rows, act, mask=s_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_slots", "num_row_blocks"])
def _grouped_down_kernel(
    act_ptr,                # [N, I]
    w_ptr,                  # [E, H, I]
    sorted_ptr, block_experts_ptr, num_padded_ptr,
    y_ptr,                  # [N, H] out: each slot's expert output (unweighted)
    s_ptr,                  # FP8: [E, H / SCALE_BN, I / scale_block_k] fp32 scales (else unused)
    as_ptr,                 # A8: [N] fp32 per-slot scales of act's e4m3 codes (else unused)
    num_slots, hidden, inter, num_row_blocks,
    stride_at, stride_we, stride_wn, stride_wk, stride_yt,
    stride_se, stride_sn, stride_sk, scale_block_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr, A8: tl.constexpr,
):
    row_block, col_block = _swizzle(num_row_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if row_block * BLOCK_M < tl.load(num_padded_ptr):
        expert = tl.load(block_experts_ptr + row_block).to(tl.int64)
        slots = tl.load(sorted_ptr + row_block * BLOCK_M + tl.arange(0, BLOCK_M))            # [BLOCK_M]
        s_mask = slots < num_slots
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = cols < hidden
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = act_ptr + slots[:, None].to(tl.int64) * stride_at                          # [BLOCK_M, 1]
        w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wn                     # [1, BLOCK_N]
        s_cols = s_ptr + expert * stride_se + (cols // SCALE_BN) * stride_sn                # [BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < inter
            a = tl.load(a_rows + ks[None, :], mask=s_mask[:, None] & k_mask[None, :], other=0.0)   # [BM, BK]
            w = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc += weight_dot(a, w, s_cols, k0, stride_sk, scale_block_k, n_mask, UPCAST, FP8)
        if A8:
            acc = acc * tl.load(as_ptr + slots, mask=s_mask, other=0.0)[:, None]
        rows = y_ptr + slots[:, None].to(tl.int64) * stride_yt + cols[None, :]
        tl.store(rows, acc.to(y_ptr.dtype.element_ty), mask=s_mask[:, None] & n_mask[None, :])


def _resolve_config(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, top_k: int, config: dict | None,
                    w_down: torch.Tensor | Fp8Weight | None = None) -> dict:
    num_experts, two_inter, hidden_size = w_gate_up.shape
    cfg = get_config("grouped", num_experts, hidden_size, two_inter // 2, hidden.shape[0], hidden.dtype,
                     hidden.device, top_k, weights=weight_format(w_gate_up))
    config = config or {}
    out = {"BLOCK_M": config.get("BLOCK_M", cfg["BLOCK_M"]),
           **{part: dict(cfg[part], **config.get(part, {})) for part in ("gate_up", "down")}}
    out["gate_up"] = fp8_block_k(out["gate_up"], w_gate_up, hidden_size)
    if w_down is not None:
        out["down"] = fp8_block_k(out["down"], w_down, two_inter // 2)
    return out


def grouped_activation(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, topk_ids: torch.Tensor,
                       config: dict | None = None, aligned: tuple | None = None, act_fp8: bool = False) -> torch.Tensor:
    """Align (unless `aligned` is given) and the gate_up launch: act [T*k, I]
    (twin: ops.reference.moe.moe_activation_reference). act_fp8: the hidden rows as e4m3 codes with per-token
    scales (core.fp8.quantize_rows), fp8 x fp8 dots (W8A8; FP8 weights only)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    cfg = _resolve_config(hidden, w_gate_up, top_k, config)
    block_m, part = cfg["BLOCK_M"], cfg["gate_up"]
    act = torch.empty((num_slots, inter), dtype=hidden.dtype, device=hidden.device)      # [N, I]
    if num_tokens == 0:
        return act
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    check_launchable(_grouped_gate_up_kernel, hidden)
    sorted_slots, block_experts, num_padded = aligned or moe_align(topk_ids, num_experts, block_m)
    num_row_blocks = padded_capacity(num_slots, num_experts, block_m) // block_m
    weight, scale_args, quant = weight_args(w_gate_up)
    x, x_scale = _a8_operand(hidden, w_gate_up, act_fp8)
    grid = (num_row_blocks * triton.cdiv(inter, part["BLOCK_N"]),)
    _grouped_gate_up_kernel[grid](
        x, weight, sorted_slots, block_experts, num_padded, act, scale_args[0], x_scale, num_slots, hidden_size,
        inter, num_row_blocks, x.stride(0), weight.stride(0), weight.stride(1), weight.stride(2),
        act.stride(0), *scale_args[1:], TOP_K=top_k, BLOCK_M=block_m,
        UPCAST=upcast_dots(x.dtype, x.device), A8=act_fp8, **part, **quant)
    return act


def _a8_operand(rows: torch.Tensor, weight: torch.Tensor | Fp8Weight,
                act_fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the kernel reads as its activation rows, their scales): e4m3 codes + per-row scales (W8A8), or the
    rows as they are (the scale argument unused)."""
    if not act_fp8:
        return rows, rows
    if not isinstance(weight, Fp8Weight):
        raise ValueError("act_fp8 (W8A8) needs FP8 expert weights")
    return quantize_rows(rows)


def moe_experts_grouped(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight,
                        topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, config: dict | None = None,
                        out_dtype: torch.dtype | None = None, act_fp8: bool = False) -> torch.Tensor:
    """Same contract as ops.reference.moe.moe_experts_reference, for any T (out_dtype, act_fp8: as there; act_fp8
    quantizes the hidden rows before the gate_up launch and the activation rows before the down launch).

    config: {"BLOCK_M", "gate_up": {BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages}, "down": {...}},
    entries overriding the tuned or default ones (moe_configs.get_config).
    """
    num_tokens, hidden_size, num_experts, inter, top_k = moe_shapes(hidden, w_gate_up, w_down, topk_ids,
                                                                    topk_weights)
    out = torch.empty(hidden.shape, dtype=out_dtype or hidden.dtype, device=hidden.device)   # [T, H]
    if num_tokens == 0:
        return out
    cfg = _resolve_config(hidden, w_gate_up, top_k, config, w_down)
    block_m, part = cfg["BLOCK_M"], cfg["down"]
    num_slots = num_tokens * top_k
    aligned = moe_align(topk_ids, num_experts, block_m)                               # [P], [P/BM], [1]
    act = grouped_activation(hidden, w_gate_up, topk_ids, config, aligned, act_fp8)   # [N, I]
    sorted_slots, block_experts, num_padded = aligned
    num_row_blocks = padded_capacity(num_slots, num_experts, block_m) // block_m
    expert_out = torch.empty((num_slots, hidden_size), dtype=hidden.dtype, device=hidden.device)   # [N, H]
    weight, scale_args, quant = weight_args(w_down)
    a, a_scale = _a8_operand(act, w_down, act_fp8)
    grid = (num_row_blocks * triton.cdiv(hidden_size, part["BLOCK_N"]),)
    _grouped_down_kernel[grid](
        a, weight, sorted_slots, block_experts, num_padded, expert_out, scale_args[0], a_scale, num_slots, hidden_size,
        inter, num_row_blocks, a.stride(0), weight.stride(0), weight.stride(1), weight.stride(2),
        expert_out.stride(0), *scale_args[1:], BLOCK_M=block_m, UPCAST=upcast_dots(a.dtype, a.device), A8=act_fp8,
        **part, **quant)
    return combine(expert_out.unsqueeze(0), topk_weights, out)                       # [T, H]

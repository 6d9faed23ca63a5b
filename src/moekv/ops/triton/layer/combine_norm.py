"""The MoE combine + residual add + RMSNorm in one launch (the Triton twin of
ops.reference.moe_combine.moe_combine_add_rms_norm): the next layer's input norm (or the model's final norm)
reading the un-combined expert outputs of the decode MoE kernels (ops.triton.moe.decode.moe_expert_partials),
so the MoE block's own combine launch goes away.

Grid (T,): a program holds its token's row in registers. First the combine, exactly as ops.triton.moe.decode's
combine kernel sums it: per slot j = 0 .. k-1 the K-splits s = 0 .. S-1 from zero (S a constexpr: every load of
the row can be in flight at once), acc = acc + w[t, j] * y_j, rounded once to the model dtype. Then the residual
add and the norm, exactly as ops.triton.layer.norm's kernel computes them (the same code and rounding points,
the same BLOCK_H and warps by default). Launched with enable_fp_fusion=False as both of those are, so nothing
contracts into a multiply-add: the combined row and the new residual are the unfused kernels' bit for bit on any
device; the normed row too under the interpreter, and on a GPU up to the order of the fp32 sum of squares (a
tree whose shape follows the register layout the compiler picks; in practice the norm kernel's).

Bytes: the program reads k * S rows of H fp32 (Mixtral-8x7B at one token: 2 slots x 4 splits x 16 KB = 128 KB,
just written by the down kernel, so L2-resident) plus the residual and norm weight. No host reads: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.reference.moe_combine import check_partials
from moekv.ops.triton import pdl
from moekv.ops.triton.common import check_launchable
from moekv.ops.triton.layer.norm import MAX_HIDDEN, launch_config, round_to

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SLOT_ROWS = 256          # k * S rows unrolled per program (top-8 x 32 splits); more: the two unfused kernels


@triton.jit
def _combine_add_norm_kernel(
    partial_ptr, weights_ptr, res_ptr, nw_ptr,            # [S, T*k, H] (rows unit-stride); [T, k]; [T, H]; [H]
    normed_ptr, new_res_ptr,                              # [T, H] x2, contiguous
    hidden, eps, stride_ps, stride_pt, stride_rt,
    TOP_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        row = partial_ptr + (t * TOP_K + j) * stride_pt + cols
        expert_out = tl.zeros([BLOCK_H], tl.float32)
        for split in tl.static_range(SPLITS):
            expert_out += tl.load(row + split * stride_ps, mask=hmask, other=0.0).to(tl.float32)
        acc += tl.load(weights_ptr + t * TOP_K + j).to(tl.float32) * expert_out
    x = round_to(acc, new_res_ptr.dtype.element_ty, EMULATE_BF16)           # the combine's output, model dtype
    r = tl.load(res_ptr + t * stride_rt + cols, mask=hmask, other=0.0)
    s = round_to(x.to(tl.float32) + r.to(tl.float32), new_res_ptr.dtype.element_ty, EMULATE_BF16)   # `r + x`
    tl.store(new_res_ptr + t * hidden + cols, s, mask=hmask)
    sf = s.to(tl.float32)
    variance = tl.sum(sf * sf, axis=0) / hidden
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(variance + eps))
    normed = round_to(sf * rstd, s.dtype, EMULATE_BF16).to(tl.float32)      # rounded to the input dtype first
    w = tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + t * hidden + cols, round_to(w * normed, normed_ptr.dtype.element_ty, EMULATE_BF16),
             mask=hmask)


def supports(partial: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor,
             norm_weight: torch.Tensor) -> bool:
    """partial [S, T*k, H] (any float dtype) with k * S <= MAX_SLOT_ROWS; topk_weights [T, k]; residual [T, H] and
    norm weight [H] of one float dtype, 1 <= H <= MAX_HIDDEN."""
    if partial.dim() != 3 or topk_weights.dim() != 2 or residual.dim() != 2 or partial.dtype not in DTYPES:
        return False
    num_tokens, top_k = topk_weights.shape
    splits, slots, hidden = partial.shape
    if slots != num_tokens * top_k or tuple(residual.shape) != (num_tokens, hidden) or splits < 1:
        return False
    if not (1 <= hidden <= MAX_HIDDEN and 1 <= top_k * splits <= MAX_SLOT_ROWS):
        return False
    return (residual.dtype in DTYPES and norm_weight.shape == (hidden,) and norm_weight.dtype == residual.dtype
            and topk_weights.dtype in DTYPES)


def moe_combine_add_rms_norm(partial: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, config: dict | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ops.reference.moe_combine.moe_combine_add_rms_norm -> (normed, residual + combined), both
    new and contiguous. config: overrides of the launch ({"num_warps": ...}; default: the norm kernel's)."""
    check_partials(partial, topk_weights, residual)
    check_launchable(_combine_add_norm_kernel, residual)
    num_tokens, hidden = residual.shape
    normed = torch.empty((num_tokens, hidden), dtype=residual.dtype, device=residual.device)
    new_residual = torch.empty_like(normed)
    if num_tokens == 0:
        return normed, new_residual
    partial = partial if partial.stride(-1) == 1 else partial.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    block, warps = launch_config(hidden)
    cfg = {"num_warps": warps, **(config or {})}
    _combine_add_norm_kernel[(num_tokens,)](
        partial, topk_weights.contiguous(), residual, norm_weight.contiguous(), normed, new_residual, hidden, eps,
        partial.stride(0), partial.stride(1), residual.stride(0), TOP_K=topk_weights.shape[1],
        SPLITS=partial.shape[0], BLOCK_H=block, EMULATE_BF16=not residual.is_cuda, enable_fp_fusion=False, **cfg,
        **pdl.launch_kwargs(residual))
    return normed, new_residual

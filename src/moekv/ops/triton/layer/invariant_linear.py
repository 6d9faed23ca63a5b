"""Batch-invariant GEMM: out [M, N] = x [M, K] @ weight[N, K]^T (+ bias), one fixed launch shape for every M.

Same contract as ops.reference.invariant_linear.invariant_linear; the linear layers' kernel in the batch-invariant
mode (KernelConfig.batch_invariant). cuBLAS picks its kernel, tiles and split-K by M, so a row's sum runs in a
different order (and rounds differently) at another batch size. Here every M gets the same program: BLOCK_M x
BLOCK_N output tiles (FIXED_CONFIG), the K loop from 0 upwards in BLOCK_K steps accumulating tl.dot products in
one fp32 accumulator, no split-K, bias in fp32, one rounding to x.dtype. Row r of the output depends on row r of x
and the weight only: the tile a row lands in, the rows beside it (masked rows load zeros) and the grid size change
nothing in its arithmetic (tensor-core dots compute each output element from its own row and column; the tile
shape, and so the instruction, is fixed). The one knob left to the weight: an FP8 weight (moekv.core.fp8.Fp8Weight,
W8A16: codes widened in registers, each K tile's product scaled, common.weight_dot) caps BLOCK_K at its scale
block, a property of the weight, not of M.

Cost: decode-size M pays a 64-row tile (tensor-core work, not bandwidth: the weight is read once per column
block as in any GEMM), and no split-K means narrow layers (a router's N = 8) run on few programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.core.fp8 import Fp8Weight, k_tile_cap
from moekv.ops.triton.common import check_launchable, weight_dot
from moekv.ops.triton.layer.norm import round_to
from moekv.ops.triton.moe.decode import fp8_runs_on

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FIXED_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)   # every M, every layer


@triton.jit(do_not_specialize=["M"])          # one binary for every M
def _invariant_linear_kernel(
    x_ptr,                  # [M, K]
    w_ptr,                  # [N, K] (FP8: e4m3 codes)
    s_ptr,                  # FP8: [N / SCALE_BN, K / scale_block_k] fp32 scales (else unused)
    b_ptr,                  # [N] or a dummy (HAS_BIAS False)
    out_ptr,                # [M, N] x.dtype
    M, N, K,
    stride_xm, stride_wn, stride_wk, stride_sn, stride_sk, scale_block_k, stride_om,
    HAS_BIAS: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rows < M
    n_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm                                   # [BM, 1]
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn                                   # [1, BN]
    s_cols = s_ptr + (cols // SCALE_BN) * stride_sn                                           # [BN] (FP8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):                    # always from 0, always BLOCK_K wide: a fixed order
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)   # [BM, BK]
        w = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += weight_dot(x, w, s_cols, k0, stride_sk, scale_block_k, n_mask, UPCAST, FP8)   # [BM, BN] fp32
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    offs = rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptr + offs, round_to(acc, out_ptr.dtype.element_ty, EMULATE_BF16),
             mask=m_mask[:, None] & n_mask[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> bool:
    """2-D activations of a float dtype; a weight of the same dtype, or an FP8 weight whose scale blocks span K or
    a multiple of 16 of it (on a GPU that converts e4m3 in registers, or the interpreter)."""
    if x.dim() != 2 or x.dtype not in DTYPES or len(weight.shape) != 2 or x.shape[1] != weight.shape[1]:
        return False
    if isinstance(weight, Fp8Weight):
        return fp8_runs_on(x.device) and (weight.block[1] >= weight.shape[1] or weight.block[1] % 16 == 0)
    return isinstance(weight, torch.Tensor) and weight.dtype == x.dtype


def invariant_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
                     config: dict | None = None) -> torch.Tensor:
    """Same contract as ops.reference.invariant_linear.invariant_linear. config: launch entries over FIXED_CONFIG
    (tests only: the mode's invariance holds for one config, whichever it is)."""
    num_rows, _ = x.shape
    out_features, in_features = weight.shape
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)                 # [M, N]
    if num_rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    check_launchable(_invariant_linear_kernel, x)
    cfg = dict(FIXED_CONFIG, **(config or {}))
    fp8 = isinstance(weight, Fp8Weight)
    if fp8:
        cap = k_tile_cap(weight)                     # a K tile must not cross a scale block (a weight property)
        if cap is not None:
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], cap)
        codes, scale, scale_args = weight.codes, weight.scale, (weight.scale.stride(0), weight.scale.stride(1),
                                                                 weight.block[1])
        scale_bn = weight.block[0]
    else:
        codes, scale, scale_args, scale_bn = weight, weight, (0, 0, 1), 1
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]), triton.cdiv(out_features, cfg["BLOCK_N"]))
    _invariant_linear_kernel[grid](
        x, codes, scale, bias if bias is not None else codes, out, num_rows, out_features, in_features,
        x.stride(0), codes.stride(0), codes.stride(1), *scale_args, out.stride(0),
        HAS_BIAS=bias is not None, FP8=fp8, SCALE_BN=scale_bn,
        UPCAST=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and not x.is_cuda),
        EMULATE_BF16=not x.is_cuda, **cfg)
    return out

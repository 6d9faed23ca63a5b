"""RMSNorm, alone or fused with the residual add, one row per program (the Triton twin of
ops.reference.layers.rms_norm / fused_add_rms_norm).

Rounding points are the reference's: the residual sum is rounded to the model dtype (and stored as
the new residual) before the norm reads it; the statistics run in fp32; the normalised value is
rounded to the input dtype before the weight multiply, whose fp32 product (exact for two 16-bit
operands) is rounded once to the output dtype. The launch passes enable_fp_fusion=False, so every
square is rounded before it is summed (as the reference's `pow(2)` is) and no multiply-add contracts.

What cannot match the reference bit for bit on a GPU: the order of the fp32 sum of squares (a tree
here, torch's own reduction order there), the mean's division (`/` compiles to div.full.f32, about
2 ulp; torch's mean scales its sum its own way) and torch's rsqrt (CUDA rsqrtf, up to 2 ulp; here a
correctly rounded 1 / sqrt). rstd is therefore off by a few fp32 ulps, so the 16-bit `normed` can
round to the neighbouring value at a few elements: the output is within a couple of ulps of the
reference there (tests/ops/test_layer_kernels.py states the bounds) and equal everywhere else.

Rows are addressed as [A, B, N] with strides (sa, sb, 1), so a [T, H, D] view of a fused qkv
projection (the per-head q/k norm) needs no copy; grid (A, B).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton import pdl
from moekv.ops.triton.common import check_launchable, round_to

MAX_HIDDEN = 16384          # one row is held in registers: 16K fp32 values over 16 warps = 32 per thread


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n, eps,
                     stride_xa, stride_xb, stride_ra, stride_rb, num_b,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_BF16: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    pdl.enter(USE_PDL)
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + cols, mask=mask, other=0.0)
    row = (a * num_b + b) * n                                       # outputs are contiguous [A, B, N]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + a * stride_ra + b * stride_rb + cols, mask=mask, other=0.0)
        s = round_to(x.to(tl.float32) + r.to(tl.float32), new_res_ptr.dtype.element_ty, EMULATE_BF16)   # `r + x`
        tl.store(new_res_ptr + row + cols, s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(variance + eps))
    normed = round_to(xf * rstd, x.dtype, EMULATE_BF16).to(tl.float32)     # rounded to the input dtype first
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, round_to(w * normed, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    n = x.shape[-1]
    if x.dim() == 0 or n == 0 or n > MAX_HIDDEN or weight.shape != (n,):
        return False
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return False
    return all(t.dtype in (torch.float32, torch.float16, torch.bfloat16) for t in (x, weight))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [A, B, N] view with unit stride along N (copies only when no such view exists)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.unsqueeze(0).unsqueeze(0)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    try:
        return t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-2], t.shape[-1])


def launch_config(n: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for rows of n values."""
    block = triton.next_power_of_2(max(n, 1))
    return block, min(16, max(1, block // 512))


def _launch(x, residual, weight, eps):
    check_launchable(_rms_norm_kernel, x)
    n = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    x3 = _rows(x)
    num_a, num_b = x3.shape[0], x3.shape[1]
    if residual is not None:
        r3 = _rows(residual)
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        r3, new_residual = x3, out
    if out.numel() == 0:
        return out, new_residual
    block, warps = launch_config(n)
    _rms_norm_kernel[(num_a, num_b)](
        x3, r3, weight, out, new_residual, n, eps, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), num_b,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block, EMULATE_BF16=not x.is_cuda, num_warps=warps,
        enable_fp_fusion=False, **pdl.launch_kwargs(x))
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ops.reference.layers.rms_norm; the output is contiguous."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ops.reference.layers.fused_add_rms_norm; both outputs are new and contiguous."""
    return _launch(x, residual, weight, eps)

"""Reference of the skinny (decode-size) GEMM: out [M, N] = x [M, K] @ weight[N, K]^T (+ bias).

The oracle for ops.triton.layer.skinny_gemm. Rounding follows torch's F.linear on CUDA for 16-bit inputs
(cuBLAS / cuBLASLt: products and sums in fp32, the bias added in fp32 in the epilogue, one rounding to
the activation dtype at the end; exception, measured on an H200 with torch 2.11: at M = 1 in bf16 it
rounds x w^T to bf16 before adding the bias, so it is up to one ulp of the product off): here the fp32 matmul of the widened operands (16-bit products are
exact in fp32), + bias in fp32, then one cast to x.dtype.

What a kernel can match: only the order of the fp32 sum differs (cuBLAS split-K, this matmul's blocking,
the kernel's BLOCK_K tiles and split-K partials), so an fp32 result differs from any other order by at
most about K * 2^-24 * sum_k |x_k w_k| (the worst-case bound of recursive summation; typical errors are
~sqrt(K) times smaller); after the single rounding to a 16-bit dtype that is the same value, or the
neighbouring one where the two fp32 sums straddle a rounding boundary (rare: well under 1% of the
elements at K = 200 in the tests). tests/ops/test_skinny_gemm.py checks exactly that.
"""

from __future__ import annotations

import torch


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K] (nn.Linear's layout), bias [N] or None -> [M, N] in x.dtype (fp32 sums)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    out = torch.matmul(x.float(), weight.float().t())                 # [M, N] fp32
    if bias is not None:
        assert bias.shape == (weight.shape[0],), bias.shape
        out = out + bias.float()
    return out.to(x.dtype)

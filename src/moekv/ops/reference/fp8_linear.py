"""Reference of the W8A16 linear layer: out [M, N] = x [M, K] @ dequantize(weight)[N, K]^T (+ bias).

The twin of ops.triton.layer.fp8_linear: the FP8 weight (moekv.core.fp8.Fp8Weight) dequantized in fp32,
the matmul in fp32 on the widened activations, the bias added in fp32, one rounding to x.dtype.
"""

from __future__ import annotations

import torch

from moekv.core.fp8 import Fp8Weight, fake_quantize_rows


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
               act_fp8: bool = False) -> torch.Tensor:
    """x [M, K], weight Fp8Weight [N, K], bias [N] or None -> [M, N] in x.dtype (fp32 sums). act_fp8 (W8A8): x's
    rows quantized to e4m3 per row first (core.fp8.quantize_rows), as the kernel's A8 path reads them."""
    assert x.dim() == 2 and len(weight.shape) == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    rows = fake_quantize_rows(x) if act_fp8 else x.float()
    out = torch.matmul(rows, weight.dequantize().t())                 # [M, N] fp32
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

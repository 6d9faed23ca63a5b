"""Reference of the batch-invariant GEMM: out [M, N] = x [M, K] @ weight[N, K]^T (+ bias), row by row.

The twin of ops.triton.layer.invariant_linear and the CPU path of the batch-invariant mode
(KernelConfig.batch_invariant). Arithmetic: the weight widened to fp32 (an FP8 weight, moekv.core.fp8.Fp8Weight,
dequantized in fp32), each row's fp32 matrix-vector product, + bias in fp32, one rounding to x.dtype.

Row invariance on the CPU: every row is its own call (`torch.mv` on a fresh fp32 copy of the row, so its
alignment is always the same), so a row's result is the same computation whatever M is and whatever the other
rows hold. What this does not pin down: torch's CPU kernels may sum differently with a different intra-op thread
count (the engine picks the count per step on the CPU, engine/cpu_threads.py: set DeviceConfig.cpu_threads for
a fixed count) or on another machine / torch build. A batched fp32 matmul (one call for all rows) is not used:
oneDNN / MKL choose their blocking, and with it the summation order, by M.
"""

from __future__ import annotations

import torch

from moekv.core.fp8 import Fp8Weight


def invariant_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x [M, K], weight [N, K] (a tensor or an Fp8Weight), bias [N] or None -> [M, N] in x.dtype (fp32 sums)."""
    assert x.dim() == 2 and len(weight.shape) == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    w = weight.dequantize() if isinstance(weight, Fp8Weight) else weight.float()      # [N, K] fp32
    b = None if bias is None else bias.float()                                         # [N]
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)  # [M, N]
    for row in range(x.shape[0]):
        y = torch.mv(w, x[row].float())                                                # [N] fp32
        if b is not None:
            y = y + b
        out[row] = y.to(x.dtype)
    return out

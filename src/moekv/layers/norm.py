"""RMSNorm, computed in fp32 and cast back before the weight multiply (the Hugging Face order)."""

from __future__ import annotations

import torch
from torch import nn

from moekv.layers.linear import empty_parameter


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()                                                  # [..., dim]
        variance = x_fp32.pow(2).mean(-1, keepdim=True)                      # [..., 1]
        normed = (x_fp32 * torch.rsqrt(variance + self.eps)).to(x.dtype)    # [..., dim]
        return self.weight * normed

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[0]}, eps={self.eps}"

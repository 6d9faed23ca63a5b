"""RMSNorm, computed in fp32 and cast back before the weight multiply (the Hugging Face order).

Through ops.dispatch: one Triton kernel on CUDA (optionally fused with the residual add, see
`add_norm`), the PyTorch reference (ops.reference.layers) elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from moekv.layers.experts import UncombinedOutput
from moekv.layers.linear import empty_parameter
from moekv.ops import dispatch


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim]."""
        return dispatch.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor | UncombinedOutput, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + x), residual + x) in one kernel on CUDA; the sum is rounded to the dtype
        before the norm reads it, exactly as `hidden = hidden + x; self(hidden)`. With forward hooks
        on this module (moe.prefetch.predictor's "attn" source) it runs exactly that, so the hooks see
        the sum as the input and the normed tensor as the output. x may be an MoE block's UncombinedOutput
        (KernelConfig.fused_moe_combine): its weighted sum then runs in the same launch (moe_combine_add_rms_norm),
        rounded to the dtype where the block's own combine would have rounded it."""
        if isinstance(x, UncombinedOutput):
            if not (self._forward_hooks or self._forward_pre_hooks):
                return dispatch.moe_combine_add_rms_norm(x.partial, x.topk_weights, residual, self.weight, self.eps)
            x = x.combine()
        if self._forward_hooks or self._forward_pre_hooks:
            hidden = residual + x
            return self(hidden), hidden
        return dispatch.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[0]}, eps={self.eps}"

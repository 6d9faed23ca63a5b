"""Rotary position embedding, "rotate_half" convention (the first and second halves of a head pair up).

Positions come per token ([T], absolute position in its own sequence), so sequences of a batch
never share an offset. cos/sin are computed once per forward and shared by all layers.
"""

from __future__ import annotations

import torch
from torch import nn

from moekv.ops import dispatch
from moekv.ops.reference.layers import apply_rotary, rotate_half  # noqa: F401  (the reference math)


class RotaryEmbedding(nn.Module):
    """inv_freq[i] = theta^(-2i / head_dim); the angle of position p is p * inv_freq."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | str):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        # Computed on the CPU in fp32 exactly as the reference does, then moved. Kept in fp32: never
        # cast the model with .to(dtype) (the loader builds it in its dtype instead).
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim   # [D/2]
        inv_freq = 1.0 / (theta ** exponent)                                             # [D/2]
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, D] in `dtype`."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()    # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)                         # [T, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary_qk(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hkv, D]; cos/sin [T, D] -> both rotated (one kernel on CUDA)."""
    return dispatch.apply_rotary_qk(query, key, cos, sin)

"""Linear and embedding layers whose parameters start uninitialised (the loader fills them).

torch.nn.Linear runs a Kaiming init at construction, which costs minutes for a 47B-parameter
model; these create empty tensors directly in the target dtype and on the target device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.ops import dispatch


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter (inference only: no autograd bookkeeping)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); weight [out, in] as Hugging Face checkpoints store it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dispatch.skinny_gemm_enabled() and x.dim() >= 2 and x.shape[-1] > 0:    # opt-in, MOEKV_SKINNY_GEMM
            out = dispatch.skinny_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)   # [T, out]
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return F.linear(x, self.weight, self.bias)          # [T, out]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    """Token id -> row of weight [vocab, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = empty_parameter(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)          # [T, hidden]

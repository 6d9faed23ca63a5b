"""Linear and embedding layers whose parameters start uninitialised (the loader fills them).

torch.nn.Linear runs a Kaiming init at construction, which costs minutes for a 47B-parameter
model; these create empty tensors directly in the target dtype and on the target device. Inside
`deferred_parameters()` they take no memory at all (the meta device) until `materialize` gives one storage:
the checkpoint loader allocates only what it keeps (an FP8 weight never allocates its 16-bit form).

A Linear may hold its weight in FP8 (`to_fp8`: float8_e4m3fn codes in `weight`, fp32 block scales in
`weight_scale`, moekv.core.fp8); it then runs ops.dispatch.fp8_linear (W8A16).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from moekv.core.fp8 import FP8_DTYPE, Fp8Weight, quantize_fp8
from moekv.errors import ConfigError
from moekv.ops import dispatch


_DEFERRED = threading.local()


@contextmanager
def deferred_parameters():
    """empty_parameter inside this block makes meta parameters (shape and dtype, no storage); buffers are
    unaffected. Give each storage with `materialize` (or replace it, e.g. `to_fp8(..., device=)`)."""
    previous = getattr(_DEFERRED, "on", False)
    _DEFERRED.on = True
    try:
        yield
    finally:
        _DEFERRED.on = previous


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter (inference only: no autograd bookkeeping); on the meta device
    inside deferred_parameters()."""
    if getattr(_DEFERRED, "on", False):
        device = "meta"
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def materialize(module: nn.Module, name: str, device: torch.device) -> nn.Parameter:
    """module's parameter `name`, given uninitialised storage on `device` if it is a meta parameter."""
    param = getattr(module, name)
    if param.is_meta:
        param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
        setattr(module, name, param)
    return param


def has_forward_hooks(*modules: nn.Module | None) -> bool:
    """Whether any of these modules has forward (pre-)hooks: a fused path would skip them, so the layers take
    their unfused path then (the hooks see what they always saw)."""
    return any(m is not None and bool(m._forward_hooks or m._forward_pre_hooks) for m in modules)


class Linear(nn.Module):
    """y = x W^T (+ b); weight [out, in] as Hugging Face checkpoints store it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.weight_scale = None            # FP8 only: [ceil(out / bn), ceil(in / bk)] fp32
        self.weight_block = None            # FP8 only: (bn, bk)

    @property
    def quantized(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    def fp8_weight(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale, self.weight_block)

    def to_fp8(self, weight: Fp8Weight | None = None, device: torch.device | None = None) -> None:
        """Hold the weight in FP8: `weight` (codes and scales read from a checkpoint), or, when None, this
        layer's own weight quantized per output channel. device: where they go (default: the weight's)."""
        if weight is None:
            weight = quantize_fp8(self.weight.data)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ConfigError(f"FP8 weight of shape {list(weight.shape)} for a linear layer of "
                              f"[{self.out_features}, {self.in_features}]")
        device = device if device is not None else self.weight.device
        self.weight = None                                  # free the 16-bit weight first
        self.weight = nn.Parameter(weight.codes.to(device), requires_grad=False)
        self.weight_scale = nn.Parameter(weight.scale.to(device), requires_grad=False)
        self.weight_block = tuple(weight.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dispatch.batch_invariant():            # KernelConfig.batch_invariant: one fixed-tile GEMM for every M
            weight = self.fp8_weight() if self.weight.dtype == FP8_DTYPE else self.weight
            out = dispatch.invariant_linear(x.reshape(-1, x.shape[-1]), weight, self.bias)     # [T, out]
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if self.weight.dtype == FP8_DTYPE:                                            # W8A16
            out = dispatch.fp8_linear(x.reshape(-1, x.shape[-1]), self.fp8_weight(), self.bias)   # [T, out]
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if dispatch.skinny_gemm_enabled() and x.dim() >= 2 and x.shape[-1] > 0:    # opt-in, MOEKV_SKINNY_GEMM
            out = dispatch.skinny_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)   # [T, out]
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return F.linear(x, self.weight, self.bias)          # [T, out]

    def extra_repr(self) -> str:
        fp8 = f", fp8 block={self.weight_block}" if self.weight_block else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{fp8}"


class Embedding(nn.Module):
    """Token id -> row of weight [vocab, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = empty_parameter(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)          # [T, hidden]

"""The single dispatch point for kernels: Triton on CUDA, the pure-PyTorch reference elsewhere.

Force either with `set_backend("reference" | "triton" | "auto")` or the environment variable
MOEKV_OPS_BACKEND. When the reference runs on a CUDA tensor for an op that has a Triton kernel,
a loud warning is printed once per op (it is slow).
"""

from __future__ import annotations

import os
import warnings

import torch

_BACKENDS = ("auto", "reference", "triton")
_backend = os.environ.get("MOEKV_OPS_BACKEND", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"MOEKV_OPS_BACKEND must be one of {_BACKENDS}, got {_backend!r}")
_warned: set[str] = set()


def set_backend(name: str) -> None:
    """Force the kernel backend for every op: "auto" (Triton on CUDA), "reference" or "triton"."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def use_triton(op: str, tensor: torch.Tensor, has_triton: bool = True) -> bool:
    """Decide the path for `op` on `tensor`'s device; warns once when a GPU falls back."""
    if _backend == "triton":
        return True
    if _backend == "reference":
        return False
    if tensor.is_cuda and has_triton and triton_available():
        return True
    if tensor.is_cuda and op not in _warned:
        _warned.add(op)
        warnings.warn(f"moekv: {op} is running the slow pure-PyTorch reference on a CUDA device",
                      RuntimeWarning, stacklevel=3)
    return False


def paged_attention_full_precision(query, key_pages, value_pages, meta, scale):
    """See ops.reference.attention.paged_attention_full_precision."""
    from moekv.ops.reference.attention import paged_attention_full_precision as reference

    return reference(query, key_pages, value_pages, meta, scale)


def moe_experts(hidden, w_gate_up, w_down, topk_ids, topk_weights):
    """See ops.reference.moe.moe_experts_reference (a fused Triton kernel will slot in here)."""
    from moekv.ops.reference.moe import moe_experts_reference as reference

    return reference(hidden, w_gate_up, w_down, topk_ids, topk_weights)

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
    """See ops.reference.attention.paged_attention_full_precision (Triton: ops.triton.attention)."""
    if use_triton("paged_attention_full_precision", query):
        from moekv.ops.triton.attention import paged_attention_full_precision as kernel

        return kernel(query, key_pages, value_pages, meta, scale)
    from moekv.ops.reference.attention import paged_attention_full_precision as reference

    return reference(query, key_pages, value_pages, meta, scale)


def paged_attention_lowbit(query, key, value, key_pages, value_pages, key_spec, value_spec,
                           staging_keys, staging_values, staging_slot_of_page, meta, scale):
    """See ops.reference.lowbit.paged_attention_lowbit (Triton: ops.triton.lowbit_attention)."""
    if use_triton("paged_attention_lowbit", query):
        from moekv.ops.triton import lowbit_attention

        if lowbit_attention.supports(key_spec, value_spec, query):
            return lowbit_attention.paged_attention_lowbit(
                query, key, value, key_pages, value_pages, key_spec, value_spec, staging_keys, staging_values,
                staging_slot_of_page, meta, scale)
        _warn_once("paged_attention_lowbit:unsupported",
                   f"moekv: no Triton low-bit attention for page_size={key_spec.page_size} (needs a power of two "
                   "in [16, 256]); running the reference")
    from moekv.ops.reference.lowbit import paged_attention_lowbit as reference

    return reference(query, key, value, key_pages, value_pages, key_spec, value_spec, staging_keys,
                     staging_values, staging_slot_of_page, meta, scale)


def quantize_pages(x, spec):
    """See ops.reference.lowbit.quantize_pages (Triton: ops.triton.lowbit_quantize)."""
    if use_triton("quantize_pages", x):
        from moekv.ops.triton import lowbit_quantize

        if lowbit_quantize.supports(spec):
            return lowbit_quantize.quantize_pages(x, spec)
        _warn_once("quantize_pages:unsupported",
                   f"moekv: no Triton page quantizer for page_size={spec.page_size}, head_dim={spec.head_dim}; "
                   "running the reference")
    from moekv.ops.reference.lowbit import quantize_pages as reference

    return reference(x, spec)


def quantize_staged_pages(staging, slots, pages, spec, out):
    """See ops.reference.lowbit.quantize_staged_pages (Triton: ops.triton.lowbit_quantize)."""
    if use_triton("quantize_staged_pages", staging):
        from moekv.ops.triton import lowbit_quantize

        if lowbit_quantize.supports(spec):
            return lowbit_quantize.quantize_staged_pages(staging, slots, pages, spec, out)
        _warn_once("quantize_staged_pages:unsupported",
                   f"moekv: no Triton page quantizer for page_size={spec.page_size}, head_dim={spec.head_dim}; "
                   "running the reference")
    from moekv.ops.reference.lowbit import quantize_staged_pages as reference

    return reference(staging, slots, pages, spec, out)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def moe_experts(hidden, w_gate_up, w_down, topk_ids, topk_weights):
    """See ops.reference.moe.moe_experts_reference. Triton: T <= the decode limit of this shape and GPU
    (tuned crossover in ops/triton/moe_configs, default 16 tokens) runs ops.triton.moe_decode (no
    sort, weights read once per step), larger T ops.triton.moe_grouped (device align + grouped GEMM)."""
    if use_triton("moe_experts", hidden):
        from moekv.ops.triton import moe_decode, moe_grouped
        from moekv.ops.triton.moe_configs import decode_max_tokens

        num_experts, two_inter, hidden_size = w_gate_up.shape
        limit = min(decode_max_tokens(num_experts, hidden_size, two_inter // 2, hidden.dtype, hidden.device),
                    moe_decode.MAX_DECODE_TOKENS)
        kernel = moe_decode.moe_experts_decode if hidden.shape[0] <= limit else moe_grouped.moe_experts_grouped
        return kernel(hidden, w_gate_up, w_down, topk_ids, topk_weights)
    from moekv.ops.reference.moe import moe_experts_reference as reference

    return reference(hidden, w_gate_up, w_down, topk_ids, topk_weights)


def moe_align(topk_ids, num_experts, block_m):
    """See ops.reference.moe.moe_align_reference (Triton: ops.triton.moe_align)."""
    if use_triton("moe_align", topk_ids):
        from moekv.ops.triton.moe_align import moe_align as kernel

        return kernel(topk_ids, num_experts, block_m)
    from moekv.ops.reference.moe import moe_align_reference as reference

    return reference(topk_ids, num_experts, block_m)

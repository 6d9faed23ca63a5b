"""The single dispatch point for kernels: Triton on CUDA, the pure-PyTorch reference elsewhere.

Force either with `set_backend("reference" | "triton" | "auto")` or the environment variable
MOEKV_OPS_BACKEND. When the reference runs on a CUDA tensor for an op that has a Triton kernel,
a loud warning is printed once per op (it is slow).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

_BACKENDS = ("auto", "reference", "triton")
_backend = os.environ.get("MOEKV_OPS_BACKEND", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"MOEKV_OPS_BACKEND must be one of {_BACKENDS}, got {_backend!r}")
_warned: set[str] = set()

# Decode-only low-bit attention kernels (one query token per sequence). "auto" takes
# DEFAULT_LOWBIT_DECODE; "v4" keeps the general kernel (lowbit_attention) for decode as well.
# Measured side by side on the H200 by benchmarks/bench_attention.py (docs/attention-kernels.md).
_LOWBIT_DECODE_KERNELS = {
    "tc": ("moekv.ops.triton.lowbit.decode_tc", "paged_attention_lowbit_decode_tc"),     # v5.1
    "tm": ("moekv.ops.triton.lowbit.decode_tm", "paged_attention_lowbit_decode_tm"),     # v6, token-major
    "v4": None,
}
DEFAULT_LOWBIT_DECODE = "tm"          # v6: all its tests pass on the H200; faster than v5.1 at every shape
_lowbit_decode = os.environ.get("MOEKV_LOWBIT_DECODE", "auto")
if _lowbit_decode not in (*_LOWBIT_DECODE_KERNELS, "auto"):
    raise ValueError(f"MOEKV_LOWBIT_DECODE must be auto or one of {tuple(_LOWBIT_DECODE_KERNELS)}, "
                     f"got {_lowbit_decode!r}")


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


def set_lowbit_decode(name: str) -> None:
    """Pick the low-bit decode kernel: "auto", "tc" (decode-only, tensor cores), "tm" (decode-only,
    token-major) or "v4" (the general kernel)."""
    global _lowbit_decode
    if name not in (*_LOWBIT_DECODE_KERNELS, "auto"):
        raise ValueError(f"low-bit decode kernel must be auto or one of {tuple(_LOWBIT_DECODE_KERNELS)}, got {name!r}")
    _lowbit_decode = name


def lowbit_decode_kernel(key_spec, value_spec, head_dim: int):
    """The decode-only kernel function chosen for this format, or None (use the general kernel)."""
    return _lowbit_decode_kernel(DEFAULT_LOWBIT_DECODE if _lowbit_decode == "auto" else _lowbit_decode,
                                 key_spec, value_spec, head_dim)


@functools.lru_cache(maxsize=None)
def _lowbit_decode_kernel(name: str, key_spec, value_spec, head_dim: int):
    """Cached per (choice, format): an eager decode step asks once per layer."""
    import importlib

    target = _LOWBIT_DECODE_KERNELS[name]
    if target is None:
        return None
    module = importlib.import_module(target[0])
    if not module.supports(key_spec, value_spec, head_dim):
        return None
    return getattr(module, target[1])


def paged_attention_full_precision(query, key_pages, value_pages, meta, scale):
    """See ops.reference.attention.paged_attention_full_precision (Triton: ops.triton.attention.full_precision)."""
    if use_triton("paged_attention_full_precision", query):
        from moekv.ops.triton.attention.full_precision import paged_attention_full_precision as kernel

        return kernel(query, key_pages, value_pages, meta, scale)
    from moekv.ops.reference.attention import paged_attention_full_precision as reference

    return reference(query, key_pages, value_pages, meta, scale)


def paged_attention_lowbit(query, key, value, key_pages, value_pages, key_spec, value_spec,
                           staging_keys, staging_values, staging_slot_of_page, meta, scale):
    """See ops.reference.lowbit.paged_attention_lowbit (Triton: ops.triton.lowbit.attention)."""
    if use_triton("paged_attention_lowbit", query):
        from moekv.ops.triton.lowbit import attention as lowbit_attention

        decode = lowbit_decode_kernel(key_spec, value_spec, query.shape[-1]) if meta.is_decode else None
        if decode is not None and query.shape[0] == meta.num_seqs:
            return decode(query, key, value, key_pages, value_pages, key_spec, value_spec, staging_keys,
                          staging_values, staging_slot_of_page, meta, scale)
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
    """See ops.reference.lowbit.quantize_pages (Triton: ops.triton.lowbit.quantize)."""
    if use_triton("quantize_pages", x):
        from moekv.ops.triton.lowbit import quantize as lowbit_quantize

        if lowbit_quantize.supports(spec):
            return lowbit_quantize.quantize_pages(x, spec)
        _warn_once("quantize_pages:unsupported",
                   f"moekv: no Triton page quantizer for page_size={spec.page_size}, head_dim={spec.head_dim}; "
                   "running the reference")
    from moekv.ops.reference.lowbit import quantize_pages as reference

    return reference(x, spec)


def quantize_staged_pages(staging, slots, pages, spec, out):
    """See ops.reference.lowbit.quantize_staged_pages (Triton: ops.triton.lowbit.quantize)."""
    if use_triton("quantize_staged_pages", staging):
        from moekv.ops.triton.lowbit import quantize as lowbit_quantize

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


def moe_experts(hidden, w_gate_up, w_down, topk_ids, topk_weights, out_dtype=None):
    """See ops.reference.moe.moe_experts_reference. Triton: T <= the decode limit of this shape and GPU
    (tuned crossover in ops/triton/moe/configs, default 16 tokens) runs ops.triton.moe.decode (no
    sort, weights read once per step), larger T ops.triton.moe.grouped (device align + grouped GEMM).
    out_dtype: the output's dtype (None: hidden's); torch.float32 returns the fp32 weighted sum unrounded."""
    if use_triton("moe_experts", hidden):
        from moekv.ops.triton.moe import decode as moe_decode
        from moekv.ops.triton.moe import grouped as moe_grouped
        from moekv.ops.triton.moe.configs import decode_max_tokens

        num_experts, two_inter, hidden_size = w_gate_up.shape
        limit = min(decode_max_tokens(num_experts, hidden_size, two_inter // 2, hidden.dtype, hidden.device),
                    moe_decode.MAX_DECODE_TOKENS)
        kernel = moe_decode.moe_experts_decode if hidden.shape[0] <= limit else moe_grouped.moe_experts_grouped
        return kernel(hidden, w_gate_up, w_down, topk_ids, topk_weights, out_dtype=out_dtype)
    from moekv.ops.reference.moe import moe_experts_reference as reference

    return reference(hidden, w_gate_up, w_down, topk_ids, topk_weights, out_dtype=out_dtype)


def ep_local_routing(table, codes, weights, top_k):
    """See ops.reference.ep_routing (Triton: ops.triton.moe.ep_routing, one launch instead of five)."""
    if use_triton("ep_local_routing", codes):
        from moekv.ops.triton.moe import ep_routing

        if ep_routing.supports(codes, top_k):
            return ep_routing.ep_local_routing(table, codes, weights, top_k)
        _warn_once("ep_local_routing:unsupported", f"moekv: no Triton EP routing for {tuple(codes.shape)}; "
                   "running the reference")
    from moekv.ops.reference.ep_routing import ep_local_routing as reference

    return reference(table, codes, weights, top_k)


def moe_align(topk_ids, num_experts, block_m):
    """See ops.reference.moe.moe_align_reference (Triton: ops.triton.moe.align)."""
    if use_triton("moe_align", topk_ids):
        from moekv.ops.triton.moe.align import moe_align as kernel

        return kernel(topk_ids, num_experts, block_m)
    from moekv.ops.reference.moe import moe_align_reference as reference

    return reference(topk_ids, num_experts, block_m)


def stage_decode_tokens(key, value, staging_keys, staging_values, stage_rows, flags, key_out, value_out):
    """See ops.reference.lowbit.stage_decode_tokens (Triton: ops.triton.lowbit.stage)."""
    if use_triton("stage_decode_tokens", key):
        from moekv.ops.triton.lowbit.stage import stage_decode_tokens as kernel

        return kernel(key, value, staging_keys, staging_values, stage_rows, flags, key_out, value_out)
    from moekv.ops.reference.lowbit import stage_decode_tokens as reference

    return reference(key, value, staging_keys, staging_values, stage_rows, flags, key_out, value_out)


def quantize_staged_pages_counted(staging, slots, pages, spec, out, counters, budget_index, outliers_index,
                                  qualifying_index, pages_index=-1):
    """See ops.reference.lowbit.quantize_staged_pages_counted (Triton: ops.triton.lowbit.quantize)."""
    if use_triton("quantize_staged_pages", staging):
        from moekv.ops.triton.lowbit import quantize as lowbit_quantize

        if lowbit_quantize.supports(spec):
            return lowbit_quantize.quantize_staged_pages_counted(staging, slots, pages, spec, out, counters,
                                                                 budget_index, outliers_index, qualifying_index,
                                                                 pages_index)
        _warn_once("quantize_staged_pages:unsupported",
                   f"moekv: no Triton page quantizer for page_size={spec.page_size}, head_dim={spec.head_dim}; "
                   "running the reference")
    from moekv.ops.reference.lowbit import quantize_staged_pages_counted as reference

    return reference(staging, slots, pages, spec, out, counters, budget_index, outliers_index, qualifying_index,
                     pages_index)


# The fused per-layer ops (RMSNorm, add + RMSNorm, rotary, routing) are the CUDA default since their
# H200 run of 2026-11-30 (benchmarks/results/logs/layer-ops-h200.log): tests/ops/test_layer_kernels.py and
# tests/models/test_model_cuda.py pass, rotary bit-equal in every dtype (launched without FMA
# contraction, see ops.triton.layer.rotary), whole models bit-identical to the torch ops in bf16 and within
# 2.4e-7 of the logit scale in fp32. MOEKV_FUSED_LAYER_OPS=0 (or set_fused_layer_ops(False)) returns to
# the torch ops; a forced backend ("triton" / "reference") applies to them as to every op.
_fused_layer_ops = os.environ.get("MOEKV_FUSED_LAYER_OPS", "1") != "0"


def set_fused_layer_ops(enabled: bool) -> None:
    """Use the Triton per-layer kernels on CUDA under the "auto" backend (default on, see above)."""
    global _fused_layer_ops
    _fused_layer_ops = bool(enabled)


def _layer_op_triton(op: str, tensor: torch.Tensor) -> bool:
    if _backend != "auto":
        return _backend == "triton"
    return _fused_layer_ops and use_triton(op, tensor)


def rms_norm(x, weight, eps):
    """See ops.reference.layers.rms_norm (Triton: ops.triton.layer.norm, one row per program)."""
    if _layer_op_triton("rms_norm", x):
        from moekv.ops.triton.layer import norm

        if norm.supports(x, weight):
            return norm.rms_norm(x, weight, eps)
        _warn_once("rms_norm:unsupported", f"moekv: no Triton RMSNorm for shape {tuple(x.shape)} / "
                   f"{x.dtype}, weight {weight.dtype}; running the reference")
    from moekv.ops.reference.layers import rms_norm as reference

    return reference(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    """See ops.reference.layers.fused_add_rms_norm -> (normed, residual + x) (Triton: ops.triton.layer.norm)."""
    if _layer_op_triton("fused_add_rms_norm", x):
        from moekv.ops.triton.layer import norm

        if norm.supports(x, weight, residual):
            return norm.fused_add_rms_norm(x, residual, weight, eps)
        _warn_once("fused_add_rms_norm:unsupported", f"moekv: no Triton fused add + RMSNorm for shape "
                   f"{tuple(x.shape)} / {x.dtype}, residual {residual.dtype}; running the reference")
    from moekv.ops.reference.layers import fused_add_rms_norm as reference

    return reference(x, residual, weight, eps)


def apply_rotary_qk(query, key, cos, sin):
    """See ops.reference.layers.apply_rotary_qk (Triton: ops.triton.layer.rotary, q and k in one launch)."""
    if _layer_op_triton("apply_rotary_qk", query):
        from moekv.ops.triton.layer import rotary

        if rotary.supports(query, key, cos, sin):
            return rotary.apply_rotary_qk(query, key, cos, sin)
        _warn_once("apply_rotary_qk:unsupported", f"moekv: no Triton rotary for q {tuple(query.shape)} "
                   f"{query.dtype}, cos {tuple(cos.shape)} {cos.dtype}; running the reference")
    from moekv.ops.reference.layers import apply_rotary_qk as reference

    return reference(query, key, cos, sin)


def route_topk(logits, top_k, renormalize, expert_load=None, token_valid=None):
    """See ops.reference.layers.route_topk (Triton: ops.triton.layer.routing: softmax, top-k, renormalisation
    and the expert-load count in one launch; ties go to the lowest expert index)."""
    if _layer_op_triton("route_topk", logits):
        from moekv.ops.triton.layer import routing

        if routing.supports(logits, top_k, expert_load):
            return routing.route_topk(logits, top_k, renormalize, expert_load, token_valid)
        _warn_once("route_topk:unsupported", f"moekv: no Triton routing for logits {tuple(logits.shape)}, "
                   f"top_k={top_k}; running the reference")
    from moekv.ops.reference.layers import route_topk as reference

    return reference(logits, top_k, renormalize, expert_load, token_valid)


def quantize_staged_kv_counted(staging_keys, staging_values, slots, pages, key_spec, value_spec, key_out, value_out,
                               counters, key_counters, value_counters):
    """See ops.reference.lowbit.quantize_staged_kv_counted (Triton: ops.triton.lowbit.quantize, one launch)."""
    if use_triton("quantize_staged_pages", staging_keys):
        from moekv.ops.triton.lowbit import quantize as lowbit_quantize

        if lowbit_quantize.supports(key_spec) and lowbit_quantize.supports(value_spec):
            return lowbit_quantize.quantize_staged_kv_counted(staging_keys, staging_values, slots, pages, key_spec,
                                                              value_spec, key_out, value_out, counters,
                                                              key_counters, value_counters)
    for staging, spec, out, indices in ((staging_keys, key_spec, key_out, key_counters),
                                        (staging_values, value_spec, value_out, value_counters)):
        quantize_staged_pages_counted(staging, slots, pages, spec, out, counters, *indices)


# Skinny GEMM for the dense projections at decode sizes: the weight-streaming kernel of
# ops.triton.layer.skinny_gemm instead of cuBLAS. OPT-IN (default off): alone, its "fma" variant at one row takes
# 0.32-0.96x of cuBLAS's time on all six Mixtral-8x7B projections (qkv 0.84x, o 0.80x, lm_head 0.96x, router
# 0.32x; benchmarks/results/gemv-h200.md); from M = 2 the "dot" variant is not faster than cuBLAS. The one
# end-to-end batch-1 decode run with it (no gain: graph replay 8.56 vs 8.52 ms) went through the "dot"
# variant at M = 1 too (skinny_gemm's default then; it now picks "fma" there): re-measure before turning
# it on (docs/gpu-runbook.md). MOEKV_SKINNY_GEMM=auto / set_skinny_gemm(True, max_rows=1): one-row inputs
# only; =1: every M <= 16. A forced "reference" backend keeps F.linear, a forced "triton" backend also runs
# the kernel on CPU tensors (the interpreter).
SKINNY_GEMM_MAX_ROWS = 16
SKINNY_GEMM_AUTO_ROWS = 1
_skinny_env = os.environ.get("MOEKV_SKINNY_GEMM", "0")
if _skinny_env not in ("0", "1", "auto"):
    raise ValueError(f"MOEKV_SKINNY_GEMM must be 0, 1 or auto, got {_skinny_env!r}")
_skinny_gemm = _skinny_env != "0"
_skinny_rows = SKINNY_GEMM_AUTO_ROWS if _skinny_env == "auto" else SKINNY_GEMM_MAX_ROWS


def set_skinny_gemm(enabled: bool, max_rows: int = SKINNY_GEMM_MAX_ROWS) -> None:
    """Route linear layers of up to `max_rows` rows (<= 16) to the Triton skinny GEMM, or none (default off,
    see above)."""
    global _skinny_gemm, _skinny_rows
    if not 1 <= max_rows <= SKINNY_GEMM_MAX_ROWS:
        raise ValueError(f"max_rows must be in 1..{SKINNY_GEMM_MAX_ROWS}, got {max_rows}")
    _skinny_gemm, _skinny_rows = bool(enabled), max_rows


def skinny_gemm_enabled() -> bool:
    return _skinny_gemm


def skinny_gemm_max_rows() -> int:
    """The row limit of the skinny GEMM when on (1 with MOEKV_SKINNY_GEMM=auto, 16 otherwise)."""
    return _skinny_rows


def skinny_linear(x, weight, bias=None):
    """F.linear(x [M, K], weight [N, K], bias [N] | None) -> [M, N]. With the skinny GEMM on and
    1 <= M <= its row limit on CUDA, fp16 / bf16, shapes ops.triton.layer.skinny_gemm.supports: that kernel (fp32 sums,
    bias in fp32, one rounding: see ops.reference.skinny_gemm for how close to cuBLAS). Decided from
    shapes, dtypes and devices only: no host reads, CUDA-graph safe."""
    if (_skinny_gemm and _backend != "reference" and x.dim() == 2 and 1 <= x.shape[0] <= _skinny_rows
            and x.dtype in (torch.float16, torch.bfloat16) and (x.is_cuda or _backend == "triton")
            and triton_available()):
        from moekv.ops.triton.layer import skinny_gemm

        if skinny_gemm.supports(x, weight, bias):
            return skinny_gemm.skinny_gemm(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)

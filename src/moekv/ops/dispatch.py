"""The single dispatch point for kernels: Triton on CUDA, the pure-PyTorch reference elsewhere.

Every op is a row of `OPS` (built in ops/op_table.py): its reference twin, its kernel and what the kernel supports;
one generic call-through (`_call`) picks the path. Which path is decided by the active `KernelConfig`
(`config.py`), kept in ops/kernel_state.py: the engine installs its `EngineConfig.kernels` (`install`), whose
defaults the MOEKV_* variables override (`KernelConfig.from_env`, read once, at import for code that runs
without an engine); `override(...)` changes fields for a `with` block (tests, benchmarks). When the
reference runs on a CUDA tensor for an op that has a Triton kernel, a loud warning is printed once
per op (it is slow).
"""

from __future__ import annotations

import sys
import warnings

import torch

from moekv.core.fp8 import Fp8Weight
from moekv.ops import choices, kernel_state, op_table
from moekv.ops.kernel_state import (batch_invariant, get_backend, install, installed_config,  # noqa: F401
                                    kernel_config, override, skinny_gemm_enabled, skinny_gemm_max_rows)
from moekv.ops.choices import DEFAULT_LOWBIT_DECODE, LOWBIT_DECODE_KERNELS, moe_expert_passes  # noqa: F401
from moekv.ops.op_table import Op

_TRI = "moekv.ops.triton."
_REF = "moekv.ops.reference."

_warned: set[str] = set()


# -- the active kernel configuration (ops/kernel_state.py) ------------------------------------------
# -- path decisions ----------------------------------------------------------------------------------
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def use_triton(op: str, tensor: torch.Tensor, has_triton: bool = True) -> bool:
    """Decide the path for `op` on `tensor`'s device; warns once when a GPU falls back."""
    backend = kernel_state.active().backend
    if backend == "triton":
        return True
    if backend == "reference":
        return False
    if tensor.is_cuda and has_triton and triton_available():
        return True
    if tensor.is_cuda and op not in _warned:
        _warned.add(op)
        warnings.warn(f"moekv: {op} is running the slow pure-PyTorch reference on a CUDA device",
                      RuntimeWarning, stacklevel=4)
    return False


def _layer_op_triton(op: str, tensor: torch.Tensor) -> bool:
    """The fused per-layer ops follow KernelConfig.fused_layer_ops under the "auto" backend."""
    if kernel_state.active().backend != "auto":
        return kernel_state.active().backend == "triton"
    return kernel_state.active().fused_layer_ops and use_triton(op, tensor)


def _skinny_triton(op: str, x: torch.Tensor) -> bool:
    """Skinny GEMM: opt-in, 1 <= M <= its row limit, fp16 / bf16, CUDA (or a forced "triton" backend)."""
    backend = kernel_state.active().backend
    return (kernel_state.active().skinny_gemm_rows > 0 and backend != "reference" and x.dim() == 2
            and 1 <= x.shape[0] <= kernel_state.active().skinny_gemm_rows and x.dtype in (torch.float16, torch.bfloat16)
            and (x.is_cuda or backend == "triton") and triton_available())


def fused_decode_layer() -> bool:
    """Whether the model runs its cross-op fusions (add_rms_norm_route, qk_norm_rotary_write): KernelConfig's
    fused_decode_layer together with fused_layer_ops. Their kernels then run where the other layer ops' do (CUDA
    under "auto"); elsewhere their reference twins, the same math as the unfused ops. Off in the batch-invariant
    mode: they apply up to a token count (KernelConfig.FUSED_ROUTER_MAX_TOKENS) or to some steps only, so a row
    would take another path in a larger step; the unfused per-row kernels run for every T instead."""
    return kernel_state.active().fused_decode_layer and kernel_state.active().fused_layer_ops and not kernel_state.active().batch_invariant


def fused_moe_combine() -> bool:
    """Whether an MoE block on the decode kernels hands its un-combined expert outputs to the next residual add +
    RMSNorm (moe_combine_add_rms_norm: one launch fewer per MoE layer): KernelConfig.fused_moe_combine, on top of
    fused_decode_layer (and so of fused_layer_ops). Off by default until a GPU run measures it."""
    return kernel_state.active().fused_moe_combine and fused_decode_layer()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def lowbit_decode_kernel(key_spec, value_spec, query, staging_keys):
    """The decode-only kernel function chosen for this format, dtype and device, or None (the general kernel)."""
    return choices.lowbit_decode_kernel(kernel_state.active().lowbit_decode, key_spec, value_spec, query, staging_keys)


def moe_experts_path(hidden: torch.Tensor, num_experts: int, inter: int, weights: tuple | None = None) -> str:
    """The path moe_experts takes for hidden [T, H] over num_experts experts of intermediate size inter:
    "reference", "decode" or "grouped" (the MoE prefetch compute asks this for the resident shape).
    weights: the (w_gate_up, w_down) it will read, when they may be FP8 (their format and whether the
    kernels tile their scale blocks decide too); None: 16-bit."""
    if not use_triton("moe_experts", hidden):
        return "reference"
    fmt = None
    if weights is not None:
        if not choices.resolve(_TRI + "moe.decode:supports")(*weights):
            return "reference"
        fmt = choices.resolve(_TRI + "moe.decode:weight_format")(weights[0])
    if kernel_state.active().batch_invariant:                 # one path for every T (the decode / grouped crossover is by T)
        return "grouped"
    return choices.moe_kernel_path(hidden, num_experts, inter, fmt)


# -- the table (ops/op_table.py, its pickers bound to this module) -------------------------------------
OPS: dict[str, Op] = op_table.build(sys.modules[__name__])


def _call(name: str, *args, **kwargs):
    """Run op `name`: its kernel when the gate says so and the kernel takes these arguments, else its
    reference (with a one-time warning where the kernel was wanted but cannot take them)."""
    op = OPS[name]
    tensor = args[op.tensor_arg]
    if op.gate == "kernel":
        wanted = use_triton(name, tensor)
    elif op.gate == "layer":
        wanted = _layer_op_triton(name, tensor)
    else:
        wanted = _skinny_triton(name, tensor)
    if wanted:
        if callable(op.kernel):
            kernel = op.kernel(*args, **kwargs)
        elif op.supports is None or op.supports(choices.resolve(op.kernel.partition(":")[0]), *args, **kwargs):
            kernel = choices.resolve(op.kernel)
        else:
            kernel = None
        if kernel is not None:
            return kernel(*args, **kwargs)
        if op.unsupported is not None:
            _warn_once(f"{name}:unsupported", op.unsupported(*args, **kwargs))
    elif op.cpu is not None and kernel_state.active().backend == "auto" and tensor.device.type == "cpu":
        return choices.resolve(op.cpu)(*args, **kwargs)
    reference = op.reference if callable(op.reference) else choices.resolve(op.reference)
    return reference(*args, **kwargs)


# -- the ops (signatures: their reference twins in ops/reference/) ------------------------------------
def paged_attention_full_precision(query, key_pages, value_pages, meta, scale):
    """See ops.reference.attention.paged_attention_full_precision (Triton: ops.triton.attention; in the
    batch-invariant mode its fixed-split arithmetic, elsewhere ops.reference.attention.paged_attention_rowwise)."""
    if kernel_state.active().batch_invariant and not use_triton("paged_attention_full_precision", query):
        return choices.resolve(_REF + "attention:paged_attention_rowwise")(query, key_pages, value_pages, meta, scale)
    return _call("paged_attention_full_precision", query, key_pages, value_pages, meta, scale)


def paged_attention_lowbit(query, key, value, key_pages, value_pages, key_spec, value_spec,
                           staging_keys, staging_values, staging_block_map, meta, scale):
    """See ops.reference.lowbit.paged_attention_lowbit (Triton: the decode kernel of LOWBIT_DECODE_KERNELS for
    decode steps, else ops.triton.lowbit.attention)."""
    return _call("paged_attention_lowbit", query, key, value, key_pages, value_pages, key_spec, value_spec,
                 staging_keys, staging_values, staging_block_map, meta, scale)


def quantize_pages(x, spec):
    """See ops.reference.lowbit.quantize_pages (Triton: ops.triton.lowbit.quantize)."""
    return _call("quantize_pages", x, spec)


def quantize_staged_pages(staging, slots, pages, spec, out):
    """See ops.reference.lowbit.quantize_staged_pages (Triton: ops.triton.lowbit.quantize)."""
    return _call("quantize_staged_pages", staging, slots, pages, spec, out)


def quantize_staged_pages_counted(staging, slots, pages, spec, out, counters, budget_index, outliers_index,
                                  qualifying_index, pages_index=-1):
    """See ops.reference.lowbit.quantize_staged_pages_counted (Triton: ops.triton.lowbit.quantize)."""
    return _call("quantize_staged_pages_counted", staging, slots, pages, spec, out, counters, budget_index,
                 outliers_index, qualifying_index, pages_index)


def quantize_staged_kv_counted(staging_keys, staging_values, slots, pages, key_spec, value_spec, key_out, value_out,
                               counters, key_counters, value_counters):
    """See ops.reference.lowbit.quantize_staged_kv_counted (Triton: ops.triton.lowbit.quantize, one launch;
    otherwise quantize_staged_pages_counted per side)."""
    return _call("quantize_staged_kv_counted", staging_keys, staging_values, slots, pages, key_spec, value_spec,
                 key_out, value_out, counters, key_counters, value_counters)


def quantize_staged_kv_counted_layers(staging_keys, staging_values, slots, pages, key_spec, value_spec, key_out,
                                      value_out, counters, key_counters, value_counters):
    """See ops.reference.lowbit.quantize_staged_kv_counted_layers: every layer's quantize_staged_kv_counted
    (Triton: ops.triton.lowbit.quantize, one launch for all layers; otherwise one dispatched call per layer)."""
    return _call("quantize_staged_kv_counted_layers", staging_keys, staging_values, slots, pages, key_spec,
                 value_spec, key_out, value_out, counters, key_counters, value_counters)


def stage_decode_tokens(key, value, staging_keys, staging_values, stage_rows, flags, key_out, value_out):
    """See ops.reference.lowbit.stage_decode_tokens (Triton: ops.triton.lowbit.stage)."""
    return _call("stage_decode_tokens", key, value, staging_keys, staging_values, stage_rows, flags, key_out,
                 value_out)


def moe_experts(hidden, w_gate_up, w_down, topk_ids, topk_weights, out_dtype=None):
    """See ops.reference.moe.moe_experts_reference. Triton (moe_experts_path): T <= the decode limit runs
    ops.triton.moe.decode (no sort, weights read once per step), larger T ops.triton.moe.grouped (device
    align + grouped GEMM). out_dtype: the output's dtype (None: hidden's); torch.float32 returns the fp32
    weighted sum unrounded. w_gate_up / w_down: tensors, or both moekv.core.fp8.Fp8Weight (W8A16; W8A8 on the
    grouped kernel from KernelConfig.w8a8_min_tokens tokens: `w8a8`).
    Batch-invariant mode: the grouped path with one launch config for every T (moe.configs.BATCH_INVARIANT_CONFIG),
    elsewhere ops.reference.moe.moe_experts_rowwise."""
    if kernel_state.active().batch_invariant and not use_triton("moe_experts", hidden):
        return choices.resolve(_REF + "moe:moe_experts_rowwise")(hidden, w_gate_up, w_down, topk_ids, topk_weights,
                                                                 out_dtype=out_dtype)
    if w8a8(hidden, w_gate_up, w_down):          # KernelConfig.w8a8_min_tokens: the grouped kernel, fp8 x fp8 dots
        return _call("moe_experts", hidden, w_gate_up, w_down, topk_ids, topk_weights, out_dtype=out_dtype,
                     act_fp8=True)
    return _call("moe_experts", hidden, w_gate_up, w_down, topk_ids, topk_weights, out_dtype=out_dtype)


def w8a8(hidden, w_gate_up, w_down) -> bool:
    """Whether moe_experts (fp8_linear: w_gate_up = w_down = its weight) quantizes this call's activations (W8A8):
    FP8 weights, at least KernelConfig.w8a8_min_tokens (> 0) rows, not in batch-invariant mode."""
    minimum = kernel_state.active().w8a8_min_tokens
    return (minimum > 0 and hidden.shape[0] >= minimum and not kernel_state.active().batch_invariant
            and isinstance(w_gate_up, Fp8Weight) and isinstance(w_down, Fp8Weight))


def moe_expert_partials(hidden, w_gate_up, w_down, topk_ids):
    """The routed experts' outputs per token-slot, not yet weighted or summed: [S, T*k, H] fp32 (the decode path's
    K-split partial sums; see ops.reference.moe_combine.moe_expert_partials, one split). Triton:
    ops.triton.moe.decode's first two launches, for T <= its MAX_DECODE_TOKENS."""
    return _call("moe_expert_partials", hidden, w_gate_up, w_down, topk_ids)


def moe_combine(partial, topk_weights, dtype):
    """sum_j topk_weights[t, j] * sum_s partial[s, t*k + j] -> [T, H] in dtype, fp32 sums in a fixed order: see
    ops.reference.moe_combine.moe_combine (Triton: ops.triton.moe.decode's combine kernel, bit for bit the same)."""
    return _call("moe_combine", partial, topk_weights, dtype)


def moe_combine_add_rms_norm(partial, topk_weights, residual, norm_weight, eps):
    """(rms_norm(residual + x), residual + x) with x = moe_combine(partial, topk_weights, residual.dtype): see
    ops.reference.moe_combine.moe_combine_add_rms_norm (Triton: ops.triton.layer.combine_norm, one launch; shapes
    it does not take run moe_combine and fused_add_rms_norm of this module)."""
    return _call("moe_combine_add_rms_norm", partial, topk_weights, residual, norm_weight, eps)


def fp8_linear(x, weight, bias=None):
    """x [M, K] @ dequantize(weight)[N, K]^T (+ bias) for an FP8 weight (moekv.core.fp8.Fp8Weight): see
    ops.reference.fp8_linear (Triton: ops.triton.layer.fp8_linear, W8A16, the codes widened in registers; W8A8
    from KernelConfig.w8a8_min_tokens rows, as moe_experts)."""
    if w8a8(x, weight, weight):
        return _call("fp8_linear", x, weight, bias, act_fp8=True)
    return _call("fp8_linear", x, weight, bias)


def stage_expert_copies(src, dst, src_ids, dst_ids):
    """dst[dst_ids[m]] = src[src_ids[m]] for the entries with src_ids[m] >= 0, the list on the device: see
    ops.reference.moe_stage (Triton: ops.triton.moe.stage, reading pinned host memory from the device)."""
    return _call("stage_expert_copies", src, dst, src_ids, dst_ids)


def moe_align(topk_ids, num_experts, block_m):
    """See ops.reference.moe.moe_align_reference (Triton: ops.triton.moe.align)."""
    return _call("moe_align", topk_ids, num_experts, block_m)


def ep_local_routing(table, codes, weights, top_k):
    """See ops.reference.ep_routing (Triton: ops.triton.moe.ep_routing, one launch instead of five)."""
    return _call("ep_local_routing", table, codes, weights, top_k)


# The fused per-layer ops (RMSNorm, add + RMSNorm, rotary, routing) are the CUDA default since their H200
# run of 2026-11-30 (benchmarks/results/logs/layer-ops-h200.log): bit-identical whole models in bf16, within
# 2.4e-7 of the logit scale in fp32 (rotary launched without FMA contraction, see ops.triton.layer.rotary).
# KernelConfig(fused_layer_ops=False) / MOEKV_FUSED_LAYER_OPS=0 returns to the torch ops; a forced
# backend ("triton" / "reference") applies to them as to every op.
def rms_norm(x, weight, eps):
    """See ops.reference.layers.rms_norm (Triton: ops.triton.layer.norm, one row per program)."""
    return _call("rms_norm", x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    """See ops.reference.layers.fused_add_rms_norm -> (normed, residual + x) (Triton: ops.triton.layer.norm)."""
    return _call("fused_add_rms_norm", x, residual, weight, eps)


def apply_rotary_qk(query, key, cos, sin):
    """See ops.reference.layers.apply_rotary_qk (Triton: ops.triton.layer.rotary, q and k in one launch)."""
    return _call("apply_rotary_qk", query, key, cos, sin)


def route_topk(logits, top_k, renormalize, expert_load=None, token_valid=None):
    """See ops.reference.layers.route_topk (Triton: ops.triton.layer.routing: softmax, top-k, renormalisation
    and the expert-load count in one launch; ties go to the lowest expert index)."""
    return _call("route_topk", logits, top_k, renormalize, expert_load, token_valid)


def add_rms_norm_route(x, residual, norm_weight, eps, router_weight, top_k, renormalize, expert_load=None,
                       token_valid=None, logits_out=None, route_counters=None):
    """See ops.reference.layers.add_rms_norm_route -> (normed, residual + x, weights, ids) (Triton:
    ops.triton.layer.norm_route, one launch with the routing for routers up to its per-program size; larger ones
    are routed in the same launch by each token's last program with route_counters ([>= T] int32 zeros, the MoE
    block's) and KernelConfig.fused_route_fold on, else by a second launch; shapes it does not take run
    fused_add_rms_norm, skinny_linear and route_topk of this module)."""
    if not kernel_state.active().fused_route_fold:
        route_counters = None
    return _call("add_rms_norm_route", x, residual, norm_weight, eps, router_weight, top_k, renormalize, expert_load,
                 token_valid, logits_out, route_counters)


def qk_norm_rotary_write(query, key, value, cos, sin, key_cache=None, value_cache=None, slots=None,
                         q_norm_weight=None, k_norm_weight=None, eps=1e-6, clip=None, flags=None, key_copy=None,
                         value_copy=None):
    """See ops.reference.layers.qk_norm_rotary_write -> (rotated query, rotated key), the key and value written to
    the cache rows when given, checked for non-finite values with flags (Triton: ops.triton.layer.rotary_write,
    one launch; shapes it does not take run rms_norm, apply_rotary_qk and stage_decode_tokens of this module)."""
    return _call("qk_norm_rotary_write", query, key, value, cos, sin, key_cache, value_cache, slots, q_norm_weight,
                 k_norm_weight, eps, clip, flags, key_copy, value_copy)


def skinny_linear(x, weight, bias=None):
    """F.linear(x [M, K], weight [N, K], bias [N] | None) -> [M, N]. With the skinny GEMM on
    (KernelConfig.skinny_gemm_rows, opt-in: see config.py) and 1 <= M <= its row limit on CUDA, fp16 / bf16,
    shapes ops.triton.layer.skinny_gemm.supports: that kernel (fp32 sums, bias in fp32, one rounding: see
    ops.reference.skinny_gemm for how close to cuBLAS). Decided from shapes, dtypes and devices only: no host
    reads, CUDA-graph safe. Batch-invariant mode: invariant_linear instead, for every M."""
    if kernel_state.active().batch_invariant:
        return _call("invariant_linear", x, weight, bias)
    return _call("skinny_linear", x, weight, bias)


def invariant_linear(x, weight, bias=None):
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N] with row r depending on row r of x alone (the linear layers'
    GEMM in the batch-invariant mode, KernelConfig.batch_invariant): ops.triton.layer.invariant_linear, one fixed
    launch shape for every M; weight a tensor or an FP8 weight (moekv.core.fp8.Fp8Weight). Elsewhere (CPU) its twin
    ops.reference.invariant_linear, row by row."""
    return _call("invariant_linear", x, weight, bias)

"""ops.dispatch's table of ops: each op's reference twin, its kernel and what the kernel supports (`Op`, `build`).

A kernel is a "module:function" target or a picker: a callable of the op's arguments returning the kernel function
or None (the reference then). Some pickers read the active KernelConfig or fall back on ops.dispatch's own unfused
ops (e.g. add_rms_norm_route composed from fused_add_rms_norm, skinny_linear and route_topk where the one-launch
kernel does not take the shapes). So ops.dispatch builds the table with itself as `ops` (`build(ops)`): this module
imports nothing of dispatch (no import cycle), and the pickers look `ops.<name>` up when they run, so a test's
monkeypatch of a dispatch function reaches them as it would inside dispatch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from moekv.ops import choices
from moekv.ops.reference.layers import compose_add_rms_norm_route, compose_qk_norm_rotary_write
from moekv.ops.reference.moe_combine import compose_moe_combine_add_rms_norm

_REF, _TRI = "moekv.ops.reference.", "moekv.ops.triton."


@dataclass(frozen=True)
class Op:
    """One op: reference twin and kernel ("module:function", or a callable), what the kernel supports.

    kernel: a target string, or a callable of the op's arguments returning the kernel function or None.
    supports: (kernel module, *op args) -> bool, for a target-string kernel; None: everything.
    gate: "kernel" (use_triton), "layer" (also KernelConfig.fused_layer_ops), "skinny" (_skinny_triton).
    unsupported: (*op args) -> the warning when the kernel cannot take these arguments (None: no warning).
    tensor_arg: which argument's device decides the path.
    cpu: a CPU path on torch's fused CPU kernels ("module:function", same signature), taken for CPU tensors
         under the "auto" backend instead of the reference (backend "reference" still forces the twin).
    """

    reference: str | Callable
    kernel: str | Callable
    supports: Callable | None = None
    gate: str = "kernel"
    unsupported: Callable | None = None
    tensor_arg: int = 0
    cpu: str | None = None


# -- the pickers (first argument: ops.dispatch) ---------------------------------------------------------------
def _fp_attention_kernel(ops, *args):
    """The full-precision Triton kernels, with decode's split combine in the decode launch or in a second one
    (KernelConfig.fused_attention_combine); KernelConfig.batch_invariant: fixed-size splits, the same per-row
    arithmetic in decode and prefill (ops.triton.attention.invariant)."""
    kernel = choices.resolve(_TRI + "attention.full_precision:paged_attention_full_precision")
    config = ops.kernel_config()
    return functools.partial(kernel, combine=config.fused_attention_combine, invariant=config.batch_invariant)


def _lowbit_attention_kernel(ops, query, key, value, key_pages, value_pages, key_spec, value_spec, staging_keys,
                             *rest):
    """Decode steps: the configured decode-only kernel; else the general kernel where it supports the
    page size; else None (the reference)."""
    meta = rest[-2]
    decode = ops.lowbit_decode_kernel(key_spec, value_spec, query, staging_keys) if meta.is_decode else None
    if decode is not None and query.shape[0] == meta.num_seqs:
        return decode
    general = choices.resolve(_TRI + "lowbit.attention")
    return general.paged_attention_lowbit if general.supports(key_spec, value_spec, query) else None


def _moe_kernel(ops, hidden, w_gate_up, w_down, *rest, **kwargs):
    if not choices.resolve(_TRI + "moe.decode:supports")(w_gate_up, w_down):     # FP8 scale blocks it cannot tile
        return None
    if ops.kernel_config().batch_invariant:      # one path, one launch config for every T
        return functools.partial(choices.moe_kernel("grouped"),
                                 config=choices.resolve(_TRI + "moe.configs:batch_invariant_config")())
    if kwargs.get("act_fp8"):                    # W8A8: the grouped kernel's fp8 x fp8 dots, any T
        return choices.moe_kernel("grouped")
    num_experts, two_inter, _ = w_gate_up.shape
    weights = choices.resolve(_TRI + "moe.decode:weight_format")(w_gate_up)
    return choices.moe_kernel(choices.moe_kernel_path(hidden, num_experts, two_inter // 2, weights))


def _moe_partials_kernel(hidden, w_gate_up, w_down, topk_ids):
    decode = choices.resolve(_TRI + "moe.decode")
    if decode.supports(w_gate_up, w_down) and hidden.shape[0] <= decode.MAX_DECODE_TOKENS:
        return decode.moe_expert_partials
    return None


def _norm_route_kernel(ops, x, residual, norm_weight, eps, router_weight, top_k, renormalize, expert_load=None,
                       token_valid=None, logits_out=None, route_counters=None):
    """The one-launch kernel where it takes these shapes, else the same op from dispatch's unfused ops."""
    module = choices.resolve(_TRI + "layer.norm_route")
    if module.supports(x, residual, norm_weight, router_weight, top_k, expert_load):
        return module.add_rms_norm_route
    return functools.partial(compose_add_rms_norm_route, ops.fused_add_rms_norm, ops.skinny_linear, ops.route_topk)


def _combine_norm_kernel(ops, partial, topk_weights, residual, norm_weight, eps):
    """The one-launch kernel where it takes these shapes, else dispatch's moe_combine and fused_add_rms_norm."""
    module = choices.resolve(_TRI + "layer.combine_norm")
    if module.supports(partial, topk_weights, residual, norm_weight):
        return module.moe_combine_add_rms_norm
    return functools.partial(compose_moe_combine_add_rms_norm, ops.moe_combine, ops.fused_add_rms_norm)


def _rotary_write_kernel(ops, *args):
    """The one-launch kernel where it takes these shapes (the checked write included), else dispatch's rms_norm,
    apply_rotary_qk and (checked write) stage_decode_tokens."""
    module = choices.resolve(_TRI + "layer.rotary_write")
    if module.supports(*args[:10], *args[12:15]):
        return module.qk_norm_rotary_write
    return functools.partial(compose_qk_norm_rotary_write, ops.rms_norm, ops.apply_rotary_qk,
                             stage=ops.stage_decode_tokens)


def _quantize_kv_per_side(ops, staging_keys, staging_values, slots, pages, key_spec, value_spec, key_out, value_out,
                          counters, key_counters, value_counters):
    for staging, spec, out, indices in ((staging_keys, key_spec, key_out, key_counters),
                                        (staging_values, value_spec, value_out, value_counters)):
        ops.quantize_staged_pages_counted(staging, slots, pages, spec, out, counters, *indices)


def _quantize_kv_per_layer(ops, staging_keys, staging_values, slots, pages, key_spec, value_spec, key_out,
                           value_out, counters, key_counters, value_counters):
    for layer in range(staging_keys.shape[0]):
        ops.quantize_staged_kv_counted(staging_keys[layer], staging_values[layer], slots, pages, key_spec, value_spec,
                                       key_out.layer(layer), value_out.layer(layer), counters, key_counters,
                                       value_counters)


def _no_quantizer(*args):
    spec = next(a for a in args if hasattr(a, "page_size"))
    return f"moekv: no Triton page quantizer for page_size={spec.page_size}, head_dim={spec.head_dim}; running the reference"


# -- the table ------------------------------------------------------------------------------------------------
def build(ops) -> dict[str, Op]:
    """The table, its pickers bound to `ops` (ops.dispatch)."""
    def bound(picker):
        return functools.partial(picker, ops)

    return {
        "paged_attention_full_precision": Op(_REF + "attention:paged_attention_full_precision",
                                             bound(_fp_attention_kernel),
                                             cpu="moekv.ops.cpu.attention:paged_attention_full_precision"),
        "paged_attention_lowbit": Op(
            _REF + "lowbit:paged_attention_lowbit", bound(_lowbit_attention_kernel),
            unsupported=lambda *a: f"moekv: no Triton low-bit attention for page_size={a[5].page_size} (needs a "
                                   "power of two in [16, 256]); running the reference"),
        "quantize_pages": Op(_REF + "lowbit:quantize_pages", _TRI + "lowbit.quantize:quantize_pages",
                             lambda m, x, spec: m.supports(spec), unsupported=_no_quantizer),
        "quantize_staged_pages": Op(_REF + "lowbit:quantize_staged_pages",
                                    _TRI + "lowbit.quantize:quantize_staged_pages",
                                    lambda m, staging, slots, pages, spec, out: m.supports(spec),
                                    unsupported=_no_quantizer),
        "quantize_staged_pages_counted": Op(_REF + "lowbit:quantize_staged_pages_counted",
                                            _TRI + "lowbit.quantize:quantize_staged_pages_counted",
                                            lambda m, *a: m.supports(a[3]), unsupported=_no_quantizer),
        "quantize_staged_kv_counted": Op(bound(_quantize_kv_per_side),
                                         _TRI + "lowbit.quantize:quantize_staged_kv_counted",
                                         lambda m, *a: m.supports(a[4]) and m.supports(a[5])),
        "quantize_staged_kv_counted_layers": Op(bound(_quantize_kv_per_layer),
                                                _TRI + "lowbit.quantize:quantize_staged_kv_counted_layers",
                                                lambda m, *a: m.supports(a[4]) and m.supports(a[5])),
        "stage_decode_tokens": Op(_REF + "lowbit:stage_decode_tokens", _TRI + "lowbit.stage:stage_decode_tokens"),
        "moe_experts": Op(_REF + "moe:moe_experts_reference", bound(_moe_kernel),
                          unsupported=lambda hidden, w_gate_up, w_down, *a, **k: "moekv: no Triton MoE kernel for "
                          f"these expert weights ({type(w_gate_up).__name__} / {type(w_down).__name__}, FP8 scale "
                          "blocks must span the reduced dimension or a multiple of 16 of it); running the reference"),
        "moe_expert_partials": Op(_REF + "moe_combine:moe_expert_partials", _moe_partials_kernel,
                                  unsupported=lambda hidden, *a: f"moekv: no Triton per-slot MoE outputs for "
                                  f"{hidden.shape[0]} tokens / these expert weights; running the reference"),
        "moe_combine": Op(_REF + "moe_combine:moe_combine", _TRI + "moe.decode:combine_partials"),
        "moe_combine_add_rms_norm": Op(_REF + "moe_combine:moe_combine_add_rms_norm", bound(_combine_norm_kernel),
                                       gate="layer"),
        "fp8_linear": Op(_REF + "fp8_linear:fp8_linear", _TRI + "layer.fp8_linear:fp8_linear",
                         lambda m, x, weight, bias=None, act_fp8=False: m.supports(x, weight),
                         unsupported=lambda x, weight, bias=None, act_fp8=False: f"moekv: no Triton FP8 linear for x "
                         f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} block {weight.block}; running "
                         "the reference"),
        "moe_align": Op(_REF + "moe:moe_align_reference", _TRI + "moe.align:moe_align"),
        "stage_expert_copies": Op(_REF + "moe_stage:stage_expert_copies", _TRI + "moe.stage:stage_expert_copies",
                                  tensor_arg=1),
        "ep_local_routing": Op(_REF + "ep_routing:ep_local_routing", _TRI + "moe.ep_routing:ep_local_routing",
                               lambda m, table, codes, weights, top_k: m.supports(codes, top_k), tensor_arg=1,
                               unsupported=lambda table, codes, *a: f"moekv: no Triton EP routing for "
                                                                    f"{tuple(codes.shape)}; running the reference"),
        "rms_norm": Op(_REF + "layers:rms_norm", _TRI + "layer.norm:rms_norm",
                       lambda m, x, weight, eps: m.supports(x, weight), gate="layer",
                       unsupported=lambda x, weight, eps: f"moekv: no Triton RMSNorm for shape {tuple(x.shape)} / "
                                                          f"{x.dtype}, weight {weight.dtype}; running the reference"),
        "fused_add_rms_norm": Op(
            _REF + "layers:fused_add_rms_norm", _TRI + "layer.norm:fused_add_rms_norm",
            lambda m, x, residual, weight, eps: m.supports(x, weight, residual), gate="layer",
            unsupported=lambda x, residual, *a: f"moekv: no Triton fused add + RMSNorm for shape {tuple(x.shape)} "
                                                f"/ {x.dtype}, residual {residual.dtype}; running the reference"),
        "apply_rotary_qk": Op(_REF + "layers:apply_rotary_qk", _TRI + "layer.rotary:apply_rotary_qk",
                              lambda m, *a: m.supports(*a), gate="layer",
                              unsupported=lambda q, k, cos, sin: f"moekv: no Triton rotary for q {tuple(q.shape)} "
                                                                 f"{q.dtype}, cos {tuple(cos.shape)} {cos.dtype}; "
                                                                 "running the reference"),
        "route_topk": Op(_REF + "layers:route_topk", _TRI + "layer.routing:route_topk",
                         lambda m, logits, top_k, renormalize, expert_load=None, token_valid=None:
                         m.supports(logits, top_k, expert_load), gate="layer",
                         unsupported=lambda logits, top_k, *a: f"moekv: no Triton routing for logits "
                                                               f"{tuple(logits.shape)}, top_k={top_k}; running the "
                                                               "reference"),
        "add_rms_norm_route": Op(_REF + "layers:add_rms_norm_route", bound(_norm_route_kernel), gate="layer"),
        "qk_norm_rotary_write": Op(_REF + "layers:qk_norm_rotary_write", bound(_rotary_write_kernel), gate="layer"),
        "invariant_linear": Op(_REF + "invariant_linear:invariant_linear",
                               _TRI + "layer.invariant_linear:invariant_linear", lambda m, *a: m.supports(*a),
                               unsupported=lambda x, weight, bias=None: f"moekv: no batch-invariant Triton GEMM for "
                               f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}; running "
                               "the row-by-row reference"),
        "skinny_linear": Op("torch.nn.functional:linear", _TRI + "layer.skinny_gemm:skinny_gemm",
                            lambda m, *a: m.supports(*a), gate="skinny"),
    }

"""Counting the device work of one expert-parallel MoE layer with torch.profiler on the CPU.

What a CUDA graph replays per MoE layer is one kernel per launching aten op (plus the collectives and the
expert kernels), each ~2-4 us of GPU time even inside a graph, so the count is what matters at batch 1.
`layer_op_counts` profiles one layer call and counts, on the calling thread:

- kernels: the aten ops called directly by the exchange that launch device work, i.e. not views,
  allocations or no-op conversions (a `.to()` / `.contiguous()` counts only when it copies). A lower
  bound for the GPU kernels: a composite op (argsort, repeat_interleave) may launch several.
- collectives: calls of the exchange's all-gather / reduce-scatter (their gloo internals not counted).
- expert_calls: calls of ops.dispatch.moe_experts (its own ops not counted: on the GPU it is the
  fused Triton path, on the CPU the reference).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

LAYER_SCOPE = "moekv::layer"
EXPERT_SCOPE = "moekv::moe_experts"
COLLECTIVE_SCOPE = "moekv::collective"

# aten ops that launch nothing on a device by themselves: views, allocations, metadata; the
# conversions (to, contiguous, reshape, ...) launch only through a child (_to_copy -> copy_, clone)
NO_LAUNCH = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided",
    "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::expand_as",
    "aten::permute", "aten::t", "aten::transpose", "aten::alias", "aten::detach", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::to", "aten::contiguous", "aten::flatten",
    "aten::unflatten", "aten::view_as", "aten::split", "aten::chunk", "aten::narrow", "aten::unbind",
    "aten::result_type", "aten::scalar_tensor", "aten::_has_compatible_shallow_copy_type",
}


def _launches(event) -> bool:
    if event.name not in NO_LAUNCH:
        return True
    return any(_launches(child) for child in event.cpu_children)


def count_events(events) -> dict:
    """Counts of the ops directly inside each LAYER_SCOPE (see the module docstring), summed over scopes."""
    kernels: Counter = Counter()
    collectives = expert_calls = layers = 0
    for scope in events:
        if scope.name != LAYER_SCOPE:
            continue
        layers += 1
        for event in scope.cpu_children:
            if event.name == COLLECTIVE_SCOPE:
                collectives += 1
            elif event.name == EXPERT_SCOPE:
                expert_calls += 1
            elif event.name.startswith("aten::") and _launches(event):
                kernels[event.name] += 1
    return {"layers": layers, "kernels": sum(kernels.values()), "collectives": collectives,
            "expert_calls": expert_calls, "ops": dict(kernels)}


@contextmanager
def scoped_calls():
    """Mark the exchange's collectives and the expert op with profiler scopes while inside."""
    from moekv.distributed import exchange
    from moekv.ops import dispatch

    saved = {"all_gather": exchange.all_gather, "reduce_scatter": exchange.reduce_scatter}
    moe_experts = dispatch.moe_experts

    def scoped(function, name):
        def call(*args, **kwargs):
            with record_function(name):
                return function(*args, **kwargs)
        return call

    exchange.all_gather = scoped(saved["all_gather"], COLLECTIVE_SCOPE)
    exchange.reduce_scatter = scoped(saved["reduce_scatter"], COLLECTIVE_SCOPE)
    dispatch.moe_experts = scoped(moe_experts, EXPERT_SCOPE)
    try:
        yield
    finally:
        exchange.all_gather, exchange.reduce_scatter = saved["all_gather"], saved["reduce_scatter"]
        dispatch.moe_experts = moe_experts


def layer_op_counts(call, warmup: int = 2) -> dict:
    """Run `call()` (one MoE layer on every rank: a collective) warmup times, then once profiled."""
    with scoped_calls():
        for _ in range(warmup):
            call()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function(LAYER_SCOPE):
                result = call()
    counts = count_events(prof.profiler.function_events)
    counts["result"] = result
    return counts

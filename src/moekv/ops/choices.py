"""Which kernel runs where an op has more than one: the low-bit decode kernel table and the MoE
experts' decode / grouped crossover. ops.dispatch asks these with the active KernelConfig's values;
nothing here holds state but import caches.
"""

from __future__ import annotations

import functools
import importlib

import torch

_TRI = "moekv.ops.triton."

# -- Low-bit decode kernels: the one place that names them ------------------------------------------
# Decode-only low-bit attention kernels (one query token per sequence), picked by
# KernelConfig.lowbit_decode (MOEKV_LOWBIT_DECODE): "auto" takes DEFAULT_LOWBIT_DECODE; "v4" keeps the
# general kernel (lowbit.attention) for decode as well. Each module has supports(key_spec, value_spec,
# head_dim) for the format and runs_on(query, staging_keys) for dtypes and device. Measured side by side with
# bf16 SDPA on the H200 by benchmarks/bench_attention.py (docs/attention-kernels.md).
LOWBIT_DECODE_KERNELS: dict[str, str | None] = {
    "v7": "moekv.ops.cuda.lowbit_decode:paged_attention_lowbit_decode",   # CUDA C++, tokens as the MMA M
    "v4": None,
}
DEFAULT_LOWBIT_DECODE = "v7"          # all its tests pass on the H200; 1.4-1.7x faster than v6 at every shape
# ----------------------------------------------------------------------------------------------------


def resolve(target: str):
    """"package.module:attribute" -> the attribute, looked up at each call (tests patch module attributes);
    "package.module" -> the module. Modules are imported lazily, once."""
    module_name, _, attribute = target.partition(":")
    module = _module(module_name)
    return getattr(module, attribute) if attribute else module


@functools.lru_cache(maxsize=None)
def _module(name: str):
    return importlib.import_module(name)


def lowbit_decode_kernel(name: str, key_spec, value_spec, query: torch.Tensor, staging_keys: torch.Tensor):
    """The decode-only kernel function `name` ("auto" or a key of LOWBIT_DECODE_KERNELS) picks for this
    format, dtype and device, or None (use the general kernel)."""
    module = _lowbit_decode_module(DEFAULT_LOWBIT_DECODE if name == "auto" else name, key_spec, value_spec,
                                   query.shape[-1])
    if module is None or not module.runs_on(query, staging_keys):
        return None
    return getattr(module, LOWBIT_DECODE_KERNELS[DEFAULT_LOWBIT_DECODE if name == "auto" else name].partition(":")[2])


@functools.lru_cache(maxsize=None)
def _lowbit_decode_module(name: str, key_spec, value_spec, head_dim: int):
    """Cached per (choice, format): an eager decode step asks once per layer."""
    target = LOWBIT_DECODE_KERNELS[name]
    if target is None:
        return None
    module = resolve(target.partition(":")[0])
    return module if module.supports(key_spec, value_spec, head_dim) else None


def moe_kernel_path(hidden: torch.Tensor, num_experts: int, inter: int, weights: str | None = None) -> str:
    """"decode" up to the decode limit of this shape, GPU and weight format (None: 16-bit, "fp8"; tuned
    crossover in ops/triton/moe/configs, default 16 tokens), else "grouped"."""
    decode = resolve(_TRI + "moe.decode")
    limit = min(resolve(_TRI + "moe.configs:decode_max_tokens")(num_experts, hidden.shape[-1], inter, hidden.dtype,
                                                                 hidden.device, weights), decode.MAX_DECODE_TOKENS)
    return "decode" if hidden.shape[0] <= limit else "grouped"


_MOE_KERNELS = {"decode": _TRI + "moe.decode:moe_experts_decode", "grouped": _TRI + "moe.grouped:moe_experts_grouped"}
_MOE_PASSES = {"decode": _TRI + "moe.passes:DecodePasses", "grouped": _TRI + "moe.passes:GroupedPasses"}


def moe_kernel(path: str):
    """The fused MoE experts kernel of a path ("decode" / "grouped")."""
    return resolve(_MOE_KERNELS[path])


def moe_expert_passes(path: str, hidden, top_k: int, num_experts: int, inter: int, weights=None):
    """The Triton launch pieces for expert compute in passes over slot tensors ("decode" / "grouped",
    from moe_experts_path): see ops/triton/moe/passes.py. weights: the (w_gate_up, w_down) the passes read
    (FP8: the FP8 configuration), None: 16-bit."""
    return resolve(_MOE_PASSES[path])(hidden, top_k, num_experts, inter, weights)

"""Launch configurations of the fused MoE kernels, per (experts, hidden, intermediate, dtype, GPU).

tools/tune_moe.py writes one JSON file per shape and GPU into this folder:

    E={E},H={H},I={I},dtype={bf16|fp16|fp32}[,weights=fp8],device={torch.cuda.get_device_name, spaces as _}.json
    {
      "decode_max_tokens": 16,                  # T <= this takes the decode path (measured crossover)
      "decode":  {"<T>": {"gate_up": {BLOCK_N, BLOCK_K, num_warps, num_stages},
                          "down":    {BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages},
                          "VARIANT": "dot" | "fma",   # optional, default "dot": which kernels run
                          "fma": {"gate_up": {BLOCK_N, BLOCK_K, num_warps, num_stages, UNROLL},
                                  "down":    {..., SPLIT_K}}}, ...},   # optional: the fma variant's tiles
      "grouped": {"<T>": {"BLOCK_M": .., "gate_up": {BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages},
                          "down":    {BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages}}, ...},
      "meta": {...}                             # who tuned it, when, with what
    }

"gate_up" / "down" are the "dot" kernels' parameters (ops.triton.moe.decode), "fma" those of the GEMV variant
(ops.triton.moe.decode_fma; absent: decode_fma.default_part); "VARIANT" picks one (ops.triton.moe.decode_config;
"fma" only runs T <= 4 on K-contiguous weights, else "dot"). A call with T tokens takes the entry whose key is
nearest to T; a file may leave out a path's section (that path
then takes default_config). Shapes or GPUs without a file get
`default_config` (sane, untuned). Files are read once per process. FP8 experts (W8A16) have their own files
(`weights=fp8`, `tools/tune_moe.py --quantization fp8`); without one they take the 16-bit file's entries.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_DECODE_MAX_TOKENS = 16
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def device_name(device: torch.device | str) -> str:
    """The name config files are keyed by ("NVIDIA_H200"; "cpu" for the interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def config_filename(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str,
                    weights: str | None = None) -> str:
    """weights: None (16-bit expert weights, the activation dtype) or "fp8"."""
    quantized = f",weights={weights}" if weights else ""
    return f"E={num_experts},H={hidden},I={inter},dtype={_DTYPE_NAMES[dtype]}{quantized},device={device}.json"


@functools.lru_cache(maxsize=None)
def load_tuned(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str,
               weights: str | None = None) -> dict | None:
    """The tuned table of a shape on a GPU, or None (FP8 weights without their own file: the 16-bit one's)."""
    path = CONFIG_DIR / config_filename(num_experts, hidden, inter, dtype, device, weights)
    if not path.is_file():
        return load_tuned(num_experts, hidden, inter, dtype, device) if weights else None
    return json.loads(path.read_text())


# A tuned grouped entry speaks for token counts within this factor of its own; beyond, default_config (a
# decode-sized tuning, e.g. T=64, says nothing about a 4096-token prefill's tiles).
GROUPED_REACH = 4


def _nearest_key(table: dict[str, dict], num_tokens: int) -> str:
    """The tuned token count closest to num_tokens (the smaller one on a tie)."""
    return min(table, key=lambda k: (abs(int(k) - num_tokens), int(k)))


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))


def default_config(kind: str, num_experts: int, hidden: int, inter: int, num_tokens: int, top_k: int = 2) -> dict:
    """Untuned launch parameters that are reasonable on Hopper-class GPUs (and small enough for the
    interpreter on tiny shapes). kind: "decode" or "grouped"."""
    if kind == "decode":
        gate_up = {"BLOCK_N": min(32, _pow2(inter)), "BLOCK_K": min(128, _pow2(hidden)),
                   "num_warps": 4, "num_stages": 3}
        down = {"BLOCK_N": min(32, _pow2(hidden)), "BLOCK_K": min(128, _pow2(inter)), "SPLIT_K": None,
                "num_warps": 4, "num_stages": 3}
        return {"gate_up": gate_up, "down": down}
    per_expert = num_tokens * top_k / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    warps = 8 if block_m >= 64 else 4
    gate_up = {"BLOCK_N": min(64, _pow2(inter)), "BLOCK_K": min(64, _pow2(hidden)), "GROUP_M": 8,
               "num_warps": warps, "num_stages": 3}
    down = {"BLOCK_N": min(128, _pow2(hidden)), "BLOCK_K": min(64, _pow2(inter)), "GROUP_M": 8,
            "num_warps": warps, "num_stages": 3}
    return {"BLOCK_M": block_m, "gate_up": gate_up, "down": down}


def get_config(kind: str, num_experts: int, hidden: int, inter: int, num_tokens: int, dtype: torch.dtype,
               device: torch.device | str, top_k: int = 2, weights: str | None = None) -> dict:
    """The tuned entry nearest to num_tokens for this shape, GPU and weight format (None: 16-bit, "fp8"),
    else default_config. The result is cached and shared: copy before changing it."""
    return _cached_config(kind, num_experts, hidden, inter, num_tokens, dtype, device_name(device), top_k, weights)


@functools.lru_cache(maxsize=4096)
def _cached_config(kind: str, num_experts: int, hidden: int, inter: int, num_tokens: int, dtype: torch.dtype,
                   device: str, top_k: int, weights: str | None = None) -> dict:
    tuned = load_tuned(num_experts, hidden, inter, dtype, device, weights)
    table = tuned.get(kind) if tuned else None
    if table:
        key = _nearest_key(table, num_tokens)
        if kind == "decode" or int(key) // GROUPED_REACH <= num_tokens <= int(key) * GROUPED_REACH:
            return table[key]
    return default_config(kind, num_experts, hidden, inter, num_tokens, top_k)


def decode_max_tokens(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str,
                      weights: str | None = None) -> int:
    """The largest T that takes the decode path: the tuned crossover, else DEFAULT_DECODE_MAX_TOKENS."""
    tuned = load_tuned(num_experts, hidden, inter, dtype, device_name(device), weights)
    return int(tuned.get("decode_max_tokens", DEFAULT_DECODE_MAX_TOKENS)) if tuned else DEFAULT_DECODE_MAX_TOKENS


# The batch-invariant mode (KernelConfig.batch_invariant): every T takes the grouped path with this one launch
# shape, whatever the tuned tables say. A token-slot's gate_up / down sums then run BLOCK_K tiles from 0 upwards in
# a BLOCK_M x BLOCK_N tile of fixed shape, no split-K: its result does not depend on how many other slots its
# expert has in the step. BLOCK_N / BLOCK_K are capped at the (power-of-two-padded) model dims as default_config
# caps them, by the kernels' own tile caps for FP8 scale blocks (grouped._resolve_config): properties of the model,
# not of T. 64-row tiles: prefill-sized steps keep default_config's large-T tiles; decode pays tensor-core rows.
BATCH_INVARIANT_CONFIG = {"BLOCK_M": 64,
                          "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
                          "down": {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}}


def batch_invariant_config() -> dict:
    """A copy of BATCH_INVARIANT_CONFIG (moe.grouped takes it as its `config` override)."""
    return {"BLOCK_M": BATCH_INVARIANT_CONFIG["BLOCK_M"],
            **{part: dict(BATCH_INVARIANT_CONFIG[part]) for part in ("gate_up", "down")}}

"""Every environment variable moekv reads, read here and nowhere else.

Environment variables are overrides only: the typed defaults live in the configs (`config.py`:
`KernelConfig` for the kernel switches, `DeviceConfig.capture_error_mode`) or next to the code that
uses them; a variable that is set replaces the default. Each reader below parses its variable into
a typed value (or None when unset/empty) and raises a `ConfigError` naming the variable, the bad
value and what is accepted. The readers look at the environment when called (tests set variables
with monkeypatch); the kernel switches are read once per `KernelConfig.from_env()`.

| variable | read by | meaning |
| --- | --- | --- |
| MOEKV_OPS_BACKEND | `kernel_overrides` | auto / reference / triton: force every op's path |
| MOEKV_LOWBIT_DECODE | `kernel_overrides` | auto or a name of `ops.dispatch.LOWBIT_DECODE_KERNELS` |
| MOEKV_FUSED_LAYER_OPS | `kernel_overrides` | 0 / 1: the fused per-layer Triton ops on CUDA |
| MOEKV_FUSED_DECODE_LAYER | `kernel_overrides` | 0 / 1: add + norm + router and q/k norm + rotary + KV write fused |
| MOEKV_FUSED_ATTENTION_COMBINE | `kernel_overrides` | 0 / 1: full-precision decode attention combines its splits in its own launch |
| MOEKV_FUSED_MOE_COMBINE | `kernel_overrides` | 0 / 1: the MoE decode combine summed by the next add + norm (on) |
| MOEKV_FUSED_ROUTE_FOLD | `kernel_overrides` | 0 / 1: a router of several programs per token routed in the add + norm launch (on) |
| MOEKV_SKINNY_GEMM | `kernel_overrides` | 0 / auto (one-row inputs) / 1 (up to 16 rows) / 64 (up to 64 rows) |
| MOEKV_PDL | `kernel_overrides` | 0 / 1: programmatic dependent launch of the decode step's Triton kernels (off) |
| MOEKV_W8A8_MIN_TOKENS | `kernel_overrides` | N >= 0: FP8 weights run W8A8 (e4m3 activations) from N rows per MoE call or projection (0: off) |
| MOEKV_BATCH_INVARIANT | `kernel_overrides` | 0 / 1: every row's result independent of the batch (slower) |
| MOEKV_CAPTURE_ERROR_MODE | `capture_error_mode` | torch.cuda.graph's capture_error_mode |
| MOEKV_DEFAULT_MODEL | `default_model` | the checkpoint `moekv` runs when none is named |
| MOEKV_MODEL_DIR | `model_dir` | where the bundled model folder is |
| MOEKV_TRAIN_TEXT | `train_text` | the training corpus of the bundled model |
| MOEKV_COMMIT | `commit` | the commit a measurement reports (GPU machines) |
| HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME | `hf_hub_cache` | the Hugging Face hub cache a model id is resolved in |
| HF_HUB_OFFLINE | `hf_hub_offline` | stated in the error for a model id not in the cache (moekv never downloads) |
| MOEKV_EP_TIMEOUT_S | `ep_timeout_s` | the expert-parallel device group's timeout |
| MOEKV_EP_EXIT_GRACE_S, MOEKV_EP_POLL_S | `ep_exit_grace_s`, `ep_poll_s` | peer-failure handling |
| LRU_CACHE_CAPACITY, ONEDNN_PRIMITIVE_CACHE_CAPACITY | `limit_onednn_caches` | written (unless set): oneDNN's kernel caches (`DeviceConfig.cpu_kernel_cache_entries`) |
| RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT | `torchrun_*` | set by torchrun |
"""

from __future__ import annotations

import os
from typing import Any

from moekv.errors import ConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def get(name: str) -> str | None:
    """The raw value of `name`, None when unset or empty."""
    value = os.environ.get(name)
    return value if value else None


def _choice(name: str, accepted: tuple[str, ...]) -> str | None:
    value = get(name)
    if value is not None and value not in accepted:
        raise ConfigError(f"{name} must be one of {', '.join(accepted)}, got {value!r}")
    return value


def _flag(name: str) -> bool | None:
    value = get(name)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"{name} must be 0 or 1 (or true/false, on/off), got {value!r}")


def _seconds(name: str, strict: bool, default: float | None = None) -> float | None:
    value = get(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        if strict:
            raise ConfigError(f"{name} must be a number of seconds, got {value!r}") from None
        return default


# -- kernel switches (KernelConfig.from_env) -------------------------------------------------------
def kernel_overrides() -> dict[str, Any]:
    """The KernelConfig fields the environment sets: backend, lowbit_decode, fused_layer_ops,
    fused_decode_layer, fused_attention_combine, fused_moe_combine, fused_route_fold, skinny_gemm_rows, pdl,
    w8a8_min_tokens, batch_invariant. The low-bit decode name is checked against the kernel table by ops.dispatch."""
    out: dict[str, Any] = {}
    backend = _choice("MOEKV_OPS_BACKEND", ("auto", "reference", "triton"))
    if backend is not None:
        out["backend"] = backend
    lowbit_decode = get("MOEKV_LOWBIT_DECODE")
    if lowbit_decode is not None:
        out["lowbit_decode"] = lowbit_decode
    for name, field in (("MOEKV_FUSED_LAYER_OPS", "fused_layer_ops"), ("MOEKV_FUSED_DECODE_LAYER", "fused_decode_layer"),
                        ("MOEKV_FUSED_ATTENTION_COMBINE", "fused_attention_combine"),
                        ("MOEKV_FUSED_MOE_COMBINE", "fused_moe_combine"),
                        ("MOEKV_FUSED_ROUTE_FOLD", "fused_route_fold"), ("MOEKV_PDL", "pdl"),
                        ("MOEKV_BATCH_INVARIANT", "batch_invariant")):
        flag = _flag(name)
        if flag is not None:
            out[field] = flag
    w8a8 = get("MOEKV_W8A8_MIN_TOKENS")
    if w8a8 is not None:
        if not w8a8.isdigit():
            raise ConfigError(f"MOEKV_W8A8_MIN_TOKENS must be an integer >= 0 (0: off), got {w8a8!r}")
        out["w8a8_min_tokens"] = int(w8a8)
    skinny = _choice("MOEKV_SKINNY_GEMM", ("0", "1", "auto", "64"))
    if skinny is not None:
        out["skinny_gemm_rows"] = {"0": 0, "auto": 1, "1": 16, "64": 64}[skinny]
    return out


def capture_error_mode() -> str | None:
    """MOEKV_CAPTURE_ERROR_MODE: torch.cuda.graph's capture_error_mode for the decode graphs."""
    return _choice("MOEKV_CAPTURE_ERROR_MODE", CAPTURE_ERROR_MODES)


# -- paths and provenance --------------------------------------------------------------------------
def default_model() -> str | None:
    return get("MOEKV_DEFAULT_MODEL")


def model_dir() -> str | None:
    return get("MOEKV_MODEL_DIR")


def train_text() -> str | None:
    return get("MOEKV_TRAIN_TEXT")


def commit() -> str | None:
    return get("MOEKV_COMMIT")


# -- the Hugging Face cache (model ids are resolved there, never downloaded) -----------------------
def hf_hub_cache() -> tuple[str, str]:
    """(the hub cache folder, the variable that chose it) as huggingface_hub derives it: HF_HUB_CACHE,
    else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if get("HF_HUB_CACHE"):
        return os.path.expanduser(get("HF_HUB_CACHE")), "HF_HUB_CACHE"
    if get("HF_HOME"):
        return os.path.join(os.path.expanduser(get("HF_HOME")), "hub"), "HF_HOME"
    base = get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "huggingface", "hub"), "XDG_CACHE_HOME" if get("XDG_CACHE_HOME") else "default"


def hf_hub_offline() -> bool:
    """HF_HUB_OFFLINE as a flag (unset: False)."""
    return bool(_flag("HF_HUB_OFFLINE"))


# -- expert parallelism ----------------------------------------------------------------------------
def ep_timeout_s() -> float | None:
    """MOEKV_EP_TIMEOUT_S: seconds (a bad value is an error)."""
    return _seconds("MOEKV_EP_TIMEOUT_S", strict=True)


def ep_exit_grace_s(default: float) -> float:
    """MOEKV_EP_EXIT_GRACE_S (a bad value falls back to `default`: read while exiting)."""
    return _seconds("MOEKV_EP_EXIT_GRACE_S", strict=False, default=default)


def ep_poll_s(default: float) -> float:
    """MOEKV_EP_POLL_S (a bad value falls back to `default`)."""
    return _seconds("MOEKV_EP_POLL_S", strict=False, default=default)


def torchrun_missing() -> tuple[str, ...]:
    """The torchrun variables this process lacks (empty: launched by torchrun)."""
    return tuple(name for name in TORCHRUN_VARS if name not in os.environ)


def torchrun_int(name: str, default: int | None = None) -> int:
    """An integer torchrun variable (WORLD_SIZE, LOCAL_RANK, RANK); `default` when unset."""
    value = get(name)
    if value is None:
        if default is None:
            raise ConfigError(f"{name} is not set (launch with torchrun)")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def torchrun_restart_count() -> str:
    return get("TORCHELASTIC_RESTART_COUNT") or "0"


ONEDNN_CACHE_VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")   # ideep's, oneDNN's


def limit_onednn_caches(entries: int) -> dict[str, str]:
    """Bound oneDNN's caches of compiled CPU kernels (the only variables moekv writes). They read these
    once, at the process's first oneDNN matmul, so this acts only before it; a value the user set wins.
    Returns the values in effect."""
    for name in ONEDNN_CACHE_VARS:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in ONEDNN_CACHE_VARS}

"""Researcher API for moekv's low-bit KV format: quantize a key or value tensor, look at what it costs.

    from moekv import kv
    q = kv.quantize(keys, kind="key", bits=3)      # keys [tokens, kv_heads, head_dim]
    keys_hat = q.dequantize()                       # same shape and dtype
    q.bits_per_value, q.nbytes

Light to import: torch and the format modules load on the first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moekv.kv.api import QuantizedKV

__all__ = ["quantize", "QuantizedKV"]


def quantize(x: Any, kind: str = "key", bits: int = 3, outlier_fraction: float | None = None,
             **options: Any) -> "QuantizedKV":
    """Quantize x [tokens, kv_heads, head_dim] as moekv's KV pages do. See moekv.kv.api.quantize."""
    from moekv.kv.api import quantize as _quantize

    return _quantize(x, kind=kind, bits=bits, outlier_fraction=outlier_fraction, **options)


def __getattr__(name: str) -> Any:
    if name == "QuantizedKV":
        from moekv.kv.api import QuantizedKV

        return QuantizedKV
    raise AttributeError(f"module 'moekv.kv' has no attribute {name!r}")

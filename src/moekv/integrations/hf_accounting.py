"""Bytes that a transformers KV cache stores, counted from its tensors, for side-by-side comparisons.

`stored_bytes(cache)` -> CacheBytes for:

- transformers' `QuantizedCache` (quanto and HQQ backends): per layer the quantized keys and values plus the
  full-precision residual window (`layer.keys` / `layer.values`). A quanto tensor is counted through
  `__tensor_flatten__` down to plain tensors: packed codes (`_data._data`, uint8), `_scale` and `_shift`
  (zero point); an HQQ pair `(W_q, meta)` as the packed codes `W_q` plus every tensor in `meta`
  (`scale`, `zero`). Scales and zero points are stored in the dtype the backend chose (HQQ: the model dtype).
- `DynamicCache` (and any layer with plain `keys` / `values`): their bytes.
- moekv's `LowBitCache`: its own exact count (`nbytes`).

Values held: the scalars the quantized keys and values stand for plus those of the window (transformers'
QuantizedCache quantizes everything before its window, so this is 2 x batch x kv_heads x tokens x head_dim);
bits per value = 8 * bytes / values.
Needs torch only when called; transformers is not imported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CacheBytes:
    """What a cache stores: `lowbit` bytes (codes, scales, zero points, outliers) holding `lowbit_values`
    scalars, `full_precision` bytes (residual windows, or all of a DynamicCache); `num_values` scalars in all."""

    lowbit: int
    full_precision: int
    num_values: int
    lowbit_values: int = 0

    @property
    def total(self) -> int:
        return self.lowbit + self.full_precision

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.total / self.num_values if self.num_values else 0.0

    @property
    def lowbit_bits_per_value(self) -> float | None:
        """Bits per scalar of the quantized part alone (None when nothing is quantized yet)."""
        return 8.0 * self.lowbit / self.lowbit_values if self.lowbit_values else None


def tensor_bytes(obj: Any) -> int:
    """Bytes of the plain tensors inside obj: tensor subclasses via __tensor_flatten__, tuples, lists, dicts."""
    import torch

    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:
            names, _ = flatten()
            return sum(tensor_bytes(getattr(obj, name)) for name in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(item) for item in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(item) for item in obj.values())
    return 0


def _quantized_numel(quantized: Any) -> int:
    """Scalars a backend's quantized tensor stands for."""
    if isinstance(quantized, tuple) and len(quantized) == 2 and isinstance(quantized[1], dict):   # HQQ
        shape = quantized[1]["shape"]
    else:
        shape = quantized.shape
    return math.prod(int(n) for n in shape)


def _layer_bytes(layer: Any) -> CacheBytes:
    window = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
    full = tensor_bytes(window)
    window_values = sum(t.numel() for t in window)
    quantized_keys = getattr(layer, "_quantized_keys", None)
    if quantized_keys is None:                 # a full-precision layer
        return CacheBytes(0, full, window_values)
    quantized_values = layer._quantized_values
    lowbit = tensor_bytes(quantized_keys) + tensor_bytes(quantized_values)
    lowbit_values = _quantized_numel(quantized_keys) + _quantized_numel(quantized_values)
    return CacheBytes(lowbit, full, lowbit_values + window_values, lowbit_values)


def stored_bytes(cache: Any) -> CacheBytes:
    """Bytes stored by a transformers cache (QuantizedCache, DynamicCache) or a moekv LowBitCache."""
    if hasattr(cache, "lowbit_nbytes") and hasattr(cache, "num_values"):       # moekv LowBitCache
        return CacheBytes(cache.lowbit_nbytes, cache.nbytes - cache.lowbit_nbytes, cache.num_values,
                          cache.lowbit_num_values)
    parts = [_layer_bytes(layer) for layer in cache.layers]
    return CacheBytes(sum(p.lowbit for p in parts), sum(p.full_precision for p in parts),
                      sum(p.num_values for p in parts), sum(p.lowbit_values for p in parts))

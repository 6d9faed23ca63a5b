"""moekv's low-bit KV format as a drop-in Hugging Face transformers cache.

    from moekv.integrations.transformers import LowBitCache
    out = model.generate(**inputs, past_key_values=LowBitCache(model.config, bits=3), max_new_tokens=64)

Works with transformers 4.56+ and 5.x (the per-layer cache API: `Cache(layers=...)`, `CacheLayerMixin`); this
module imports transformers, `import moekv` does not. Each attention layer holds a `LowBitKVStore`
(lowbit_store.py): pages of `page_size` tokens quantized with `moekv.kv.quantize` (per-channel keys, per-token
values, a bounded budget of fp16 outliers) once the full-precision window is full. Guide and measurements:
docs/transformers-cache.md.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
except ImportError as error:          # transformers is optional for moekv
    raise ImportError("moekv.integrations.transformers needs Hugging Face transformers >= 4.56: "
                      "pip install 'transformers>=4.56'") from error

from moekv.integrations.lowbit_store import LowBitKVStore
from moekv.integrations.settings import LowBitCacheSettings

__all__ = ["LowBitCache", "LowBitLayer", "LowBitCacheSettings"]

MIN_TRANSFORMERS = (4, 56)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _version_tuple(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)  # type: ignore[return-value]


if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:
    raise ImportError(f"moekv.integrations.transformers needs transformers >= 4.56 (the per-layer cache API), "
                      f"found {transformers.__version__}")

# transformers 5 crops by a count of tokens to remove (`crop(-n)`, positive values raise); 4.x takes the
# length to keep (or, negative, a count to remove). LowBitLayer.crop follows the installed DynamicLayer.
CROP_TAKES_COUNT = "tokens_to_remove" in inspect.signature(DynamicLayer.crop).parameters


class LowBitLayer(CacheLayerMixin):
    """One attention layer of `LowBitCache`: keys and values [batch, kv_heads, tokens, head_dim]."""

    is_compileable = False
    is_sliding = False
    is_croppable = True      # a crop right after a step is exact (see lowbit_store.py)
    supports_early_init = True

    def __init__(self, settings: LowBitCacheSettings):
        super().__init__()
        self.settings = settings
        self.store = LowBitKVStore(settings)
        self.is_initialized = False

    def __repr__(self) -> str:
        return f"LowBitLayer(bits={self.settings.bits}, tokens={self.store.length})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.store.initialize(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's keys/values [B, H, n, D]; return the whole layer cache [B, H, length, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.store.append(key_states, value_states)

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.store.length

    def get_mask_sizes(self, query: int | torch.Tensor, *args: Any) -> tuple[int, int]:
        """(kv_length, kv_offset); transformers 5 passes the query length, 4.x the cache_position tensor."""
        query_length = query if isinstance(query, int) else int(query.shape[0])
        return self.store.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:     # the 4.x name
        return -1

    def crop(self, amount: int) -> None:
        length = self.store.length
        if CROP_TAKES_COUNT:
            if amount > 0:
                raise ValueError(f"Calling `crop` with a positive value (`{amount}`) is not supported. Please use a "
                                 "negative integer to remove that number of tokens from the cache instead.")
            self.store.crop(length + amount)
        else:
            self.store.crop(length - abs(amount) if amount < 0 else amount)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select_batch([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.store.select_batch([row for row in range(self.store.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor | list[int]) -> None:
        if isinstance(indices, torch.Tensor):
            indices = indices.nonzero().flatten() if indices.dtype == torch.bool else indices.flatten()
            indices = indices.tolist()
        self.store.select_batch([int(i) for i in indices])

    def reset(self) -> None:
        self.store.reset()
        self.is_initialized = False

    def offload(self) -> None:        # CPU offloading of the cache is not supported; stay where we are
        return None

    def prefetch(self) -> None:
        return None


def _num_attention_layers(config: Any) -> int:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        unsupported = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
        if unsupported:
            raise ValueError(f"LowBitCache supports attention layers only ({', '.join(ATTENTION_LAYER_TYPES)}); "
                             f"this model also has {unsupported}")
        return len(layer_types)
    return int(text.num_hidden_layers)


class LowBitCache(Cache):
    """A transformers `Cache` that stores keys and values in moekv's low-bit format (int4/int3/int2 codes with
    scale/zero and a bounded fp16 outlier budget), with a full-precision window of the newest tokens.

    config: the model's config (`model.config`) to create one layer per attention layer up front; None creates
        layers as they are used. Other arguments: see `LowBitCacheSettings`.
    Sliding-window layers keep their whole history (the attention mask hides what is outside the window).

    Accounting: `nbytes` / `bits_per_value` count the stored state (low-bit pages + full-precision window),
    `working_nbytes` the dequantized compute copy (dequantized_copy=True).
    """

    def __init__(self, config: Any = None, bits: int = 3, *, residual_length: int = 128, page_size: int = 128,
                 value_group_size: int | None = None, outlier_fraction: float = 0.0035,
                 value_outlier_fraction: float | None = None, outlier_tau: float = 2.0,
                 dequantized_copy: bool = True, key_clip_steps: int = 0, value_clip_steps: int | None = None,
                 key_clip_refine: int = 0, value_clip_refine: int = 2, outlier_select: str | None = None):
        self.settings = LowBitCacheSettings(bits=bits, residual_length=residual_length, page_size=page_size,
                                            outlier_fraction=outlier_fraction,
                                            value_outlier_fraction=value_outlier_fraction,
                                            outlier_tau=outlier_tau, value_group_size=value_group_size,
                                            dequantized_copy=dequantized_copy, key_clip_steps=key_clip_steps,
                                            value_clip_steps=value_clip_steps, key_clip_refine=key_clip_refine,
                                            value_clip_refine=value_clip_refine, outlier_select=outlier_select)
        if config is not None:
            layers = [LowBitLayer(self.settings) for _ in range(_num_attention_layers(config))]
            super().__init__(layers=layers)
        else:
            super().__init__(layer_class_to_replicate=functools.partial(LowBitLayer, self.settings))

    def __repr__(self) -> str:
        return (f"LowBitCache(bits={self.settings.bits}, layers={len(self.layers)}, tokens={self.get_seq_length()}, "
                f"bits_per_value={self.bits_per_value:.3f})")

    @property
    def _stores(self) -> list[LowBitKVStore]:
        return [layer.store for layer in self.layers if isinstance(layer, LowBitLayer)]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored state: codes, scales, zero points, outliers (values, indices, counts) and the
        full-precision window, over all layers."""
        return sum(store.nbytes for store in self._stores)

    @property
    def lowbit_nbytes(self) -> int:
        """Bytes of the quantized pages alone."""
        return sum(store.lowbit_nbytes for store in self._stores)

    @property
    def working_nbytes(self) -> int:
        """Bytes of the dequantized working copy kept for speed (0 with dequantized_copy=False)."""
        return sum(store.working_nbytes for store in self._stores)

    @property
    def num_values(self) -> int:
        """Scalars held (keys + values, every layer, every batch row, padding included)."""
        return sum(store.num_values for store in self._stores)

    @property
    def bits_per_value(self) -> float:
        """All-in stored bits per key/value scalar: 8 * nbytes / num_values (0.0 when empty)."""
        values = self.num_values
        return 8.0 * self.nbytes / values if values else 0.0

    @property
    def lowbit_num_values(self) -> int:
        """Scalars held in quantized pages."""
        return sum(2 * s.batch_size * s.num_heads * s.quantized * s.head_dim for s in self._stores)

    @property
    def lowbit_bits_per_value(self) -> float:
        """Bits per scalar of the quantized pages alone (the steady state of a long context)."""
        values = self.lowbit_num_values
        return 8.0 * self.lowbit_nbytes / values if values else 0.0

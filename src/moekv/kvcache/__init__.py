"""Paged KV cache: block pool, block tables, and page formats behind one interface."""

from __future__ import annotations

from moekv.config import CacheConfig
from moekv.kvcache.base import KVCache, KVCacheSpec
from moekv.kvcache.block_pool import BlockPool
from moekv.kvcache.manager import KVCacheManager

__all__ = ["KVCache", "KVCacheSpec", "BlockPool", "KVCacheManager",
           "kv_cache_class", "create_kv_cache"]


def kv_cache_class(kv_cache_dtype: str) -> type[KVCache]:
    """The format class for a canonical kv_cache_dtype (lazy import: a registry, not a big import)."""
    if kv_cache_dtype in ("bf16", "fp16", "fp32"):
        from moekv.kvcache.formats.full_precision import FullPrecisionKVCache

        return FullPrecisionKVCache
    if kv_cache_dtype in ("int4", "int3", "int2"):
        from moekv.kvcache.formats.lowbit import LowBitKVCache

        return LowBitKVCache
    raise ValueError(f"no KV cache format {kv_cache_dtype!r}")


def create_kv_cache(config: CacheConfig, spec: KVCacheSpec, num_pages: int, device) -> KVCache:
    """Instantiate the page format that `config.kv_cache_dtype` names (canonical, not "auto")."""
    return kv_cache_class(config.kv_cache_dtype)(spec, num_pages, device, config)

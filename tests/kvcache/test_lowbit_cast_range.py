"""Keys/values handed to a low-bit cache in a wider dtype than its staging dtype are checked after the cast:
an fp32 value beyond the fp16 range (65504) is Inf in an fp16 cache and must be reported like any other
non-finite key/value (KVCacheCorruptionError naming the request, nothing committed, no Inf stored), on the
lazy path (prefill, no hooks) and on the prepared decode path (begin_step / attention / end_step)."""

from __future__ import annotations

import pytest
import torch

from moekv.config import CacheConfig
from moekv.errors import KVCacheCorruptionError
from moekv.kvcache import KVCacheManager
from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import KVCacheSpec
from moekv.kvcache.formats.lowbit import LowBitKVCache
from moekv.kvcache.formats.lowbit_plan import DecodePlan
from tests.kvcache.test_lowbit_graph_decode import backend  # noqa: F401  (fixture: reference and Triton)

PAGE, HEADS, Q_HEADS, DIM, LAYERS, SCALE = 8, 2, 4, 32, 2, 0.18


def _cache():
    spec = KVCacheSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.float16)
    cache = LowBitKVCache(spec, 16, "cpu", CacheConfig(kv_cache_dtype="int3", page_size=PAGE, staging_pages=6))
    return cache, KVCacheManager(16, PAGE, on_pages_freed=cache.pages_freed)


def _layers(count: int, big: dict[int, int], generator: torch.Generator, kind: str = "key"):
    """fp32 query/key/value per layer; at layer l, token big[l] gets one key (or value) element of 7e4."""
    out = []
    for layer in range(LAYERS):
        query = torch.randn(count, Q_HEADS, DIM, generator=generator)
        key, value = (torch.randn(count, HEADS, DIM, generator=generator) for _ in range(2))
        if layer in big:
            (key if kind == "key" else value)[big[layer], 1, 5] = 7.0e4      # finite in fp32, Inf in fp16
        out.append((query, key, value))
    return out


def _no_inf_stored(cache):
    for layer in range(LAYERS):
        assert torch.isfinite(cache.staging_keys[layer]).all() and torch.isfinite(cache.staging_values[layer]).all()


@pytest.mark.parametrize("kind", ["key", "value"])
def test_lazy_path_reports_values_beyond_the_cache_dtype(kind):
    cache, manager = _cache()
    generator = torch.Generator().manual_seed(0)
    tables = [manager.grow("a", 5), manager.grow("b", 3)]
    meta = AttentionMetadata.build([5, 3], [0, 0], tables, PAGE, "cpu", request_ids=["a", "b"])
    data = _layers(8, {1: 6}, generator, kind)                  # token 6 is b's second token, last layer
    with pytest.raises(KVCacheCorruptionError) as info:
        for layer, (q, k, v) in enumerate(data):
            cache.attention(layer, q, k, v, meta, SCALE)
    assert info.value.request_ids == ["b"]
    _no_inf_stored(cache)


def test_prepared_decode_path_reports_values_beyond_the_cache_dtype(backend):  # noqa: F811
    cache, manager = _cache()
    cache.reserve_graph_decode(4)
    generator = torch.Generator().manual_seed(1)
    tables = [manager.grow("a", 3), manager.grow("b", 2)]
    prefill = AttentionMetadata.build([3, 2], [0, 0], tables, PAGE, "cpu", request_ids=["a", "b"])
    cache.begin_step(prefill)
    for layer, (q, k, v) in enumerate(_layers(5, {}, generator)):
        cache.attention(layer, q, k, v, prefill, SCALE)
    cache.end_step(prefill)
    tables = [manager.grow("a", 4), manager.grow("b", 3)]
    meta = AttentionMetadata.build([1, 1], [3, 2], tables, PAGE, "cpu", request_ids=["a", "b"])
    cache.begin_step(meta)
    assert isinstance(cache._plan, DecodePlan)
    for layer, (q, k, v) in enumerate(_layers(2, {0: 0}, generator)):     # a's new key, first layer
        cache.attention(layer, q, k, v, meta, SCALE)
    with pytest.raises(KVCacheCorruptionError) as info:
        cache.end_step(meta)
    assert info.value.request_ids == ["a"]
    _no_inf_stored(cache)

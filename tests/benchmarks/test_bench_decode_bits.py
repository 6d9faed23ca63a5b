"""benchmarks/decode_floor.py's KV bits per value at the nominal context (bench_decode's rows; no model, no GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode_floor import kv_bits_at
from moekv.config import CacheConfig
from moekv.core.lowbit_layout import QuantSpec
from moekv.kvcache import KVCacheSpec, accounting, create_kv_cache


def test_kv_bits_at_context_page_cycle_and_pages():
    # Mixtral-shaped heads (8 KV heads, head_dim 128), int3 defaults, bf16 staging, P = 128
    spec = KVCacheSpec(num_layers=1, num_kv_heads=8, head_dim=128, page_size=128, dtype=torch.bfloat16)
    cache = create_kv_cache(CacheConfig(kv_cache_dtype="int3"), spec, 8, "cpu")
    bits = kv_bits_at(cache, batch=1, context=512)
    key = QuantSpec(bits=3, axis="channel", head_dim=128, page_size=128)
    value = QuantSpec(bits=3, axis="token", head_dim=128, page_size=128,
                      outlier_capacity=QuantSpec.capacity_for(0.0025, 128, 128))
    pages = accounting.format_bits_per_value(key, value)
    assert bits["kv_page_bits_per_value"] == pytest.approx(pages) == pytest.approx(3.229, abs=1e-3)
    # a page-aligned context holds no staging page: exactly the pages' bits
    assert bits["kv_bits_at_context"] == pytest.approx(pages)
    # over a page's fill cycle, 127 of 128 lengths hold one bf16 staging page (16 * 128 bits per value-row):
    # by hand, the mean of (pages * 3.229 * 128 * n_pages + 16 * 128) / n over n = 512 .. 639
    by_hand = sum((pages * 128 * -(-n // 128) + (16 * 128 if n % 128 else 0)) / n for n in range(512, 640)) / 128
    assert bits["kv_bits_page_cycle_mean"] == pytest.approx(by_hand)
    assert bits["kv_bits_page_cycle_mean"] > bits["kv_bits_at_context"] + 3.0   # the tail at 512 tokens: ~3.5 bit

"""Config validation: every bad value gets a message naming the field and what is accepted."""

from __future__ import annotations

import pytest

from moekv.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig
from moekv.errors import ConfigError


def test_unknown_kv_cache_dtype_lists_the_accepted_ones():
    with pytest.raises(ConfigError) as info:
        CacheConfig(kv_cache_dtype="int5")
    message = str(info.value)
    assert "unknown kv_cache_dtype 'int5'" in message
    for name in ("auto", "bf16", "fp16", "fp32", "int4", "int3", "int2"):
        assert name in message


def test_kv_cache_dtype_spellings_are_canonicalised():
    assert CacheConfig(kv_cache_dtype="bfloat16").kv_cache_dtype == "bf16"
    assert CacheConfig(kv_cache_dtype="INT3").kv_cache_dtype == "int3"
    assert CacheConfig(kv_cache_dtype="int3").resolved_page_size == 128
    assert CacheConfig(kv_cache_dtype="bf16").resolved_page_size == 16
    assert CacheConfig(kv_cache_dtype="int2").bits == 2


@pytest.mark.parametrize("factory, message", [
    (lambda: ModelConfig(model="m", dtype="int8"), "unknown dtype 'int8'"),
    (lambda: ModelConfig(model=""), "model must be a path"),
    (lambda: ModelConfig(model="m", max_model_len=0), "max_model_len must be a positive integer"),
    (lambda: CacheConfig(page_size=0), "page_size must be an integer in [1, 4096]"),
    (lambda: CacheConfig(outlier_fraction=0.9), "outlier_fraction must be in [0, 0.5]"),
    (lambda: CacheConfig(key_axis="diagonal"), "key_axis must be one of"),
    (lambda: CacheConfig(memory_fraction=0), "memory_fraction must be in (0, 1]"),
    (lambda: CacheConfig(value_clip_steps=9), "value_clip_steps must be an integer in [0, 8]"),
    (lambda: CacheConfig(key_clip_steps=-1), "key_clip_steps must be an integer in [0, 8]"),
    (lambda: CacheConfig(value_clip_refine=9), "value_clip_refine must be an integer in [0, 8]"),
    (lambda: CacheConfig(outlier_select="magnitude"), "outlier_select must be one of"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (lambda: SchedulerConfig(max_num_batched_tokens=-5), "max_num_batched_tokens must be a positive integer"),
    (lambda: ParallelConfig(expert_parallel_size=0), "expert_parallel_size must be a positive integer"),
    (lambda: DeviceConfig(device="tpu"), "device must be auto, cpu, cuda or cuda:N"),
])
def test_invalid_configs(factory, message):
    with pytest.raises(ConfigError) as info:
        factory()
    assert message in str(info.value)


def test_configs_are_frozen():
    config = CacheConfig()
    with pytest.raises(Exception):
        config.page_size = 3  # type: ignore[misc]


def test_outlier_choices_agree_with_the_format():
    """config spells the low-bit outlier choices itself (it shares a layer with core): they must stay the format's."""
    from moekv.config import OUTLIER_SELECTS
    from moekv.core.lowbit_layout import OUTLIER_SELECTS as FORMAT_CHOICES
    assert OUTLIER_SELECTS == FORMAT_CHOICES

"""The low-bit cache's formats and capacity planning: the (key, value) QuantSpecs a CacheConfig asks for, the
default staging pool size, and the byte counts the engine sizes the page pool with.

`LowBitCapacity` is a mixin of `LowBitKVCache` (kvcache/formats/lowbit.py): its class methods answer before any
cache exists (bytes per page, fixed bytes, the graph decode workspace); `graph_decode_splits` reads the cache's
specs and device.
"""

from __future__ import annotations

import torch

from moekv.config import CacheConfig
from moekv.core.lowbit_layout import QuantSpec
from moekv.errors import ConfigError
from moekv.kvcache import accounting
from moekv.kvcache.base import KVCacheSpec

STAGING_SHARE = 8   # default staging pool: one staging page per 8 pages (at least 64, at most num_pages)


def quant_specs(spec: KVCacheSpec, config: CacheConfig) -> tuple[QuantSpec, QuantSpec]:
    """The (key, value) page formats a cache config asks for."""
    if not config.is_low_bit:
        raise ConfigError("the low-bit KV format needs kv_cache_dtype int4, int3 or int2, "
                          f"got {config.kv_cache_dtype!r}")
    common = dict(bits=config.bits, head_dim=spec.head_dim, page_size=spec.page_size,
                  group_size=config.token_group_size, outlier_tau=config.outlier_tau,
                  outlier_select=config.resolved_outlier_select)
    try:
        key_spec = QuantSpec(axis=config.key_axis, **common, outlier_capacity=QuantSpec.capacity_for(
            config.key_outlier_fraction, spec.page_size, spec.head_dim), clip_steps=config.key_clip_steps,
            clip_refine=min(config.key_clip_refine, config.key_clip_steps))
        value_spec = QuantSpec(axis="token", **common, outlier_capacity=QuantSpec.capacity_for(
            config.value_outlier_fraction, spec.page_size, spec.head_dim), clip_steps=config.value_clip_steps,
            clip_refine=min(config.value_clip_refine, config.value_clip_steps))
    except ValueError as exc:
        raise ConfigError(f"low-bit KV cache: {exc}") from None
    return key_spec, value_spec


def default_staging_pages(num_pages: int, config: CacheConfig) -> int:
    if config.staging_pages is not None:
        return config.staging_pages
    return min(num_pages, max(64, -(-num_pages // STAGING_SHARE)))


class LowBitCapacity:
    """Capacity planning of LowBitKVCache (see the module docstring); a mixin, not a cache of its own."""

    @classmethod
    def bytes_per_page(cls, spec: KVCacheSpec, config: CacheConfig | None = None) -> int:
        """Low-bit page bytes across layers, plus (default staging pool) 1/8 of a staging page.

        With `config.staging_pages` set, the staging pool is a fixed cost instead: `fixed_bytes`.
        """
        config = config if config is not None else CacheConfig(kv_cache_dtype="int3")
        key_spec, value_spec = quant_specs(spec, config)
        page = accounting.lowbit_page_bytes(key_spec, value_spec, spec.num_kv_heads, spec.num_layers)
        if config.staging_pages is None:
            page += -(-cls.staging_page_bytes(spec) // STAGING_SHARE)
        return page

    @classmethod
    def fixed_bytes(cls, spec: KVCacheSpec, config: CacheConfig) -> int:
        """Bytes not proportional to num_pages: the staging pool when `config.staging_pages` is set."""
        return 0 if config.staging_pages is None else config.staging_pages * cls.staging_page_bytes(spec)

    @classmethod
    def graph_workspace_bytes(cls, spec: KVCacheSpec, config: CacheConfig, num_query_heads: int,
                              max_batch: int, max_model_len: int) -> int:
        """The v7 decode kernel's split-K buffers of the largest bucket (fp32 partial outputs [B, Hkv, splits,
        8, D] and their log-sum-exp; ops/cuda/lowbit_decode.py), at the split count of an H100/H200's 132 SMs."""
        from moekv.ops.cuda import lowbit_decode   # host-side planning only (nothing is built or launched)

        splits = lowbit_decode.graph_split_count(max_batch, spec.num_kv_heads, -(-max_model_len // spec.page_size),
                                                 132, int(config.kv_cache_dtype[3:]))
        return lowbit_decode.workspace_bytes(max_batch, spec.num_kv_heads, splits, spec.head_dim)

    def graph_decode_splits(self, batch: int, max_model_len: int) -> int | None:
        """A bucket's split-K count: the v7 decode kernel's plan where it takes this format on this device (at
        most TABLE_MAX pages per split), else the general Triton kernel's."""
        from moekv.ops.cuda import lowbit_decode

        if self.device.type == "cuda" and lowbit_decode.supports(self.key_spec, self.value_spec, self.spec.head_dim):
            return lowbit_decode.graph_splits(batch, self.spec.num_kv_heads, max_model_len, self.device,
                                              self.key_spec.bits)
        from moekv.ops.triton.attention.split_k import plan_splits

        return plan_splits(batch, self.spec.num_kv_heads, max_model_len, 64, self.device)[0]

    @staticmethod
    def staging_page_bytes(spec: KVCacheSpec) -> int:
        element = torch.empty((), dtype=spec.dtype).element_size()
        return accounting.staging_page_bytes(spec.page_size, spec.num_kv_heads, spec.head_dim, element,
                                             spec.num_layers)

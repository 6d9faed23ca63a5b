"""The full-precision page format (bf16 / fp16 / fp32): pages hold keys and values as they are."""

from __future__ import annotations

import torch

from moekv.config import CacheConfig
from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import FusedWriteTarget, KVCache, KVCacheSpec
from moekv.ops import dispatch


class FullPrecisionKVCache(KVCache):
    """key_pages / value_pages: [num_layers, num_pages, page_size, Hkv, D] in the cache dtype.

    Graph-capturable decode: the write is an index_copy_ through the device slot_mapping (or, through
    `fused_write_target`, the model's rotary kernel's stores to the same rows) and the decode kernel honours
    `meta.fixed_num_splits`; no per-step host state, so the step hooks are no-ops.
    """

    supports_graph_decode = True

    def __init__(self, spec: KVCacheSpec, num_pages: int, device, config: CacheConfig | None = None):
        super().__init__(spec, num_pages, device, config)
        self.name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[spec.dtype]
        shape = (spec.num_layers, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self.key_pages = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        self.value_pages = torch.zeros(shape, dtype=spec.dtype, device=self.device)

    @classmethod
    def bytes_per_page(cls, spec: KVCacheSpec, config: CacheConfig | None = None) -> int:
        element = torch.empty((), dtype=spec.dtype).element_size()
        return 2 * spec.num_layers * spec.page_size * spec.num_kv_heads * spec.head_dim * element

    def graph_decode_splits(self, batch: int, max_model_len: int) -> int | None:
        """The bucket's split count: planned for the GPU's size (split_k.plan_splits; the kernel sizes each
        sequence's splits from it), or in the batch-invariant mode enough splits of a fixed token count for
        max_model_len (the same splits for a sequence in every bucket: ops.triton.attention.invariant)."""
        if dispatch.batch_invariant():
            from moekv.ops.triton.attention import invariant   # host-side planning only (no kernel launch)

            return invariant.num_splits(max_model_len)
        from moekv.ops.triton.attention.split_k import plan_splits   # host-side planning only (no kernel launch)

        return plan_splits(batch, self.spec.num_kv_heads, max_model_len, 64, self.device)[0]

    def reserve_graph_decode(self, max_batch: int) -> None:
        """The decode kernel's split-combine arrival counters (one per (sequence, kv head)), allocated before
        any graph is captured; shared by every layer (they are zero again after each launch)."""
        if self.device.type == "cuda":
            from moekv.ops.triton.attention.split_k import arrival_counters   # allocation only (no launch)

            arrival_counters(self.device, max_batch * self.spec.num_kv_heads)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata) -> None:
        """Scatter the new tokens' keys/values [T, Hkv, D] to their slots."""
        flat_keys = self.key_pages[layer].view(-1, self.spec.num_kv_heads, self.spec.head_dim)
        flat_values = self.value_pages[layer].view(-1, self.spec.num_kv_heads, self.spec.head_dim)
        flat_keys.index_copy_(0, meta.slot_mapping, key.to(self.spec.dtype))
        flat_values.index_copy_(0, meta.slot_mapping, value.to(self.spec.dtype))

    def attention(self, layer, query, key, value, meta, scale):
        self.write(layer, key, value, meta)
        return self.attention_prewritten(layer, query, meta, scale)

    def fused_write_target(self, layer, meta):
        """The layer's pages as rows [num_pages * P, Hkv, D] and the step's slot mapping: a kernel that writes
        key / value row slot_mapping[t] does what `write` does."""
        rows = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        return FusedWriteTarget(self.key_pages[layer].view(rows), self.value_pages[layer].view(rows), meta.slot_mapping)

    def attention_prewritten(self, layer, query, meta, scale):
        return dispatch.paged_attention_full_precision(
            query, self.key_pages[layer], self.value_pages[layer], meta, scale)

    def gather(self, layer: int, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `num_tokens` keys and values, [num_tokens, Hkv, D] each (reference path)."""
        pages = torch.tensor(block_table, dtype=torch.long, device=self.device)
        keys = self.key_pages[layer].index_select(0, pages).flatten(0, 1)[:num_tokens]
        values = self.value_pages[layer].index_select(0, pages).flatten(0, 1)[:num_tokens]
        return keys, values

    def bits_per_value(self, num_tokens_per_seq: list[int]) -> float:
        return 8.0 * torch.empty((), dtype=self.spec.dtype).element_size()

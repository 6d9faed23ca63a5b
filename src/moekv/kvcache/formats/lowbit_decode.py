"""The low-bit cache's prepared decode step (a DecodePlan that begin_step built): its device work, layer by layer.

`PreparedDecodeStep` is a mixin of `LowBitKVCache` (kvcache/formats/lowbit.py), which holds the state it reads
(the specs, the stacked low-bit pages and their per-layer views, the staging pools, the block map, the step's
plan and its persistent rows, the new-token buffers and the device counters). Everything here is device work on
persistent buffers sliced to [:B]: fixed shapes, no host reads, so a CUDA graph can capture it.

A layer of a prepared decode step:
  1. the staging write of its new tokens, in one of two places:
     - unfused (`attention` -> `_decode_attention`): `dispatch.stage_decode_tokens` checks each token's key
       and value rows, ORs "non-finite" into its flag and writes the rows (zeros where non-finite) to its
       staging row and to the persistent copies the attention reads;
     - fused (the attention layer with KernelConfig.fused_decode_layer): `fused_write_target` hands the
       rotary kernel a checked FusedWriteTarget (the layer's staging rows, the step's staging rows and
       flags, the copies), `dispatch.qk_norm_rotary_write` does the same work in the rotary launch, and the
       layer calls `attention_prewritten` -- one launch fewer a layer.
  2. the attention (`dispatch.paged_attention_lowbit`) over the cached context and the checked copies;
  3. `_after_attention`: nothing, except after the last layer: one masked, fixed-shape launch for every layer
     (`dispatch.quantize_staged_kv_counted_layers`, grid [B, Hkv, 2 * L] on `key_pages_stacked` /
     `value_pages_stacked`) quantizes the key and value pages that filled from their staging blocks and adds
     the statistics to the device counters. Safe: every layer's attention of this step reads those pages from
     staging (their blocks return only at end_step), and the launch is part of the step's forward, so the
     device runs it before the next step's kernels (also for overlapped steps, whose begin_step returns the
     blocks early).
"""

from __future__ import annotations

import torch

from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import FusedWriteTarget
from moekv.kvcache.formats.lowbit_plan import DecodePlan
from moekv.ops import dispatch

# Device counters kept by the cache, in this order (LowBitKVCache.stats()).
COUNTERS = ("page_heads_quantized", "key_budget_hits", "value_budget_hits", "key_outliers", "value_outliers",
            "key_qualifying", "value_qualifying")

# Counter indices (budget hits, outliers, qualifying, page heads or -1) the decode step's quantizer adds to,
# for the keys and for the values (page heads are counted once, with the keys).
DECODE_COUNTERS = tuple(
    (COUNTERS.index(f"{kind}_budget_hits"), COUNTERS.index(f"{kind}_outliers"), COUNTERS.index(f"{kind}_qualifying"),
     COUNTERS.index("page_heads_quantized") if kind == "key" else -1) for kind in ("key", "value"))


class PreparedDecodeStep:
    """The prepared decode step of LowBitKVCache (see the module docstring); a mixin, not a cache of its own."""

    def fused_write_target(self, layer: int, meta: AttentionMetadata) -> FusedWriteTarget | None:
        """A decode step prepared by begin_step(meta) (a DecodePlan with its rows): the checked target -- the
        layer's staging pools as flat rows [blocks * block, Hkv, D], the new tokens' staging rows, the step's flags and
        the persistent new-token copies -- so the rotary kernel does stage_decode_tokens' work (one launch fewer
        a layer). The rows are of the staging dtype: a model of another dtype gets them too and the dispatch
        rounds to it before checking (its unfused fallback: rotary, then stage_decode_tokens). Other steps
        (lazy plans, prefill, a StepPlan): None, the cache stores the keys and values itself."""
        plan = self._plan
        if not (isinstance(plan, DecodePlan) and plan.meta is meta and self._plan_hooked and plan.rows is not None):
            return None
        count = meta.num_seqs
        rows = plan.rows
        shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        key_copy, value_copy = self._new_token_buffers(self.staging_keys.dtype, self.staging_values.dtype)
        return FusedWriteTarget(self.staging_keys[layer].view(shape), self.staging_values[layer].view(shape),
                                rows.index[0, :count], rows.flags[:count], key_copy[:count], value_copy[:count])

    def attention_prewritten(self, layer: int, query: torch.Tensor, meta: AttentionMetadata,
                             scale: float) -> torch.Tensor:
        """The decode step whose new tokens the rotary kernel staged already (fused_write_target's checked
        write): the attention over the copies, then `_after_attention` (after the last layer: the all-layers
        quantizer), as `_decode_attention` after its stage."""
        target = self.fused_write_target(layer, meta)
        if target is None:
            raise RuntimeError("attention_prewritten without a fused write target (no decode step of this meta "
                               "prepared by begin_step)")
        return self._attend_staged(layer, query, target.key_copy, target.value_copy, meta, scale)

    def _decode_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """`attention` in a decode step prepared by begin_step (the unfused layer): the staging write, then as
        `attention_prewritten`. Fixed shapes [B], persistent buffers, no host reads."""
        count = meta.num_seqs
        if key.shape[0] != count:
            raise ValueError(f"a decode step of {count} sequences got {key.shape[0]} new tokens")
        rows = self._plan.rows
        key_out, value_out = self._new_token_buffers(key.dtype, value.dtype)
        # one launch: finiteness of each token's key and value rows -> its flag (OR), and the rows (zeros
        # when non-finite) -> its staging row and the persistent copies the attention reads. Writing the
        # staging row first is invisible to the attention: that row lies past the token's context.
        # (With the fused decode layer the rotary kernel does this: fused_write_target, attention_prewritten.)
        key, value = dispatch.stage_decode_tokens(
            key, value, self.staging_keys[layer], self.staging_values[layer], rows.index[0, :count],
            rows.flags[:count], key_out[:count], value_out[:count])                # [B, Hkv, D]
        return self._attend_staged(layer, query, key, value, meta, scale)

    def _attend_staged(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """The decode step's layer after its staging write (stage_decode_tokens, or the rotary kernel's checked
        write), where the two paths meet: the attention (the new tokens' checked key / value [B, Hkv, D] as
        given), then `_after_attention`."""
        out = dispatch.paged_attention_lowbit(
            query, key, value, self.key_pages[layer], self.value_pages[layer], self.key_spec, self.value_spec,
            self.staging_keys[layer], self.staging_values[layer], self.slots.device_map, meta, scale)
        self._after_attention(layer, meta.num_seqs)
        return out

    def _after_attention(self, layer: int, count: int) -> None:
        """A prepared decode step, after layer `layer`'s attention: at the last layer, one launch for every
        layer, keys and values: pages that filled (page id >= 0) are quantized from their staging blocks, the
        statistics added to the counters by the kernel (masked: skipped entries add nothing). Every layer's
        attention of this step read those pages from staging (their blocks return at end_step), so quantizing
        them after the last one changes nothing the step reads; the next step reads the low-bit pages."""
        if layer != self.spec.num_layers - 1:
            return
        rows = self._plan.rows
        dispatch.quantize_staged_kv_counted_layers(
            self.staging_keys, self.staging_values, rows.blocks[:count], rows.index[1, :count], self.key_spec,
            self.value_spec, self.key_pages_stacked, self.value_pages_stacked, self._counters, *DECODE_COUNTERS)

    def _new_token_buffers(self, key_dtype: torch.dtype, value_dtype: torch.dtype):
        """Persistent [max_batch, Hkv, D] buffers of the new tokens' zero-checked key and value (one pair per
        dtype pair, allocated at reserve_graph_decode for the cache dtype; captured graphs keep them)."""
        buffers = self._new_kv.get((key_dtype, value_dtype))
        if buffers is None:
            shape = (self._graph_batch, self.spec.num_kv_heads, self.spec.head_dim)
            buffers = (torch.empty(shape, dtype=key_dtype, device=self.device),
                       torch.empty(shape, dtype=value_dtype, device=self.device))
            self._new_kv[(key_dtype, value_dtype)] = buffers
        return buffers

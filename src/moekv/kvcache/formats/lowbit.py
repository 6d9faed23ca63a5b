"""The low-bit page format (int4 / int3 / int2 with sparse fp16 outliers) and its full-precision tail.

Every page id below num_pages owns low-bit storage (`key_pages[layer]`, `value_pages[layer]`: PackedPages
indexed [num_pages, Hkv, ...]). A small pool of full-precision *staging* blocks (CacheConfig.staging_block_size
tokens each; the whole page by default) holds the partly filled last page of each sequence (and the first
`fp_sink_pages` pages, if asked): `staging_block_map[page]` lists its blocks ([P / block], -1 where none is
held; all -1 when the page is read from low-bit storage). A page is quantized once, when a step's write fills it
(prefill quantizes whole pages straight from the incoming tokens), and its blocks return to the pool. With
CacheConfig.lazy_partial_page the partly filled page is a staging-only id (`staging_only_ids`, beyond
num_pages: no low-bit storage) until the step that fills it, when the manager gives it a real id
(`page_renamed`). Layout and formulas: lowbit_layout.py and docs/kv-format.md; the formats a
config asks for and the byte counts the page pool is sized with: lowbit_capacity.py.

Attention: each new token attends to its sequence's cached context (low-bit pages dequantized,
staging pages as stored) and to the step's new tokens up to itself in full precision; then the new
tokens are written.

Non-finite keys/values: detected on the device in every layer after rounding to the cache dtype (an fp32
value beyond the fp16 range is Inf there), written as zeros (a page never holds NaN/Inf), and reported once
per step, after the last layer, as KVCacheCorruptionError carrying
`.seq_indices` and `.request_ids`. A step that raises is not committed: every sequence's cached
context is as before the step, so the engine may end the bad requests and re-run the rest.

Step hooks (CUDA-graph decode): `begin_step(meta)` plans the step on the host before the forward and
`end_step(meta)` checks and commits it after; `attention()` then does device work only. For a decode
step of at most `reserve_graph_decode(max_batch)` sequences the plan is three fixed-size index rows in
persistent device buffers (staging row of each new token, page it fills or -1, that page's staging blocks) and
a persistent per-sequence non-finite flag, all in one buffer (lowbit_plan.StepRows) whose host->device
copy also clears the flags (no kernel). A graph bucket holds that buffer after its own rows
(`graph_step_bytes`, `bind_graph_step`): begin_step then only writes the host rows and the bucket's one
copy carries them (no copy, event or sync of the cache's own); other decode steps within the reservation
use the cache's own buffer, copied by begin_step. `step_flags(meta)` is the flag row: the graph runner
copies it into the outputs it reads back anyway and hands the values to `end_step(meta, flags)`, so the
cache adds no host read of its own to an ordinary decode step (blocks taken or returned when a staging block
starts or fills add a small map update on those steps only). The step's device work, layer by layer
(lowbit_decode.py, `PreparedDecodeStep`): the staging write of the new tokens (`dispatch.stage_decode_tokens`,
or, with the fused decode layer, the rotary launch itself through `fused_write_target`'s checked target, then
`attention_prewritten`), the attention, and after the last layer's attention one masked, fixed-shape launch
that quantizes the pages that filled, of every layer (`dispatch.quantize_staged_kv_counted_layers` on the
stacked storage `key_pages_stacked` / `value_pages_stacked`).
Without begin_step (tests, prefill until the runner calls the hooks) the plan is built lazily at
layer 0 and checked/committed after the last layer, as before.
"""

from __future__ import annotations

import torch

from moekv.config import CacheConfig
from moekv.errors import KVCacheCorruptionError
from moekv.kvcache import accounting
from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import KVCache, KVCacheSpec
from moekv.core.lowbit_layout import PackedPages, QuantSpec
from moekv.kvcache.formats.lowbit_capacity import (STAGING_SHARE, LowBitCapacity, default_staging_pages,
                                                   quant_specs)
from moekv.kvcache.formats.lowbit_plan import (DecodePlan, StagingBlocks, StepPlan, StepRows, build_decode_plan,
                                               build_plan, step_bytes)
from moekv.kvcache.formats.lowbit_decode import COUNTERS, PreparedDecodeStep
from moekv.ops import dispatch

__all__ = ["LowBitKVCache", "STAGING_SHARE", "default_staging_pages", "quant_specs"]


class LowBitKVCache(LowBitCapacity, PreparedDecodeStep, KVCache):
    """int4 / int3 / int2 pages plus a full-precision staging pool; see the module docstring (the page formats
    and capacity planning: LowBitCapacity, lowbit_capacity.py; the prepared decode step's device work:
    PreparedDecodeStep, lowbit_decode.py)."""

    supports_graph_decode = True

    def __init__(self, spec: KVCacheSpec, num_pages: int, device, config: CacheConfig | None = None,
                 num_staging_pages: int | None = None):
        super().__init__(spec, num_pages, device, config)
        self.name = self.config.kv_cache_dtype
        self.key_spec, self.value_spec = quant_specs(spec, self.config)
        heads = spec.num_kv_heads
        # every layer's pages in one allocation per tensor ([L, N, Hkv, ...]: the decode step's one quantizer
        # launch writes all layers); key_pages[layer] / value_pages[layer] are dense views of layer `layer`
        self.key_pages_stacked = PackedPages.empty(self.key_spec, num_pages, heads, self.device, spec.num_layers)
        self.value_pages_stacked = PackedPages.empty(self.value_spec, num_pages, heads, self.device,
                                                     spec.num_layers)
        self.key_pages = [self.key_pages_stacked.layer(i) for i in range(spec.num_layers)]
        self.value_pages = [self.value_pages_stacked.layer(i) for i in range(spec.num_layers)]
        num_slots = num_staging_pages or default_staging_pages(num_pages, self.config)
        block = self.config.resolved_staging_block
        if spec.page_size % block:
            raise ValueError(f"staging blocks of {block} tokens do not divide pages of {spec.page_size}")
        per_page = spec.page_size // block
        num_blocks = num_slots * per_page                 # the same bytes as num_slots whole staging pages
        self.num_staging_only = num_slots if self.config.lazy_partial_page else 0
        staging_shape = (spec.num_layers, num_blocks, block, heads, spec.head_dim)
        self.staging_keys = torch.zeros(staging_shape, dtype=spec.dtype, device=self.device)   # [L, NB, SB, H, D]
        self.staging_values = torch.zeros(staging_shape, dtype=spec.dtype, device=self.device)
        self.slots = StagingBlocks(num_blocks, num_pages + self.num_staging_only, per_page, block, self.device,
                                   lowbit_pages=num_pages)
        self._plan: StepPlan | DecodePlan | None = None
        self._plan_hooked = False       # built by begin_step: end_step checks and commits it
        self._pending: list[StepPlan | DecodePlan] = []   # plans begin_step built, oldest first, until end_step
        self._graph_batch = 0           # reserve_graph_decode: decode steps of up to this many sequences
        self._rows: StepRows | None = None   # the cache's own step buffer (decode steps not in a graph bucket)
        self._new_kv: dict = {}                          # (key, value dtype) -> [max_batch, Hkv, D] buffers
        self._index_copied = None                        # CUDA event: the last copy out of _rows is done
        self._counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=self.device)

    @property
    def staging_block_map(self) -> torch.Tensor:
        """[num_ids, P / block] int32 device map: staging blocks of each page, all -1 when it is read from low-bit
        storage (num_ids = num_pages plus the staging-only ids)."""
        return self.slots.device_map

    def staging_only_ids(self) -> range | None:
        return range(self.num_pages, self.num_pages + self.num_staging_only) if self.num_staging_only else None

    def page_renamed(self, old: int, new: int) -> None:
        if not self.num_staging_only:
            raise RuntimeError("page_renamed without lazy_partial_page")
        self.slots.rename(old, new)

    # -- step hooks (CUDA-graph decode) ---------------------------------------------------------
    def reserve_graph_decode(self, max_batch: int) -> None:
        """Allocate the persistent buffers of decode steps of up to `max_batch` sequences (once: captured
        graphs keep their addresses; a later call asking for no more is a no-op)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if self._graph_batch:
            if max_batch > self._graph_batch:
                raise RuntimeError(f"graph decode buffers are reserved for {self._graph_batch} sequences and "
                                   f"cannot grow to {max_batch} (captured graphs hold their addresses)")
            return
        cuda = self.device.type == "cuda"
        width = step_bytes(max_batch, self.slots.per_page)
        self._rows = StepRows(torch.zeros(width, dtype=torch.uint8, pin_memory=cuda),      # pinned on CUDA
                              torch.zeros(width, dtype=torch.uint8, device=self.device), max_batch,
                              self.slots.per_page)
        self._rows.index.fill_(-1)
        self._rows.blocks.fill_(-1)
        self._graph_batch = max_batch
        self._new_token_buffers(self.spec.dtype, self.spec.dtype)
        self._index_copied = torch.cuda.Event() if cuda else None

    def graph_step_bytes(self, batch: int) -> int:
        """A graph bucket's share for this cache: the decode step's index rows and flags (lowbit_plan.step_bytes)."""
        return step_bytes(batch, self.slots.per_page) if self._graph_batch and batch <= self._graph_batch else 0

    def bind_graph_step(self, meta: AttentionMetadata, host: torch.Tensor, device: torch.Tensor) -> None:
        """The bucket of `meta` holds this decode step's rows and flags: begin_step(meta) writes `host` only."""
        meta.step_state = StepRows(host, device, meta.num_seqs, self.slots.per_page)

    def begin_step(self, meta: AttentionMetadata, overlapped: bool = False) -> None:
        """Plan the step before its forward (host work, no sync): take staging blocks, and for a decode step
        within the reserved size write the fixed-size index rows (and zeroed non-finite flags): into the graph
        bucket's host buffer (its copy carries them), else into the cache's own buffer, copied here (one
        host->device copy, no kernel). Staging blocks taken or returned add a map update. Replaces a plan
        still pending (a forward that failed before end_step), unless `overlapped`: the pending decode plans
        (steps launched before, ended later) stay, and the blocks of the pages they fill return now, as their
        end_step would have returned them before this plan (the pages were quantized in those steps, which run
        first on the device), so this step reads them from low-bit storage and may take the same blocks."""
        if overlapped:
            for plan in self._pending:
                if not isinstance(plan, DecodePlan):
                    raise RuntimeError("an overlapped step follows a pending step that is not a decode step")
                if not plan.released:
                    self._release(plan.release)
                    plan.released = True
        else:
            self._pending = []
        self._plan, self._plan_hooked = None, False
        if self._graph_batch and 0 < meta.num_seqs <= self._graph_batch and meta.is_decode:
            plan = build_decode_plan(meta, self.spec.page_size, self.config.fp_sink_pages, self.slots)
            bound = meta.step_state
            if isinstance(bound, StepRows) and bound.batch == meta.num_seqs:
                bound.write(plan)                        # the runner's bucket copy carries it (after this call)
            else:
                if self._index_copied is not None:
                    self._index_copied.synchronize()     # the previous step's copy has left the host buffer
                rows = self._rows
                rows.write(plan)
                # index rows and zeroed flags: the whole buffer in one contiguous copy
                rows.device_bytes.copy_(rows.host_bytes, non_blocking=True)
                if self._index_copied is not None:  # on the stream the copy went to (the cache's device)
                    self._index_copied.record(torch.cuda.current_stream(self.device))
        else:
            plan = build_plan(meta, self.spec.page_size, self.config.fp_sink_pages, self.slots, self.device)
        self._plan, self._plan_hooked = plan, True
        self._pending.append(plan)

    def step_flags(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """[B] bool device flags of a decode step prepared by begin_step(meta) (persistent: a view of the
        buffer begin_step's copy clears), else None."""
        plan = self._plan
        if isinstance(plan, DecodePlan) and plan.meta is meta and self._plan_hooked:
            return plan.rows.flags[:meta.num_seqs]
        return None

    def end_step(self, meta: AttentionMetadata, flags: list[bool] | None = None) -> None:
        """After a completed forward: raise KVCacheCorruptionError for non-finite sequences (uncommitted),
        else commit (staging blocks of pages that filled return). One host read, the step's sync, unless the
        caller passes the flags of step_flags(meta) it read back itself. No-op when no plan of `meta` is
        pending from begin_step (of several, the oldest ends: overlapped steps)."""
        plan = next((p for p in self._pending if p.meta is meta), None)
        if plan is None:
            return
        self._pending.remove(plan)
        if plan is self._plan:
            self._plan, self._plan_hooked = None, False
        if isinstance(plan, DecodePlan):
            self._finish_decode(plan, flags)
        else:
            self._finish_step(plan)

    # -- the model-facing call ----------------------------------------------------------------
    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self._plan is None or self._plan.meta is not meta:      # no begin_step for this meta: plan lazily
            self._plan = build_plan(meta, self.spec.page_size, self.config.fp_sink_pages, self.slots, self.device)
            self._plan_hooked = False
        plan = self._plan
        # Round to the staging dtype first: what is checked is what is stored (an fp32 value above 65504 is
        # Inf in an fp16 cache and must be caught as non-finite). A no-op when the dtypes agree (the engine).
        key, value = key.to(self.staging_keys.dtype), value.to(self.staging_values.dtype)
        if isinstance(plan, DecodePlan):
            return self._decode_attention(layer, query, key, value, meta, scale)
        finite = torch.isfinite(key).flatten(1).all(1) & torch.isfinite(value).flatten(1).all(1)   # [T]
        plan.bad_tokens = ~finite if plan.bad_tokens is None else plan.bad_tokens | ~finite
        keep = finite[:, None, None]
        key = torch.where(keep, key, torch.zeros((), dtype=key.dtype, device=key.device))          # [T, Hkv, D]
        value = torch.where(keep, value, torch.zeros((), dtype=value.dtype, device=value.device))
        out = dispatch.paged_attention_lowbit(
            query, key, value, self.key_pages[layer], self.value_pages[layer], self.key_spec, self.value_spec,
            self.staging_keys[layer], self.staging_values[layer], self.slots.device_map, meta, scale)
        for kind, new, staging, pages, spec in (
                ("key", key, self.staging_keys[layer], self.key_pages[layer], self.key_spec),
                ("value", value, self.staging_values[layer], self.value_pages[layer], self.value_spec)):
            self._write(kind, new, staging, pages, spec, plan)
        if layer == self.spec.num_layers - 1 and not self._plan_hooked:
            self._finish_step(plan)
        return out

    def _write(self, kind: str, new: torch.Tensor, staging: torch.Tensor, pages: PackedPages, spec: QuantSpec,
               plan: StepPlan) -> None:
        """Append the new tokens [T, Hkv, D] of one layer: staging rows, and pages that fill are quantized."""
        flat = staging.view(-1, *staging.shape[2:])                                # [S * P, Hkv, D]
        if plan.stage_tokens.numel():
            flat.index_copy_(0, plan.stage_rows, new.index_select(0, plan.stage_tokens).to(flat.dtype))
        count = plan.quant_pages.numel()
        if not count:
            return
        buffer = flat.new_empty((count * spec.page_size,) + tuple(flat.shape[1:]))   # [m * P, Hkv, D]
        if plan.quant_from_staging.numel():
            buffer.index_copy_(0, plan.quant_from_staging, flat.index_select(0, plan.quant_staging_rows))
        buffer.index_copy_(0, plan.quant_from_new, new.index_select(0, plan.quant_new_tokens).to(flat.dtype))
        packed, qualifying = dispatch.quantize_pages(
            buffer.unflatten(0, (count, spec.page_size)).transpose(1, 2), spec)       # [m, Hkv, P, D]
        pages.store(plan.quant_pages, packed)
        counters = self._counters
        counters[COUNTERS.index(f"{kind}_budget_hits")] += (qualifying > spec.outlier_capacity).sum()
        counters[COUNTERS.index(f"{kind}_outliers")] += packed.outlier_count.sum(dtype=torch.int64)
        counters[COUNTERS.index(f"{kind}_qualifying")] += qualifying.sum(dtype=torch.int64)
        if kind == "key":
            counters[COUNTERS.index("page_heads_quantized")] += qualifying.numel()

    def _finish_step(self, plan: StepPlan) -> None:
        """After the last layer: report non-finite sequences (uncommitted), else return released blocks."""
        if plan is self._plan:
            self._plan, self._plan_hooked = None, False
        bad = plan.bad_tokens
        if bad is not None and bool(bad.any()):                    # the one host sync of a step
            seq_indices = self._live(plan, sorted(set(plan.seq_of_token[bad].tolist())))
            if seq_indices:
                self._raise_corruption(plan.meta.request_ids, seq_indices)
        self._release(plan.release)

    def _finish_decode(self, plan: DecodePlan, flags: list[bool] | None = None) -> None:
        """end_step of a decode plan: one read of the per-sequence flags (unless given), then report or commit
        (an overlapped step's successor returned its blocks already)."""
        if flags is None:
            flags = plan.rows.flags[:plan.meta.num_seqs].tolist()     # the one host sync of a step
        elif len(flags) != plan.meta.num_seqs:
            raise ValueError(f"end_step got {len(flags)} flags for a step of {plan.meta.num_seqs} sequences")
        if any(flags):
            ids = plan.request_ids
            # padding sequences (request id "") write only the runner's scratch page: never reported
            seq_indices = self._live(plan, [i for i, bad in enumerate(flags)
                                            if bad and not (i < len(ids) and ids[i] == "")])
            if seq_indices:
                self._raise_corruption(plan.request_ids, seq_indices)
        if plan.release and not plan.released:   # pages filled this step (every page_size steps per sequence)
            self._release(plan.release)

    @staticmethod
    def _live(plan: StepPlan | DecodePlan, seq_indices: list[int]) -> list[int]:
        """The sequences of `seq_indices` none of whose pages was freed while the plan was pending."""
        if not plan.freed:
            return seq_indices
        tables = plan.tables if isinstance(plan, DecodePlan) else plan.meta.block_tables_host
        return [i for i in seq_indices if plan.freed.isdisjoint(tables[i])]

    def _raise_corruption(self, ids: list[str], seq_indices: list[int]) -> None:
        names = [ids[i] if i < len(ids) else f"sequence {i}" for i in seq_indices]
        raise KVCacheCorruptionError(
            f"non-finite keys or values for request(s) {', '.join(map(str, names))} (stored as zeros in their "
            "own pages); the step was not committed: end these requests and re-run it for the others",
            seq_indices=seq_indices, request_ids=names)

    def _release(self, release: list[tuple[int, int]]) -> None:
        """Commit: pages that filled give their staging blocks back (if they still hold the ones planned)."""
        pages = dict.fromkeys(page for page, blocks in release if tuple(self.slots.blocks(page)) == blocks)
        self.slots.give_back(list(pages))

    # -- lifecycle ----------------------------------------------------------------------------
    def pages_freed(self, pages: list[int]) -> None:
        """Freed pages give back their staging blocks; their low-bit storage is overwritten when refilled.

        A plan pending from begin_step stays (a request aborted between begin_step and end_step): the
        step's forward may still run it (a captured graph holds its index rows) and end_step still checks
        and commits the other sequences. Its writes for the freed pages land in blocks now free and in
        free pages (neither read before they are taken and refilled), its commit skips them (their blocks
        is no longer the one planned) and sequences holding a freed page are not reported. A lazy plan
        (no begin_step) is dropped, as before."""
        for plan in self._pending:
            plan.freed.update(pages)
        if self._plan is not None and not self._plan_hooked:
            self._plan = None
        self.slots.give_back(list(pages))

    def keeps_freed_page(self, page: int) -> bool:
        """Quantized pages do; a page still in staging (an fp sink page) gives its blocks back when freed."""
        return not self.slots.staged(page)

    # -- accounting ---------------------------------------------------------------------------
    def bits_per_value(self, num_tokens_per_seq: list[int]) -> float:
        element = torch.empty((), dtype=self.spec.dtype).element_size()
        return accounting.cache_bits_per_value(self.key_spec, self.value_spec, self.spec.num_kv_heads, element,
                                               num_tokens_per_seq, self.config.fp_sink_pages, self.slots.block,
                                               bool(self.num_staging_only))

    def page_bits_per_value(self) -> float:
        return accounting.format_bits_per_value(self.key_spec, self.value_spec)

    def full_precision_token_share(self, num_tokens_per_seq: list[int]) -> float:
        total = sum(num_tokens_per_seq)
        staged = sum(accounting.full_precision_tokens(n, self.spec.page_size, self.config.fp_sink_pages)
                     for n in num_tokens_per_seq)
        return staged / total if total else 0.0

    def stats(self) -> dict[str, float]:
        counts = dict(zip(COUNTERS, self._counters.tolist()))
        page_heads = max(counts["page_heads_quantized"], 1)
        return {
            "pages_quantized": counts["page_heads_quantized"] / (self.spec.num_kv_heads * self.spec.num_layers),
            "key_budget_hit_rate": counts["key_budget_hits"] / page_heads,
            "value_budget_hit_rate": counts["value_budget_hits"] / page_heads,
            "key_outliers_per_page_head": counts["key_outliers"] / page_heads,
            "value_outliers_per_page_head": counts["value_outliers"] / page_heads,
            "key_qualifying_per_page_head": counts["key_qualifying"] / page_heads,
            "value_qualifying_per_page_head": counts["value_qualifying"] / page_heads,
            "key_outlier_capacity": float(self.key_spec.outlier_capacity),      # slots per (page, head)
            "value_outlier_capacity": float(self.value_spec.outlier_capacity),
            "staging_pages_used": self.slots.num_used / self.slots.per_page,     # in whole pages' bytes
            "staging_pages": self.slots.num_blocks / self.slots.per_page,
            "format_bits_per_value": accounting.format_bits_per_value(self.key_spec, self.value_spec),
        }

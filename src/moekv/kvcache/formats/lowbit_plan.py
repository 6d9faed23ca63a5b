"""Per-step write plan of the low-bit cache: which new tokens go to staging pages, which pages fill
and are quantized (from which rows), which staging slots are taken and which return.

Built on the host once per step (from the metadata's host lists) and shared by every layer; the
cache commits it (returns slots) only after the last layer, so an aborted step leaves the cache as
it was for every sequence's context.

Two kinds of plan: `StepPlan` (any step: variable-size index tensors, pages that fill are quantized
from staged rows plus new tokens) and `DecodePlan` (a decode step, one new token per sequence: three
host lists of fixed length B that the cache copies into persistent device buffers, so the step's
device work has fixed shapes and can be captured in a CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moekv.errors import OutOfKVCacheError
from moekv.core.attention_metadata import AttentionMetadata


@dataclass
class StepPlan:
    """Index tensors (device, int64) one step's writes use in every layer. Rows are flat staging rows
    slot * P + offset, or rows of the step's new tokens [T]."""

    meta: AttentionMetadata
    stage_tokens: torch.Tensor      # [n] new-token rows written to staging
    stage_rows: torch.Tensor        # [n] their flat staging rows
    quant_pages: torch.Tensor       # [m] pages that are full after this step (quantized now)
    quant_from_staging: torch.Tensor    # [a] positions in the [m * P] quantize buffer filled from staging
    quant_staging_rows: torch.Tensor    # [a] ... from these flat staging rows
    quant_from_new: torch.Tensor        # [b] positions in the buffer filled from new tokens
    quant_new_tokens: torch.Tensor      # [b] ... from these new-token rows
    seq_of_token: torch.Tensor      # [T] sequence index of each new token
    release: list[tuple[int, int]] = field(default_factory=list)   # (page, slot) returned at commit
    bad_tokens: torch.Tensor | None = None   # [T] bool: non-finite key or value seen in any layer
    freed: set[int] = field(default_factory=set)   # pages freed while the plan was pending (see pages_freed)


@dataclass
class DecodePlan:
    """Host plan of a decode step (query length 1 for each of B sequences); entry i is sequence i.

    Every new token is written to a staging row, also when it fills its page; a page that fills is
    then quantized from its staging slot (all P rows) and the slot returns at commit."""

    meta: AttentionMetadata
    stage_rows: list[int]           # [B] flat staging row slot * P + offset of the new token
    quant_pages: list[int]          # [B] page this step fills (quantized now), or -1
    quant_slots: list[int]          # [B] staging slot of that page, or -1 (read only where quant_pages >= 0)
    release: list[tuple[int, int]] = field(default_factory=list)   # (page, slot) returned at commit, no repeats
    freed: set[int] = field(default_factory=set)   # pages freed while the plan was pending (see pages_freed)
    rows: "StepRows | None" = None  # the device rows the step's forward reads (set by the cache's begin_step)
    # The metadata's host lists as planned (a graph bucket's meta is refilled by the next step before an
    # overlapped step ends): request ids [B] and block tables [B]
    request_ids: list[str] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    released: bool = False          # its slots returned already (the next, overlapped step's begin_step)


def step_bytes(batch: int) -> int:
    """Bytes of a decode step's device state: three int64 index rows [3, batch] (staging row of each new token,
    page it fills or -1, that page's slot), then the per-sequence non-finite flags (bool [batch]) padded to 8."""
    return 3 * batch * 8 + -(-batch // 8) * 8


class StepRows:
    """Views of one decode-step buffer, host and device twins of `step_bytes(batch)` uint8 (8-byte aligned): the
    index rows the forward reads and the flags it sets. The host's flag bytes stay 0, so the host->device copy
    that carries the rows also clears the flags (no kernel). The owner of the buffer does that copy: the cache
    for its own buffer, the graph runner for a bucket's (KVCache.bind_graph_step)."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor, batch: int):
        size = step_bytes(batch)
        if host.dtype != torch.uint8 or device.dtype != torch.uint8 or host.numel() != size or device.numel() != size:
            raise ValueError(f"a decode step of {batch} sequences needs two uint8 buffers of {size} bytes, got "
                             f"{host.dtype} [{host.numel()}] and {device.dtype} [{device.numel()}]")
        index_bytes = 3 * batch * 8
        self.batch = batch
        self.host_bytes, self.device_bytes = host, device
        self.host = host[:index_bytes].view(torch.int64).view(3, batch).numpy()       # [3, B] (host memory)
        self.host[:] = -1
        self.index = device[:index_bytes].view(torch.int64).view(3, batch)           # [3, B] int64 device
        self.flags = device[index_bytes:index_bytes + batch].view(torch.bool)        # [B] bool device

    def write(self, plan: DecodePlan) -> None:
        """The plan's rows into the host twin (entries past the plan's batch are left as they are)."""
        count = len(plan.stage_rows)
        self.host[0, :count] = plan.stage_rows
        self.host[1, :count] = plan.quant_pages
        self.host[2, :count] = plan.quant_slots
        plan.rows = self


class StagingSlots:
    """Host bookkeeping of the full-precision staging pages and the device map page -> slot."""

    def __init__(self, num_slots: int, num_pages: int, device: torch.device):
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))   # pop() hands out slot 0 first
        self.slot_of_page: list[int] = [-1] * num_pages
        self.device_map = torch.full((num_pages,), -1, dtype=torch.int32, device=device)   # [num_pages]

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free)

    def take(self, page: int) -> int:
        if not self.free:
            raise OutOfKVCacheError(
                f"all {self.num_slots} full-precision staging pages are in use; each running sequence needs one "
                "(plus fp_sink_pages): raise CacheConfig.staging_pages")
        slot = self.free.pop()
        self.slot_of_page[page] = slot
        return slot

    def give_back(self, pages: list[int]) -> None:
        """Pages leave staging (quantized or freed); their slots return and the device map reads -1."""
        returned = [page for page in pages if self.slot_of_page[page] >= 0]
        for page in returned:
            self.free.append(self.slot_of_page[page])
            self.slot_of_page[page] = -1
        if returned:        # pageable -> device without a stream sync (the source is staged at once)
            ids = torch.tensor(returned, dtype=torch.long).to(self.device_map.device, non_blocking=True)
            self.device_map.index_fill_(0, ids, -1)

    def publish(self, pages: list[int]) -> None:
        """Copy the host map of these pages (newly given slots) to the device map."""
        if pages:           # pageable -> device copies without a stream sync (the source is staged at once)
            device = self.device_map.device
            ids = torch.tensor(pages, dtype=torch.long).to(device, non_blocking=True)
            slots = torch.tensor([self.slot_of_page[p] for p in pages], dtype=torch.int32).to(device, non_blocking=True)
            self.device_map.index_copy_(0, ids, slots)


def build_plan(meta: AttentionMetadata, page_size: int, fp_sink_pages: int, slots: StagingSlots,
               device: torch.device) -> StepPlan:
    """Plan one step's writes; takes staging slots for pages that stay in full precision."""
    stage_tokens, stage_rows = [], []
    quant_pages, from_staging, staging_rows, from_new, new_tokens = [], [], [], [], []
    release, taken = [], []
    start = 0
    try:
        for seq, (num_new, context_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            table, total = meta.block_tables_host[seq], context_len + num_new
            for index in range(context_len // page_size, -(-total // page_size)):
                page, page_start = table[index], index * page_size
                lo, hi = max(context_len, page_start), min(total, page_start + page_size)   # new positions here
                tokens = range(start + lo - context_len, start + hi - context_len)
                slot = slots.slot_of_page[page]
                if hi == page_start + page_size and index >= fp_sink_pages:    # full: quantize now
                    base = len(quant_pages) * page_size
                    quant_pages.append(page)
                    if lo > page_start:                                        # the older rows wait in staging
                        if slot < 0:
                            raise RuntimeError(f"page {page} holds {lo - page_start} tokens but no staging slot: "
                                               "the block tables disagree with the cache's state")
                        from_staging.extend(range(base, base + lo - page_start))
                        staging_rows.extend(range(slot * page_size, slot * page_size + lo - page_start))
                    from_new.extend(range(base + lo - page_start, base + page_size))
                    new_tokens.extend(tokens)
                    if slot >= 0:
                        release.append((page, slot))
                else:                                                          # stays in full precision
                    if slot < 0:
                        slot = slots.take(page)
                        taken.append(page)
                    stage_tokens.extend(tokens)
                    stage_rows.extend(range(slot * page_size + lo - page_start, slot * page_size + hi - page_start))
            start += num_new
    except Exception:
        slots.give_back(taken)          # nothing of the step is written: the slots it took return
        raise
    slots.publish(taken)

    def ids(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    seq_of_token = torch.repeat_interleave(torch.arange(meta.num_seqs), torch.tensor(meta.query_lens_host,
                                                                                      dtype=torch.long))
    return StepPlan(meta=meta, stage_tokens=ids(stage_tokens), stage_rows=ids(stage_rows),
                    quant_pages=ids(quant_pages), quant_from_staging=ids(from_staging),
                    quant_staging_rows=ids(staging_rows), quant_from_new=ids(from_new),
                    quant_new_tokens=ids(new_tokens), seq_of_token=seq_of_token.to(device), release=release)


def build_decode_plan(meta: AttentionMetadata, page_size: int, fp_sink_pages: int,
                      slots: StagingSlots) -> DecodePlan:
    """Plan a decode step (every query length 1); takes staging slots for pages without one.

    Unlike `build_plan`, the new token always goes to a staging row (a page that fills is quantized from
    its slot afterwards), so every page written in the step needs a slot. Several sequences may name the
    same page at offset 0 (the runner's padding sequences on its scratch page): they share its slot.
    Padding entries (request id "") never quantize their page, also when it fills (page_size 1): the
    scratch page keeps its slot and the statistics count real pages only.
    """
    stage_rows, quant_pages, quant_slots, release, taken = [], [], [], {}, []
    ids = meta.request_ids
    try:
        for seq, (num_new, context_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            if num_new != 1:
                raise ValueError(f"a decode plan needs one new token per sequence, sequence {seq} has {num_new}")
            index, offset = divmod(context_len, page_size)
            page = meta.block_tables_host[seq][index]
            slot = slots.slot_of_page[page]
            if slot < 0:
                if offset:
                    raise RuntimeError(f"page {page} holds {offset} tokens but no staging slot: "
                                       "the block tables disagree with the cache's state")
                slot = slots.take(page)
                taken.append(page)
            stage_rows.append(slot * page_size + offset)
            padding = seq < len(ids) and ids[seq] == ""                 # the runner's dummies: never quantized
            if offset == page_size - 1 and index >= fp_sink_pages and not padding:   # the page fills: quantize
                quant_pages.append(page)
                quant_slots.append(slot)
                release[page] = slot
            else:
                quant_pages.append(-1)
                quant_slots.append(-1)
    except Exception:
        slots.give_back(taken)          # nothing of the step is written: the slots it took return
        raise
    slots.publish(taken)
    return DecodePlan(meta=meta, stage_rows=stage_rows, quant_pages=quant_pages, quant_slots=quant_slots,
                      release=list(release.items()), request_ids=list(ids), tables=list(meta.block_tables_host))

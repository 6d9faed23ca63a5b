"""Per-step write plan of the low-bit cache: which new tokens go to staging rows, which pages fill
and are quantized (from which rows), which staging blocks are taken and which return.

The staging pool is held in blocks of `block` tokens (CacheConfig.staging_block_size; the whole page by
default): a page's row r lives in its block r // block, at flat staging row block_id * block + r % block.

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
    block_id * block + offset % block, or rows of the step's new tokens [T]."""

    meta: AttentionMetadata
    stage_tokens: torch.Tensor      # [n] new-token rows written to staging
    stage_rows: torch.Tensor        # [n] their flat staging rows
    quant_pages: torch.Tensor       # [m] pages that are full after this step (quantized now)
    quant_from_staging: torch.Tensor    # [a] positions in the [m * P] quantize buffer filled from staging
    quant_staging_rows: torch.Tensor    # [a] ... from these flat staging rows
    quant_from_new: torch.Tensor        # [b] positions in the buffer filled from new tokens
    quant_new_tokens: torch.Tensor      # [b] ... from these new-token rows
    seq_of_token: torch.Tensor      # [T] sequence index of each new token
    release: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)   # (page, blocks) returned at commit
    bad_tokens: torch.Tensor | None = None   # [T] bool: non-finite key or value seen in any layer
    freed: set[int] = field(default_factory=set)   # pages freed while the plan was pending (see pages_freed)


@dataclass
class DecodePlan:
    """Host plan of a decode step (query length 1 for each of B sequences); entry i is sequence i.

    Every new token is written to a staging row, also when it fills its page; a page that fills is
    then quantized from its staging blocks (all P rows) and the blocks return at commit."""

    meta: AttentionMetadata
    stage_rows: list[int]           # [B] flat staging row of the new token
    quant_pages: list[int]          # [B] page this step fills (quantized now), or -1
    quant_blocks: list[list[int]]   # [B][P / block] staging blocks of that page (read only where quant_pages >= 0)
    release: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)   # (page, blocks) at commit, no repeats
    freed: set[int] = field(default_factory=set)   # pages freed while the plan was pending (see pages_freed)
    rows: "StepRows | None" = None  # the device rows the step's forward reads (set by the cache's begin_step)
    # The metadata's host lists as planned (a graph bucket's meta is refilled by the next step before an
    # overlapped step ends): request ids [B] and block tables [B]
    request_ids: list[str] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    released: bool = False          # its blocks returned already (the next, overlapped step's begin_step)


def step_bytes(batch: int, blocks_per_page: int = 1) -> int:
    """Bytes of a decode step's device state: two int64 index rows [2, batch] (staging row of each new token, page
    it fills or -1), that page's staging blocks (int64 [batch, blocks_per_page]), then the per-sequence non-finite
    flags (bool [batch]) padded to 8."""
    return (2 + blocks_per_page) * batch * 8 + -(-batch // 8) * 8


class StepRows:
    """Views of one decode-step buffer, host and device twins of `step_bytes(batch, nb)` uint8 (8-byte aligned): the
    index rows and blocks the forward reads and the flags it sets. The host's flag bytes stay 0, so the
    host->device copy that carries the rows also clears the flags (no kernel). The owner of the buffer does that
    copy: the cache for its own buffer, the graph runner for a bucket's (KVCache.bind_graph_step)."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor, batch: int, blocks_per_page: int = 1):
        size = step_bytes(batch, blocks_per_page)
        if host.dtype != torch.uint8 or device.dtype != torch.uint8 or host.numel() != size or device.numel() != size:
            raise ValueError(f"a decode step of {batch} sequences needs two uint8 buffers of {size} bytes, got "
                             f"{host.dtype} [{host.numel()}] and {device.dtype} [{device.numel()}]")
        nb = blocks_per_page
        index_bytes = (2 + nb) * batch * 8
        self.batch = batch
        self.host_bytes, self.device_bytes = host, device
        words = host[:index_bytes].view(torch.int64).numpy()
        self.host = words[:2 * batch].reshape(2, batch)                               # [2, B] (host memory)
        self.host_blocks = words[2 * batch:].reshape(batch, nb)                       # [B, nb]
        words[:] = -1
        device_words = device[:index_bytes].view(torch.int64)
        self.index = device_words[:2 * batch].view(2, batch)                         # [2, B] int64 device
        self.blocks = device_words[2 * batch:].view(batch, nb)                       # [B, nb] int64 device
        self.flags = device[index_bytes:index_bytes + batch].view(torch.bool)        # [B] bool device

    def write(self, plan: DecodePlan) -> None:
        """The plan's rows into the host twin (entries past the plan's batch are left as they are)."""
        count = len(plan.stage_rows)
        self.host[0, :count] = plan.stage_rows
        self.host[1, :count] = plan.quant_pages
        if count:
            self.host_blocks[:count] = plan.quant_blocks
        plan.rows = self


class StagingBlocks:
    """Host bookkeeping of the full-precision staging pool, `num_blocks` blocks of `block` tokens, and the device
    map page id -> its blocks ([num_ids, P / block] int32, -1 where none is held). Ids at or beyond
    `lowbit_pages` are staging-only pages (the lazy partly filled page, kvcache/manager.py): never quantized."""

    def __init__(self, num_blocks: int, num_ids: int, blocks_per_page: int, block: int, device: torch.device,
                 lowbit_pages: int | None = None):
        self.num_blocks, self.per_page, self.block = num_blocks, blocks_per_page, block
        self.lowbit_pages = num_ids if lowbit_pages is None else lowbit_pages
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() hands out block 0 first
        self.held: dict[int, list[int]] = {}                           # page -> its [per_page] blocks (-1: none)
        self.device_map = torch.full((num_ids, blocks_per_page), -1, dtype=torch.int32, device=device)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def host_map(self) -> list[list[int]]:
        """The host's map, every id's [per_page] blocks (what the device map holds once published)."""
        return [self.blocks(page) for page in range(self.device_map.shape[0])]

    def staged(self, page: int) -> bool:
        return page in self.held

    def blocks(self, page: int) -> list[int]:
        """The page's blocks ([per_page], -1 where not held)."""
        return list(self.held.get(page, [-1] * self.per_page))

    def row(self, page: int, offset: int, taken: list[int]) -> int:
        """Flat staging row of row `offset` of `page`; takes its block when it is the first row of a block not
        held yet ((page, block index) added to `taken`: `undo` it, or `publish` its pages); a row inside a block not held
        is an inconsistency."""
        index, within = divmod(offset, self.block)
        blocks = self.held.get(page)
        if blocks is None or blocks[index] < 0:
            if within or (index and (blocks is None or blocks[index - 1] < 0)):
                raise RuntimeError(f"page {page} holds {offset} tokens but not their staging block: "
                                   "the block tables disagree with the cache's state")
            if not self.free:
                raise OutOfKVCacheError(
                    f"all {self.num_blocks} full-precision staging blocks are in use; each running sequence needs "
                    "its partly filled page's (plus fp_sink_pages'): raise CacheConfig.staging_pages")
            blocks = self.held.setdefault(page, [-1] * self.per_page)
            blocks[index] = self.free.pop()
            taken.append((page, index))
        return blocks[index] * self.block + within

    def give_back(self, pages: list[int]) -> None:
        """Pages leave staging (quantized or freed); their blocks return and the device map reads -1."""
        returned = [page for page in dict.fromkeys(pages) if page in self.held]
        for page in returned:
            self.free.extend(b for b in self.held.pop(page) if b >= 0)
        if returned:        # pageable -> device without a stream sync (the source is staged at once)
            ids = torch.tensor(returned, dtype=torch.long).to(self.device_map.device, non_blocking=True)
            self.device_map.index_fill_(0, ids, -1)

    def undo(self, taken: list[tuple[int, int]]) -> None:
        """Return the blocks `row` took (a plan that failed: nothing of it was published or written)."""
        for page, index in reversed(taken):
            blocks = self.held[page]
            self.free.append(blocks[index])
            blocks[index] = -1
            if all(b < 0 for b in blocks):
                del self.held[page]

    def publish(self, pages: list[int]) -> None:
        """Copy the host map of these pages (newly given blocks) to the device map."""
        pages = list(dict.fromkeys(pages))
        if pages:           # pageable -> device copies without a stream sync (the source is staged at once)
            device = self.device_map.device
            ids = torch.tensor(pages, dtype=torch.long).to(device, non_blocking=True)
            rows = torch.tensor([self.blocks(p) for p in pages], dtype=torch.int32).to(device, non_blocking=True)
            self.device_map.index_copy_(0, ids, rows)

    def rename(self, old: int, new: int) -> None:
        """Page `old`'s blocks now belong to page `new` (the lazy partly filled page got its low-bit page id)."""
        if new in self.held:
            raise RuntimeError(f"page {new} already holds staging blocks")
        blocks = self.held.pop(old, None)
        if blocks is not None:
            self.held[new] = blocks
            self.device_map.index_fill_(0, torch.tensor([old], dtype=torch.long).to(self.device_map.device,
                                                                                   non_blocking=True), -1)
            self.publish([new])

    def check_quantizable(self, page: int) -> None:
        if page >= self.lowbit_pages:
            raise RuntimeError(f"page id {page} fills but has no low-bit storage (staging-only ids start at "
                               f"{self.lowbit_pages}): the manager must give a filling page its low-bit id first")


def build_plan(meta: AttentionMetadata, page_size: int, fp_sink_pages: int, slots: StagingBlocks,
               device: torch.device) -> StepPlan:
    """Plan one step's writes; takes staging blocks for pages that stay in full precision."""
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
                if hi == page_start + page_size and index >= fp_sink_pages:    # full: quantize now
                    slots.check_quantizable(page)
                    base = len(quant_pages) * page_size
                    quant_pages.append(page)
                    if lo > page_start:                                        # the older rows wait in staging
                        if not slots.staged(page):
                            raise RuntimeError(f"page {page} holds {lo - page_start} tokens but no staging "
                                               "block: the block tables disagree with the cache's state")
                        from_staging.extend(range(base, base + lo - page_start))
                        staging_rows.extend(slots.row(page, offset, taken) for offset in range(lo - page_start))
                    from_new.extend(range(base + lo - page_start, base + page_size))
                    new_tokens.extend(tokens)
                    if slots.staged(page):
                        release.append((page, tuple(slots.blocks(page))))
                else:                                                          # stays in full precision
                    stage_tokens.extend(tokens)
                    stage_rows.extend(slots.row(page, offset, taken)
                                      for offset in range(lo - page_start, hi - page_start))
            start += num_new
    except Exception:
        slots.undo(taken)               # nothing of the step is written: the blocks it took return
        raise
    slots.publish([page for page, _ in taken])

    def ids(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    seq_of_token = torch.repeat_interleave(torch.arange(meta.num_seqs), torch.tensor(meta.query_lens_host,
                                                                                      dtype=torch.long))
    return StepPlan(meta=meta, stage_tokens=ids(stage_tokens), stage_rows=ids(stage_rows),
                    quant_pages=ids(quant_pages), quant_from_staging=ids(from_staging),
                    quant_staging_rows=ids(staging_rows), quant_from_new=ids(from_new),
                    quant_new_tokens=ids(new_tokens), seq_of_token=seq_of_token.to(device), release=release)


def build_decode_plan(meta: AttentionMetadata, page_size: int, fp_sink_pages: int,
                      slots: StagingBlocks) -> DecodePlan:
    """Plan a decode step (every query length 1); takes staging blocks for rows without one.

    Unlike `build_plan`, the new token always goes to a staging row (a page that fills is quantized from
    its blocks afterwards), so every page written in the step needs its block. Several sequences may name the
    same page at offset 0 (the runner's padding sequences on its scratch page): they share its block.
    Padding entries (request id "") never quantize their page, also when it fills (page_size 1): the
    scratch page keeps its block and the statistics count real pages only.
    """
    stage_rows, quant_pages, quant_blocks, release, taken = [], [], [], {}, []
    ids = meta.request_ids
    unused = [-1] * slots.per_page
    try:
        for seq, (num_new, context_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            if num_new != 1:
                raise ValueError(f"a decode plan needs one new token per sequence, sequence {seq} has {num_new}")
            index, offset = divmod(context_len, page_size)
            page = meta.block_tables_host[seq][index]
            stage_rows.append(slots.row(page, offset, taken))
            padding = seq < len(ids) and ids[seq] == ""                 # the runner's dummies: never quantized
            if offset == page_size - 1 and index >= fp_sink_pages and not padding:   # the page fills: quantize
                slots.check_quantizable(page)
                blocks = slots.blocks(page)
                quant_pages.append(page)
                quant_blocks.append(blocks)
                release[page] = tuple(blocks)
            else:
                quant_pages.append(-1)
                quant_blocks.append(unused)
    except Exception:
        slots.undo(taken)               # nothing of the step is written: the blocks it took return
        raise
    slots.publish([page for page, _ in taken])
    return DecodePlan(meta=meta, stage_rows=stage_rows, quant_pages=quant_pages, quant_blocks=quant_blocks,
                      release=list(release.items()), request_ids=list(ids), tables=list(meta.block_tables_host))

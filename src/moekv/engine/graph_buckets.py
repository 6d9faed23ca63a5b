"""The static buffers of CUDA-graph decode steps: which batch sizes get a bucket, what one bucket holds,
and how a step's rows are written into it (one host buffer, one host-to-device copy).

A bucket owns one packed device buffer holding the token ids, positions, context and sequence
lengths, slot mapping, a token-valid mask, each row's index into the token feed of overlapped decode
and the block tables [Bb, max_pages] (int32), then the
cache format's own per-step bytes (`KVCache.graph_step_bytes`, bound to the bucket's metadata with
`KVCache.bind_graph_step`: the low-bit cache's index rows and non-finite flags), so the step's one
copy carries the cache's plan too; a static
AttentionMetadata whose device tensors are views of it, with `fixed_num_splits` set (asked of the cache
format: `KVCache.graph_decode_splits`) so the decode kernels size their split-K work on the device; and,
once captured, the graph and its output logits [Bb, V]. Rows past the step's batch are dummy sequences
(one token at position 0, context 0, block table [scratch page], request id ""). The capture and replay
are in engine/cuda_graphs.py.
"""

from __future__ import annotations

import torch

from moekv.core.attention_metadata import AttentionMetadata

# Packed int32 fields of a bucket's input buffer, in order; each is [Bb], then block tables [Bb * W].
# feed_index: where the row's input token is read from in the runner's token feed (overlapped decode only).
_FIELDS = ("input_ids", "positions", "context_lens", "seq_lens", "slot_mapping", "token_valid", "feed_index")


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a CUDA graph: powers of two below max_num_seqs, then max_num_seqs."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return buckets + [max(max_num_seqs, 1)]


def graph_pool_bytes(arch, max_num_seqs: int, dtype: torch.dtype, workspace_bytes: int = 0) -> int:
    """A generous estimate of the device memory the shared graph pool holds once every bucket is
    captured: each bucket's logits stay alive, intermediates of the largest bucket are reused, plus the
    cache format's own kernel workspace for the largest bucket (`workspace_bytes`: what
    `KVCache.graph_workspace_bytes` says)."""
    element = torch.empty((), dtype=dtype).element_size()
    buckets = graph_buckets(max_num_seqs)
    outputs = sum(b * arch.vocab_size * 4 for b in buckets)
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    per_token = (16 * arch.hidden_size + 4 * qkv + 4 * arch.top_k * max(arch.expert_intermediate_size, 1)) * element \
        + 2 * arch.num_heads * 128 * arch.head_dim * 4 + arch.vocab_size * 4
    return outputs + buckets[-1] * per_token + workspace_bytes + (64 << 20)


class GraphBucket:
    """Static buffers (and, when captured, the graph) of one batch-size bucket."""

    def __init__(self, size: int, max_pages: int, scratch_page: int, page_size: int, num_splits: int | None,
                 device: torch.device, step_bytes: int = 0, feed_base: int = 0):
        self.size = size
        self.max_pages = max_pages
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.device = device
        width = len(_FIELDS) * size + size * max_pages
        offset = -(-4 * width // 8) * 8                    # the cache's bytes start 8-byte aligned
        pin = device.type == "cuda"
        self.host = torch.zeros(offset + step_bytes, dtype=torch.uint8, pin_memory=pin)        # [bytes]
        self.device_buf = torch.zeros(offset + step_bytes, dtype=torch.uint8, device=device)   # [bytes]
        self.host_np = self.host[:4 * width].view(torch.int32).numpy()                          # [width]
        fields = self.device_buf[:4 * width].view(torch.int32)                                  # [width]
        # the cache format's per-step bytes (host, device): written by its begin_step, copied with the rest
        self.step_buffers = (self.host[offset:], self.device_buf[offset:]) if step_bytes else None
        self.copied: torch.cuda.Event | None = None        # the last host->device copy (pinned reuse)
        views = {name: fields[i * size:(i + 1) * size] for i, name in enumerate(_FIELDS)}
        self.views = views
        tables = fields[len(_FIELDS) * size:].view(size, max_pages)                    # [Bb, W]
        self.meta = AttentionMetadata(
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            context_lens=views["context_lens"], seq_lens=views["seq_lens"], block_tables=tables,
            slot_mapping=torch.zeros(size, dtype=torch.int64, device=device),      # filled in the forward
            query_lens_host=[1] * size, context_lens_host=[0] * size,
            block_tables_host=[[scratch_page]] * size, max_query_len=1, max_seq_len=1,
            request_ids=[""] * size, fixed_num_splits=num_splits,
            token_valid=torch.zeros(size, dtype=torch.int64, device=device))        # filled in the forward
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)      # [Bb]
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)      # [Bb]
        # What the step reads back, in one transfer: [0] logits row usable (no NaN / +inf, something finite),
        # [1] its argmax, [2] the cache's non-finite KV flag (KVCache.step_flags; 0 when it has none)
        self.status = torch.zeros(3, size, dtype=torch.int64, device=device)        # [3, Bb]
        self.kv_flags = False                              # the forward copies the cache's flags into status[2]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None            # [Bb, V] float32, the graph's output
        self._fields = {name: self.host_np[i * size:(i + 1) * size] for i, name in enumerate(_FIELDS)}
        self._tables = self.host_np[len(_FIELDS) * size:].reshape(size, max_pages)         # [Bb, W] host
        self._padding_table = [scratch_page]               # the dummy rows' table (one list: written once)
        # token feed (CudaGraphSteps.token_feed [2 * feed_base]): row i's uploaded token sits at feed_base + i
        self.feed_base = feed_base
        self._uploaded = [feed_base + i for i in range(size)]
        self._fields["feed_index"][:] = self._uploaded
        self._fed = False                                  # the last fill read tokens from the feed
        self._written: list[tuple[list[int] | None, int]] = [(None, 0)] * size   # per row: table, entries

    def fill(self, rows: list[tuple[int, int, list[int], str]], feed: list[int] | None = None) -> None:
        """Write a step's rows (token id, position, block table, request id) into the host buffer and the
        metadata's host lists; rows past len(rows) are dummy sequences. The cache's begin_step(meta) may
        then write its own bytes (step_buffers) before `upload`. `feed` (overlapped decode): per row, the
        row of the previous graph step whose drawn token is its input, in the runner's token feed (-1: the
        row's own token id; the token id of a fed row is not read).

        Block tables are written incrementally: a row holding the same table list as in this bucket's last
        fill writes only the entries appended since (KVCacheManager's tables are append-only while their
        list lives; a freed and re-admitted sequence gets a new list), so a decode step writes one entry per
        page a sequence opened, not its whole table (1024 entries per sequence at 16k tokens, page 16)."""
        if self.copied is not None:
            self.copied.synchronize()              # the previous copy out of this pinned buffer is done
        size, page_size, count = self.size, self.page_size, len(rows)
        pad = size - count
        tokens = [r[0] for r in rows] + [0] * pad
        positions = [r[1] for r in rows] + [0] * pad
        block_tables = [r[2] for r in rows] + [self._padding_table] * pad
        request_ids = [r[3] for r in rows] + [""] * pad
        fields = self._fields
        fields["input_ids"][:] = tokens
        fields["positions"][:] = positions
        fields["context_lens"][:] = positions
        fields["seq_lens"][:] = fields["positions"] + 1
        fields["slot_mapping"][:] = [t[p // page_size] * page_size + p % page_size
                                     for t, p in zip(block_tables, positions)]
        fields["token_valid"][:count] = 1
        fields["token_valid"][count:] = 0
        if feed is not None:
            fed = [src if src >= 0 else own for src, own in zip(feed, self._uploaded)]
            fields["feed_index"][:] = fed + self._uploaded[count:]
        elif self._fed:
            fields["feed_index"][:] = self._uploaded
        self._fed = feed is not None
        tables, written = self._tables, self._written
        for i, table in enumerate(block_tables):
            before, done = written[i]
            length = len(table)
            if table is not before or done > length:
                tables[i, :length] = table
            elif length > done:
                tables[i, done:length] = table[done:]
            written[i] = (table, length)
        meta = self.meta
        meta.context_lens_host = positions
        meta.block_tables_host = block_tables
        meta.request_ids = request_ids
        meta.max_seq_len = max(positions) + 1

    def upload(self) -> None:
        """The step's one host->device copy (the rows, the tables and the cache's step bytes)."""
        self.device_buf.copy_(self.host, non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(self.device))

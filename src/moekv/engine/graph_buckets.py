"""The static buffers of CUDA-graph decode steps: which batch sizes get a bucket, what one bucket holds,
and how a step's rows are written into it (one host buffer, one host-to-device copy).

A bucket owns one packed int32 device buffer holding the token ids, positions, context and sequence
lengths, slot mapping, a token-valid mask and the block tables [Bb, max_pages]; a static
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
_FIELDS = ("input_ids", "positions", "context_lens", "seq_lens", "slot_mapping", "token_valid")


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
                 device: torch.device):
        self.size = size
        self.max_pages = max_pages
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.device = device
        width = len(_FIELDS) * size + size * max_pages
        pin = device.type == "cuda"
        self.host = torch.zeros(width, dtype=torch.int32, pin_memory=pin)            # [width]
        self.host_np = self.host.numpy()
        self.device_buf = torch.zeros(width, dtype=torch.int32, device=device)       # [width]
        self.copied: torch.cuda.Event | None = None        # the last host->device copy (pinned reuse)
        views = {name: self.device_buf[i * size:(i + 1) * size] for i, name in enumerate(_FIELDS)}
        self.views = views
        tables = self.device_buf[len(_FIELDS) * size:].view(size, max_pages)          # [Bb, W]
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

    def fill(self, rows: list[tuple[int, int, list[int], str]]) -> None:
        """Write a step's rows (token id, position, block table, request id) into the host buffer and the
        metadata's host lists; rows past len(rows) are dummy sequences."""
        if self.copied is not None:
            self.copied.synchronize()              # the previous copy out of this pinned buffer is done
        size, page_size, scratch = self.size, self.page_size, self.scratch_page
        host = self.host_np
        fields = {name: host[i * size:(i + 1) * size] for i, name in enumerate(_FIELDS)}
        tables = host[len(_FIELDS) * size:].reshape(size, self.max_pages)
        context_lens, block_tables, request_ids = [], [], []
        for i in range(size):
            if i < len(rows):
                token, position, table, request_id = rows[i]
                valid = 1
            else:
                token, position, table, request_id, valid = 0, 0, [scratch], "", 0
            fields["input_ids"][i] = token
            fields["positions"][i] = position
            fields["context_lens"][i] = position
            fields["seq_lens"][i] = position + 1
            fields["slot_mapping"][i] = table[position // page_size] * page_size + position % page_size
            fields["token_valid"][i] = valid
            tables[i, :len(table)] = table
            context_lens.append(position)
            block_tables.append(table)
            request_ids.append(request_id)
        meta = self.meta
        meta.context_lens_host = context_lens
        meta.block_tables_host = block_tables
        meta.request_ids = request_ids
        meta.max_seq_len = max(context_lens) + 1

    def upload(self) -> None:
        """The step's one host->device copy."""
        self.device_buf.copy_(self.host, non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(self.device))

"""The per-step attention metadata: where each sequence of a step stands.

Token layout: the tokens of all sequences in a step are flattened into one dimension T
(sequence 0's new tokens, then sequence 1's, ...); `query_start_loc` marks the boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence of a step stands; built once per step by the engine, read by every layer.

    Device tensors feed kernels; the `*_host` lists are the same numbers for the reference path and
    for the engine (the decode hot path on GPU reads only the device tensors).

    `fixed_num_splits` (CUDA-graph decode steps): when set, decode attention kernels launch exactly
    that many split-K splits and size each sequence's splits on the device from its own length,
    reading no host list (`*_host`, `max_seq_len`), so the launch can be captured once and replayed
    for any lengths. None: the kernels plan splits on the host from the host lengths.

    `token_valid` (CUDA-graph decode steps): [T] int64 device tensor, 1 for a real token and 0 for
    a padding row of a batch-size bucket; padding rows are left out of statistics (expert load).
    None: every token is real.

    `step_state` (CUDA-graph decode steps): what the cache format keeps in the bucket's own buffer
    (`KVCache.bind_graph_step`: host and device views the bucket's one copy carries); None otherwise.
    """

    query_start_loc: torch.Tensor   # [B+1] int32: new tokens of seq i are rows query_start_loc[i]:[i+1]
    context_lens: torch.Tensor      # [B] int32: tokens of seq i already in the cache before this step
    seq_lens: torch.Tensor          # [B] int32: context_lens + new tokens
    block_tables: torch.Tensor      # [B, max_pages] int32: page ids of each sequence, padded with 0
    slot_mapping: torch.Tensor      # [T] int64: page_id * page_size + offset of each new token
    query_lens_host: list[int]
    context_lens_host: list[int]
    block_tables_host: list[list[int]]
    max_query_len: int
    max_seq_len: int
    request_ids: list[str] = field(default_factory=list)   # for error reports (e.g. non-finite KV)
    fixed_num_splits: int | None = None     # decode: exactly this many splits, sized on the device
    token_valid: torch.Tensor | None = None  # [T] int64: 0 marks a padding row (graph buckets)
    step_state: object | None = None        # the cache format's views of the bucket's step bytes

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (the decode-only fast path)."""
        return all(n == 1 for n in self.query_lens_host)

    @staticmethod
    def build(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              page_size: int, device: torch.device | str, request_ids: list[str] | None = None
              ) -> "AttentionMetadata":
        """Build metadata for sequences with the given new-token counts, cached lengths and pages."""
        num_seqs = len(query_lens)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        max_pages = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (max_pages - len(t)) for t in block_tables]
        slots: list[int] = []
        for table, ctx, q in zip(block_tables, context_lens, query_lens):
            for pos in range(ctx, ctx + q):
                slots.append(table[pos // page_size] * page_size + pos % page_size)
        device = torch.device(device)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return AttentionMetadata(
            query_start_loc=tensor(starts, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(padded if num_seqs else [[0]], torch.int32),
            slot_mapping=tensor(slots, torch.int64),
            query_lens_host=list(query_lens),
            context_lens_host=list(context_lens),
            block_tables_host=[list(t) for t in block_tables],
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            request_ids=list(request_ids or []),
        )

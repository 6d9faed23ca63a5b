"""The cache interface every KV page format implements, and the per-step attention metadata.

Model code sees only `KVCache.attention(layer, query, key, value, meta)`: it hands over the new
tokens' projected (and rotated) keys and values and gets the attention output back. Where the
keys live (full precision, low-bit pages, an fp staging page) and which kernel reads them is the
format's business, chosen outside the model.

Token layout: the tokens of all sequences in a step are flattened into one dimension T
(sequence 0's new tokens, then sequence 1's, ...); `query_start_loc` marks the boundaries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from moekv.config import CacheConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of what a KV cache stores, derived from the model and the cache config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype          # full-precision dtype (model dtype, or the dtype asked for)


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


class KVCache(ABC):
    """Paged storage of keys and values for all layers, in one format.

    Page ids come from the block pool (kvcache.block_pool); a format only stores and reads them.
    """

    #: canonical kv_cache_dtype this format implements ("bf16", "int3", ...)
    name: str

    #: whether a decode step over this format can be captured in a CUDA graph: with begin_step /
    #: end_step around it, the forward reads only persistent device buffers and never syncs
    supports_graph_decode: bool = False

    def __init__(self, spec: KVCacheSpec, num_pages: int, device: torch.device | str,
                 config: CacheConfig | None = None):
        self.spec = spec
        self.config = config if config is not None else CacheConfig()
        self.num_pages = num_pages
        self.device = torch.device(device)

    # -- capacity planning -------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def bytes_per_page(cls, spec: KVCacheSpec, config: CacheConfig | None = None) -> int:
        """Device bytes one page costs across all layers (keys and values, with metadata)."""

    @classmethod
    def fixed_bytes(cls, spec: KVCacheSpec, config: CacheConfig) -> int:
        """Device bytes that do not scale with the number of pages (e.g. a staging pool)."""
        return 0

    # -- the model-facing call ----------------------------------------------------------------
    @abstractmethod
    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store the new tokens' keys and values and return causal attention output.

        query [T, Hq, D], key/value [T, Hkv, D] (already rotated) -> [T, Hq, D] in query's dtype.
        Each new token attends to its sequence's cached context and to the new tokens up to itself.
        """

    # -- step hooks (every step; CUDA-graph decode relies on them) -----------------------------
    def reserve_graph_decode(self, max_batch: int) -> None:
        """Called once before any CUDA graph is captured: allocate every persistent device buffer a
        decode step of up to `max_batch` sequences needs, so captured kernels keep valid pointers."""

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Host bookkeeping before the step's forward (per-step write plans, slot assignments). It
        writes only into the cache's persistent device buffers (never allocates tensors the forward
        reads), so a captured forward replays correctly after it. `meta`'s host lists describe the
        step (for a graph step: the padded batch, padding rows included)."""

    def step_flags(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """For a step prepared by begin_step(meta): a [num_seqs] bool device tensor the forward sets for
        sequences whose new keys/values were non-finite, at a fixed address (a captured graph may copy it
        into its own outputs), or None when the format keeps no such flags. A caller that reads it back with
        its own outputs passes the values to end_step, which then reads nothing from the device."""
        return None

    def end_step(self, meta: AttentionMetadata, flags: list[bool] | None = None) -> None:
        """After the step's forward: may do the step's single host sync (e.g. non-finite checks)
        and raise KVCacheCorruptionError (the step is then not committed); otherwise commits the
        step's bookkeeping (e.g. returns staging slots). `flags`: step_flags(meta) as read back by the
        caller after the forward (then no host read here)."""

    # -- lifecycle ----------------------------------------------------------------------------
    def pages_freed(self, pages: list[int]) -> None:
        """The block pool released these pages (a format with per-page side state resets it)."""

    # -- accounting ---------------------------------------------------------------------------
    @abstractmethod
    def bits_per_value(self, num_tokens_per_seq: list[int]) -> float:
        """All-in bits per stored key/value element for sequences of these lengths."""

    def stats(self) -> dict[str, float]:
        """Format-specific counters (e.g. outlier-budget hits); empty for plain formats."""
        return {}


def causal_attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               context_len: int, scale: float) -> torch.Tensor:
    """Attention of one sequence's new tokens over [cached context + new tokens], in fp32.

    query [Q, Hq, D]; keys/values [L, Hkv, D] with L = context_len + Q -> [Q, Hq, D] (fp32).
    New token i (absolute position context_len + i) sees keys 0 .. context_len + i.
    """
    num_q, num_heads, _ = query.shape
    total, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)                                    # [Hq, Q, D]
    k = keys.float().transpose(0, 1).repeat_interleave(group, dim=0)     # [Hq, L, D]
    v = values.float().transpose(0, 1).repeat_interleave(group, dim=0)   # [Hq, L, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale                  # [Hq, Q, L]
    q_pos = torch.arange(num_q, device=query.device).unsqueeze(1) + context_len   # [Q, 1]
    k_pos = torch.arange(total, device=query.device).unsqueeze(0)                 # [1, L]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1)                        # [Q, Hq, D]

"""The cache interface every KV page format implements (the per-step metadata is moekv.core).

Model code sees only `KVCache.attention(layer, query, key, value, meta)`: it hands over the new
tokens' projected (and rotated) keys and values and gets the attention output back. Where the
keys live (full precision, low-bit pages, an fp staging page) and which kernel reads them is the
format's business, chosen outside the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from moekv.config import CacheConfig
from moekv.core.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of what a KV cache stores, derived from the model and the cache config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype          # full-precision dtype (model dtype, or the dtype asked for)


@dataclass(frozen=True)
class FusedWriteTarget:
    """The rows a KV format lets the rotary kernel write (KVCache.fused_write_target).

    key_rows / value_rows [S, Hkv, D] in the cache dtype; slots [T] int64: token t's row. Plain mode (flags
    None, the full-precision format): the rotated key and the (clipped) value of token t go to row slots[t].
    Checked mode (flags [T] bool given, with key_copy / value_copy [T, Hkv, D] of the rows' dtype: the low-bit
    format's decode staging): both are rounded to the rows' dtype, a token with any NaN / Inf in its key or
    value rows (all heads) sets flags[t] (never cleared) and is written as zeros (both rows), and the rows
    as written also go to key_copy[t] / value_copy[t] -- ops.reference.lowbit.stage_decode_tokens' contract.
    Padding tokens may share a row: one of them wins."""

    key_rows: torch.Tensor
    value_rows: torch.Tensor
    slots: torch.Tensor
    flags: torch.Tensor | None = None
    key_copy: torch.Tensor | None = None
    value_copy: torch.Tensor | None = None

    def __post_init__(self):
        if (self.flags is None) != (self.key_copy is None) or (self.flags is None) != (self.value_copy is None):
            raise ValueError("a checked fused write target needs flags, key_copy and value_copy together")

    @property
    def checked(self) -> bool:
        return self.flags is not None


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

    @classmethod
    def graph_workspace_bytes(cls, spec: KVCacheSpec, config: CacheConfig, num_query_heads: int,
                              max_batch: int, max_model_len: int) -> int:
        """Device bytes the format's decode kernels allocate inside the CUDA-graph memory pool for a
        decode step of up to `max_batch` sequences of up to `max_model_len` tokens (the engine subtracts
        them from the KV budget before the cache exists)."""
        return 0

    # -- the model-facing call ----------------------------------------------------------------
    @abstractmethod
    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store the new tokens' keys and values and return causal attention output.

        query [T, Hq, D], key/value [T, Hkv, D] (already rotated) -> [T, Hq, D] in query's dtype.
        Each new token attends to its sequence's cached context and to the new tokens up to itself.
        """

    def fused_write_target(self, layer: int, meta: AttentionMetadata) -> FusedWriteTarget | None:
        """Where the model may write the new tokens' keys and values itself, from the kernel that rotates them
        (ops.dispatch.qk_norm_rotary_write): a FusedWriteTarget whose rows, once written, hold exactly what
        `attention` would have stored (see FusedWriteTarget for the plain and the checked mode). The model then
        calls `attention_prewritten` instead of `attention`. None (the default): the format stores them."""
        return None

    def attention_prewritten(self, layer: int, query: torch.Tensor, meta: AttentionMetadata,
                             scale: float) -> torch.Tensor:
        """`attention` for a step whose keys and values went to `fused_write_target`'s rows already."""
        raise NotImplementedError(f"{type(self).__name__} has no fused write target")

    # -- step hooks (every step; CUDA-graph decode relies on them) -----------------------------
    def reserve_graph_decode(self, max_batch: int) -> None:
        """Called once before any CUDA graph is captured: allocate every persistent device buffer a
        decode step of up to `max_batch` sequences needs, so captured kernels keep valid pointers."""

    def graph_decode_splits(self, batch: int, max_model_len: int) -> int | None:
        """The split-K split count a CUDA-graph decode bucket of `batch` sequences sets as its
        `AttentionMetadata.fixed_num_splits` (host-side, from the bucket size and max_model_len only).
        Every format with `supports_graph_decode` must say."""
        raise NotImplementedError(f"{type(self).__name__} does not plan graph decode splits")

    def graph_step_bytes(self, batch: int) -> int:
        """Bytes of per-step state a decode step of `batch` sequences uploads (0: none). A graph bucket
        holds them after its own rows, so the step's one host->device copy carries them too."""
        return 0

    def bind_graph_step(self, meta: AttentionMetadata, host: torch.Tensor, device: torch.Tensor) -> None:
        """Give the format a graph bucket's step bytes (`graph_step_bytes(meta.num_seqs)` of them, uint8,
        8-byte aligned; `host` pinned on CUDA, copied to `device` by the runner after begin_step(meta)).
        The format keeps its views in `meta.step_state`; its begin_step(meta) then writes `host` only."""
        if self.graph_step_bytes(meta.num_seqs):
            raise NotImplementedError(f"{type(self).__name__} asks for step bytes but does not bind them")

    def begin_step(self, meta: AttentionMetadata, overlapped: bool = False) -> None:
        """Host bookkeeping before the step's forward (per-step write plans, slot assignments). It
        writes only into the cache's persistent device buffers (never allocates tensors the forward
        reads), so a captured forward replays correctly after it. `meta`'s host lists describe the
        step (for a graph step: the padded batch, padding rows included).

        `overlapped` (overlapped decode, engine/overlap.py): the previous decode step was launched but not
        ended yet; its end_step comes after this begin_step (end_step(meta) ends the oldest pending step of
        `meta`: the same bucket's metadata may name both). The format must then do before this step's plan
        whatever of the previous step's commit a later step relies on. Without it, a step still pending
        (a forward that failed) is dropped."""

    def step_flags(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """For a step prepared by begin_step(meta): a [num_seqs] bool device tensor the forward sets for
        sequences whose new keys/values were non-finite, at a fixed address (a captured graph may copy it
        into its own outputs), or None when the format keeps no such flags. A caller that reads it back with
        its own outputs passes the values to end_step, which then reads nothing from the device."""
        return None

    def end_step(self, meta: AttentionMetadata, flags: list[bool] | None = None) -> None:
        """After the step's forward: may do the step's single host sync (e.g. non-finite checks)
        and raise KVCacheCorruptionError (the step is then not committed); otherwise commits the
        step's bookkeeping (e.g. returns staging blocks). `flags`: step_flags(meta) as read back by the
        caller after the forward (then no host read here)."""

    # -- lifecycle ----------------------------------------------------------------------------
    def pages_freed(self, pages: list[int]) -> None:
        """The block pool released these pages (a format with per-page side state resets it)."""

    def staging_only_ids(self) -> range | None:
        """Page ids beyond the pool's `num_pages` that hold a sequence's partly filled last page in staging only
        (CacheConfig.lazy_partial_page: its low-bit storage is taken when it fills), or None (every page id has
        storage). The manager hands them out and calls `page_renamed` when such a page gets its real id."""
        return None

    def page_renamed(self, old: int, new: int) -> None:
        """The partly filled page `old` (a staging-only id) is page `new` from now on, before the step that
        fills it: whatever the format holds for `old` now belongs to `new`."""
        raise NotImplementedError(f"{type(self).__name__} has no staging-only page ids")

    def keeps_freed_page(self, page: int) -> bool:
        """Whether a full page's keys/values stay readable after its last holder frees it, until
        pages_freed (prefix caching retains such pages; a format answers False for pages whose
        contents live in per-sequence side storage)."""
        return True

    # -- accounting ---------------------------------------------------------------------------
    @abstractmethod
    def bits_per_value(self, num_tokens_per_seq: list[int]) -> float:
        """All-in bits per stored key/value element for sequences of these lengths."""

    def page_bits_per_value(self) -> float:
        """All-in bits per value of a filled page of this format (what the compressed part costs)."""
        return self.bits_per_value([self.spec.page_size])

    def full_precision_token_share(self, num_tokens_per_seq: list[int]) -> float:
        """Share of these sequences' tokens held in full precision (a full-precision format: all of them;
        0.0 when there are no tokens)."""
        return 1.0 if sum(num_tokens_per_seq) else 0.0

    def stats(self) -> dict[str, float]:
        """Format-specific counters (e.g. outlier-budget hits); empty for plain formats."""
        return {}

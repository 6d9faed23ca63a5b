"""Per-sequence block tables on top of the block pool, with optional prefix caching.

The scheduler asks whether a sequence can grow, the manager allocates pages as tokens arrive and
frees them (telling the cache format) when a sequence finishes, is aborted or is preempted.

With a `PrefixCache` (kvcache/prefix_cache.py), a sequence being admitted first looks up its longest
cached prefix (`match_prefix`), then `admit` takes a reference on those pages and allocates the rest;
`cache_computed` registers a sequence's full, computed pages. A freed registered page stays readable in
the pool's evictable LRU (if the format keeps its contents: `keeps_freed_page`) until an allocation
evicts it; only then is the format told (`on_pages_freed`). Pages with holders are never evicted.

With `staging_only_ids` (a low-bit cache with CacheConfig.lazy_partial_page), a sequence's partly filled last
page is one of those ids (beyond the pool's pages: no low-bit storage, held in staging) instead of a pool page;
`grow` gives it a pool page when a step fills it (the format is told, `on_page_renamed`, before that step is
planned) and it returns to its own free list. Such ids are never shared, cached or counted as pool usage.
"""

from __future__ import annotations

import weakref
from typing import Callable

from moekv.errors import OutOfKVCacheError
from moekv.kvcache.block_pool import BlockPool
from moekv.kvcache.prefix_cache import CachedPage, PrefixCache, TokenSlice


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def _weak_callback(method: Callable[[list[int]], None]) -> Callable[[list[int]], None]:
    """`method` called through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(pages: list[int]) -> None:
        bound = ref()
        if bound is not None:
            bound(pages)
    return call


class KVCacheManager:
    """Maps sequence ids to lists of page ids."""

    def __init__(self, num_pages: int, page_size: int,
                 on_pages_freed: Callable[[list[int]], None] | None = None,
                 prefix_cache: PrefixCache | None = None,
                 keeps_freed_page: Callable[[int], bool] | None = None,
                 staging_only_ids: range | None = None,
                 on_page_renamed: Callable[[int, int], None] | None = None):
        if prefix_cache is not None and prefix_cache.page_size != page_size:
            raise ValueError(f"the prefix cache names pages of {prefix_cache.page_size} tokens, the manager "
                             f"holds pages of {page_size}")
        self.page_size = page_size
        # the pool calls back through a weak reference: no manager <-> pool cycle, so a dropped engine's cache
        # (which the manager's on_pages_freed holds) is freed at once, not at the next cyclic collection
        self.pool = BlockPool(num_pages, on_evict=_weak_callback(self._evicted))
        self.prefix_cache = prefix_cache
        self._tables: dict[str, list[int]] = {}
        self._on_pages_freed = on_pages_freed
        self._keeps_freed_page = keeps_freed_page
        if staging_only_ids is not None and (staging_only_ids.start < num_pages or on_page_renamed is None):
            raise ValueError("staging-only page ids start after the pool's pages and need on_page_renamed")
        self._staging_only = staging_only_ids
        self._tails_free: list[int] = list(reversed(staging_only_ids)) if staging_only_ids is not None else []
        self._on_page_renamed = on_page_renamed

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.page_size

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    @property
    def lazy_partial_page(self) -> bool:
        return self._staging_only is not None

    @property
    def num_free_tails(self) -> int:
        """Staging-only ids free for new partly filled pages (unbounded without them)."""
        return len(self._tails_free) if self._staging_only is not None else 1 << 30

    def _is_tail(self, page: int) -> bool:
        return self._staging_only is not None and page in self._staging_only

    def _pool_pages_needed(self, total_tokens: int) -> int:
        """Pool pages a sequence of `total_tokens` holds (lazy: its full pages only)."""
        if self._staging_only is None:
            return pages_needed(total_tokens, self.page_size)
        return total_tokens // self.page_size

    def _pool_pages_held(self, table: list[int] | tuple) -> int:
        return len(table) - (1 if table and self._is_tail(table[-1]) else 0)

    def num_new_pages(self, seq_id: str, total_tokens: int) -> int:
        """Pool pages a sequence must add to hold `total_tokens` tokens."""
        held = self._pool_pages_held(self._tables.get(seq_id, ()))
        return max(0, self._pool_pages_needed(total_tokens) - held)

    def needs_tail(self, seq_id: str, total_tokens: int) -> bool:
        """Whether holding `total_tokens` takes a new staging-only id (lazy: a partly filled page that has none)."""
        if self._staging_only is None or total_tokens % self.page_size == 0:
            return False
        table = self._tables.get(seq_id, ())
        index = total_tokens // self.page_size
        return not (len(table) > index and self._is_tail(table[index]))

    def can_grow(self, seq_id: str, total_tokens: int, reserve: int = 0) -> bool:
        if self.needs_tail(seq_id, total_tokens) and not self._tails_free:
            return False
        return self.num_new_pages(seq_id, total_tokens) + reserve <= self.pool.num_free

    def grow(self, seq_id: str, total_tokens: int) -> list[int]:
        """Make the sequence's table hold `total_tokens` tokens; returns its table. Lazy: a staging-only last
        page that is full now takes the first new pool page (the format is told), and a partly filled last page
        that has no id takes a staging-only one."""
        extra = self.num_new_pages(seq_id, total_tokens)
        tail = self.needs_tail(seq_id, total_tokens)
        if tail and not self._tails_free:
            raise OutOfKVCacheError(f"all {len(self._staging_only)} staging-only page ids are in use (one per "
                                    "running sequence's partly filled page): raise CacheConfig.staging_pages")
        new_pages = self.pool.allocate(extra) if extra else []   # raises before any state changes
        table = self._tables.setdefault(seq_id, [])
        if new_pages and table and self._is_tail(table[-1]):     # the staging-only page fills: its pool page
            old, table[-1] = table[-1], new_pages[0]
            self._on_page_renamed(old, new_pages[0])
            self._tails_free.append(old)
            new_pages = new_pages[1:]
        table.extend(new_pages)
        if tail:
            table.append(self._tails_free.pop())
        return table

    # -- prefix caching ---------------------------------------------------------------------------
    def match_prefix(self, seq_id: str, num_tokens: int, token_ids: TokenSlice) -> list[CachedPage]:
        """The cached pages a sequence without pages may start from ([] without prefix caching)."""
        if self.prefix_cache is None or seq_id in self._tables:
            return []
        return self.prefix_cache.match(seq_id, num_tokens, token_ids)

    def can_admit(self, seq_id: str, total_tokens: int, hits: list[CachedPage]) -> bool:
        """Whether a sequence starting from `hits` can hold `total_tokens` (hit pages waiting in the LRU are
        taken by the hit itself, so they do not count as free for the rest)."""
        retained_hits = sum(1 for entry in hits if self.pool.ref_count(entry.page) == 0)
        needed = self._pool_pages_needed(total_tokens) - len(hits)
        if self._staging_only is not None and total_tokens % self.page_size and not self._tails_free:
            return False
        return needed <= self.pool.num_free - retained_hits

    def admit(self, seq_id: str, hits: list[CachedPage], total_tokens: int, num_tokens: int) -> list[int]:
        """Start a sequence of `num_tokens` tokens from its cached pages `hits` and make its table hold
        `total_tokens`; returns its table. Counts the prefix-cache query and hits."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        if hits:
            pages = [entry.page for entry in hits]
            self.pool.reuse(pages)                           # before allocating: eviction cannot take them
            self._tables[seq_id] = pages
        if self.prefix_cache is not None:
            self.prefix_cache.adopt(seq_id, hits, num_tokens)
        try:
            return self.grow(seq_id, total_tokens)
        except Exception:
            self.free(seq_id)
            raise

    def pages_computing(self, seq_id: str, start: int, end: int, token_ids: TokenSlice) -> list[bytes]:
        """Digests of the pages a chunk of tokens [start, end) fills (in-batch prefix sharing: a request
        waiting for one of them should wait a step and hit it); [] without prefix caching."""
        first, last = start // self.page_size, end // self.page_size
        if self.prefix_cache is None or first >= last:      # a decode step: mostly no page completes
            return []
        return self.prefix_cache.digests(seq_id, first, last, token_ids)

    def next_uncached_page(self, seq_id: str, num_hits: int, num_tokens: int, token_ids: TokenSlice) -> bytes | None:
        """Digest of the first page after a sequence's `num_hits` hit pages that a later hit could cover
        (None when there is none, or without prefix caching)."""
        if self.prefix_cache is None or num_hits >= (num_tokens - 1) // self.page_size:
            return None
        return self.prefix_cache.digests(seq_id, num_hits, num_hits + 1, token_ids)[0]

    def cache_computed(self, seq_id: str, num_computed: int, token_ids: TokenSlice) -> None:
        """Register the sequence's full pages whose tokens are all computed (no-op without prefix caching)."""
        table = self._tables.get(seq_id)
        if self.prefix_cache is None or not table or num_computed < self.page_size:
            return
        dropped = self.prefix_cache.register(seq_id, table, num_computed, token_ids)
        freed = [page for page in dropped if self.pool.discard(page)]
        if freed and self._on_pages_freed is not None:
            self._on_pages_freed(freed)

    def _retain(self, page: int) -> bool:
        return self.prefix_cache.is_cached(page) and (self._keeps_freed_page is None or self._keeps_freed_page(page))

    def _evicted(self, pages: list[int]) -> None:
        """The pool evicts retained pages to hand them out again."""
        self.prefix_cache.evicted(pages)
        if self._on_pages_freed is not None:
            self._on_pages_freed(pages)

    # -- lifecycle --------------------------------------------------------------------------------
    def free(self, seq_id: str) -> int:
        """Release a sequence's pages; returns how many lost their last holder. With prefix caching, those
        that are registered stay retained (the tail first in line for eviction); the rest are freed."""
        table = self._tables.pop(seq_id, None)
        if table and self._is_tail(table[-1]):                    # its staging-only page: never cached
            tail = table.pop()
            self._tails_free.append(tail)
            if self._on_pages_freed is not None:
                self._on_pages_freed([tail])
        if self.prefix_cache is None:
            if not table:
                return 0
            released = self.pool.free(table)
            freed = released
        else:
            self.prefix_cache.release(seq_id)
            if not table:
                return 0
            released = self.pool.free(table[::-1], retain=self._retain)
            freed = [page for page in released if not self.pool.is_evictable(page)]
            self.prefix_cache.evicted(freed)                 # registered pages the format does not keep
        if freed and self._on_pages_freed is not None:
            self._on_pages_freed(freed)
        return len(released)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

"""A pool of KV pages: free list, reference counts, and an LRU of freed pages whose contents are kept.

Knows nothing of formats, sequences or tokens. A page whose last holder frees it either returns to the
free list or, when the caller asks to retain it (a prefix-cached page), waits in the evictable LRU: still
readable and reusable by reference (`reuse`), and counted as free. `allocate` takes free pages first and
then evicts the least recently freed retained pages, telling `on_evict`; a page with holders is never
evicted (it is in neither list).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

from moekv.errors import OutOfKVCacheError


class BlockPool:
    """Hands out page ids 0..num_pages-1; a page returns to the pool when its last holder frees it."""

    def __init__(self, num_pages: int, on_evict: Callable[[list[int]], None] | None = None):
        if num_pages < 1:
            raise ValueError(f"a block pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()     # retained free pages, oldest first
        self._ref_counts = [0] * num_pages
        self._on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones plus retained ones it would evict."""
        return len(self._free) + len(self._evictable)

    @property
    def num_unused(self) -> int:
        """Plainly free pages: an allocation of this many evicts no retained page."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def usage(self) -> float:
        """Share of pages in use (held by a sequence), in [0, 1]; retained free pages do not count."""
        return self.num_used / self.num_pages

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages (all or none): free ones first, then the least recently freed retained ones."""
        if count > self.num_free:
            raise OutOfKVCacheError(f"asked for {count} KV pages, {self.num_free} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(min(count, len(self._free)))]
        evicted = [self._evictable.popitem(last=False)[0] for _ in range(count - len(pages))]
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)
        pages += evicted
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Another holder takes a reference on pages it did not allocate (prefix sharing, forks)."""
        for page in pages:
            if self._ref_counts[page] < 1:
                raise ValueError(f"page {page} is free and cannot be shared")
            self._ref_counts[page] += 1

    def reuse(self, pages: list[int]) -> None:
        """Take a reference on pages that are in use or retained (a prefix-cache hit)."""
        for page in pages:
            if self._ref_counts[page] < 1 and page not in self._evictable:
                raise ValueError(f"page {page} is free and holds nothing to reuse")
        for page in pages:
            self._evictable.pop(page, None)
            self._ref_counts[page] += 1

    def free(self, pages: list[int], retain: Callable[[int], bool] | None = None) -> list[int]:
        """Drop one reference on each page; returns the pages that lost their last holder, in order. Of
        those, pages `retain` accepts wait in the evictable LRU (most recent last), the others are free."""
        released = []
        for page in pages:
            if self._ref_counts[page] < 1:
                raise ValueError(f"page {page} freed twice")
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                if retain is not None and retain(page):
                    self._evictable[page] = None
                else:
                    self._free.append(page)
                released.append(page)
        return released

    def discard(self, page: int) -> bool:
        """A retained page's contents are no longer wanted: it becomes plainly free (True if it was retained)."""
        if page not in self._evictable:
            return False
        del self._evictable[page]
        self._free.append(page)
        return True

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

"""A pool of KV pages: free list and reference counts. Knows nothing of formats or sequences."""

from __future__ import annotations

from collections import deque

from moekv.errors import OutOfKVCacheError


class BlockPool:
    """Hands out page ids 0..num_pages-1; a page returns to the pool when its last holder frees it."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a block pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._ref_counts = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def usage(self) -> float:
        """Share of pages in use, in [0, 1]."""
        return self.num_used / self.num_pages

    def allocate(self, count: int) -> list[int]:
        """Take `count` free pages (all or none)."""
        if count > len(self._free):
            raise OutOfKVCacheError(f"asked for {count} KV pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Another holder takes a reference on pages it did not allocate (prefix sharing, forks)."""
        for page in pages:
            if self._ref_counts[page] < 1:
                raise ValueError(f"page {page} is free and cannot be shared")
            self._ref_counts[page] += 1

    def free(self, pages: list[int]) -> list[int]:
        """Drop one reference on each page; returns the pages that became free."""
        released = []
        for page in pages:
            if self._ref_counts[page] < 1:
                raise ValueError(f"page {page} freed twice")
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free.append(page)
                released.append(page)
        return released

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

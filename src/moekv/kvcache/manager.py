"""Per-sequence block tables on top of the block pool.

The scheduler asks whether a sequence can grow, the manager allocates pages as tokens arrive and
frees them (telling the cache format) when a sequence finishes, is aborted or is preempted.
"""

from __future__ import annotations

from typing import Callable

from moekv.kvcache.block_pool import BlockPool


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class KVCacheManager:
    """Maps sequence ids to lists of page ids."""

    def __init__(self, num_pages: int, page_size: int,
                 on_pages_freed: Callable[[list[int]], None] | None = None):
        self.page_size = page_size
        self.pool = BlockPool(num_pages)
        self._tables: dict[str, list[int]] = {}
        self._on_pages_freed = on_pages_freed

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

    def num_new_pages(self, seq_id: str, total_tokens: int) -> int:
        """Pages a sequence must add to hold `total_tokens` tokens."""
        return max(0, pages_needed(total_tokens, self.page_size) - len(self._tables.get(seq_id, ())))

    def can_grow(self, seq_id: str, total_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_pages(seq_id, total_tokens) + reserve <= self.pool.num_free

    def grow(self, seq_id: str, total_tokens: int) -> list[int]:
        """Make the sequence's table hold `total_tokens` tokens; returns its table."""
        extra = self.num_new_pages(seq_id, total_tokens)
        new_pages = self.pool.allocate(extra) if extra else []   # raises before any state changes
        table = self._tables.setdefault(seq_id, [])
        table.extend(new_pages)
        return table

    def free(self, seq_id: str) -> int:
        """Release a sequence's pages; returns how many returned to the pool."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        released = self.pool.free(table)
        if released and self._on_pages_freed is not None:
            self._on_pages_freed(released)
        return len(released)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

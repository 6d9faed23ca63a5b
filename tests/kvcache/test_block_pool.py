"""BlockPool (free list + reference counts) and KVCacheManager (per-sequence block tables)."""

from __future__ import annotations

import pytest

from moekv.errors import OutOfKVCacheError
from moekv.kvcache.block_pool import BlockPool
from moekv.kvcache.manager import KVCacheManager, pages_needed


def test_allocate_gives_distinct_pages_and_counts_usage():
    pool = BlockPool(8)
    first, second = pool.allocate(3), pool.allocate(2)
    assert len(set(first + second)) == 5 and all(0 <= p < 8 for p in first + second)
    assert (pool.num_free, pool.num_used, pool.usage) == (3, 5, 5 / 8)
    assert all(pool.ref_count(p) == 1 for p in first + second)
    assert pool.allocate(0) == []


def test_free_returns_pages_for_reuse():
    pool = BlockPool(4)
    pages = pool.allocate(4)
    assert pool.free(pages[:2]) == pages[:2]
    assert pool.num_free == 2 and pool.ref_count(pages[0]) == 0
    assert sorted(pool.allocate(2)) == sorted(pages[:2])


def test_shared_pages_return_when_the_last_holder_frees():
    pool = BlockPool(4)
    pages = pool.allocate(2)
    pool.share(pages)
    assert [pool.ref_count(p) for p in pages] == [2, 2]
    assert pool.free(pages) == [] and pool.num_free == 2
    assert pool.free(pages) == pages and pool.num_free == 4


def test_exhaustion_is_all_or_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(OutOfKVCacheError, match="asked for 2 KV pages, 1 free of 3"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_and_sharing_a_free_page_are_errors():
    pool = BlockPool(2)
    pages = pool.allocate(1)
    pool.free(pages)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(pages)
    with pytest.raises(ValueError, match="is free"):
        pool.share(pages)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pages_needed():
    assert [pages_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_manager_grows_tables_page_by_page():
    manager = KVCacheManager(num_pages=6, page_size=4)
    assert manager.capacity_tokens == 24 and not manager.has("a")
    table = list(manager.grow("a", 5))
    assert len(table) == 2 and manager.has("a")
    assert manager.grow("a", 8) == table                     # still fits in two pages
    assert manager.num_new_pages("a", 9) == 1
    grown = manager.grow("a", 9)
    assert grown[:2] == table and len(grown) == 3
    assert manager.block_table("b") == [] and manager.num_free_pages == 3


def test_manager_can_grow_respects_reserve_and_free_reports():
    freed: list[list[int]] = []
    manager = KVCacheManager(num_pages=4, page_size=2, on_pages_freed=freed.append)
    manager.grow("a", 4)                                     # 2 pages
    assert manager.can_grow("b", 4) and not manager.can_grow("b", 4, reserve=1)
    assert not manager.can_grow("b", 5)
    with pytest.raises(OutOfKVCacheError):
        manager.grow("b", 6)
    table = manager.block_table("a")
    assert manager.free("a") == 2 and sorted(freed[0]) == sorted(table)
    assert manager.free("a") == 0 and manager.num_free_pages == 4 and manager.usage == 0.0


def test_manager_shared_pages_stay_until_both_free():
    freed: list[list[int]] = []
    manager = KVCacheManager(num_pages=4, page_size=2, on_pages_freed=freed.append)
    table = manager.grow("a", 3)
    manager.pool.share(table)                                # e.g. a fork holding the same prefix
    assert manager.free("a") == 0 and freed == []
    assert manager.pool.free(table) == table and manager.num_free_pages == 4

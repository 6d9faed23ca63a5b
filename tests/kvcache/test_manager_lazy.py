"""The manager's staging-only ids (CacheConfig.lazy_partial_page): a partly filled last page holds one instead of a
pool page; `grow` swaps it for a pool page (telling the format first) when the page fills; ids return on free and
are never registered for prefix caching."""

from __future__ import annotations

import pytest

from moekv.errors import OutOfKVCacheError
from moekv.kvcache.manager import KVCacheManager
from moekv.kvcache.prefix_cache import PrefixCache

PAGE, POOL, TAILS = 4, 8, 3


def lazy_manager(prefix: bool = False):
    renamed, freed = [], []
    m = KVCacheManager(POOL, PAGE, on_pages_freed=freed.extend,
                       prefix_cache=PrefixCache(PAGE, b"t") if prefix else None,
                       staging_only_ids=range(POOL, POOL + TAILS), on_page_renamed=lambda a, b: renamed.append((a, b)))
    return m, renamed, freed


def test_partial_pages_hold_staging_only_ids_until_they_fill():
    m, renamed, _ = lazy_manager()
    assert m.num_new_pages("a", 3) == 0 and m.needs_tail("a", 3)
    assert m.grow("a", 3) == [POOL] and m.num_free_pages == POOL          # no pool page for 3 tokens
    assert m.grow("a", 4) == [0] and renamed == [(POOL, 0)]               # it fills: its pool page, renamed first
    assert m.num_free_tails == TAILS and m.num_free_pages == POOL - 1
    assert m.grow("a", 5) == [0, POOL]                                     # the next partial page
    assert m.grow("a", 13) == [0, 1, 2, POOL] and renamed[-1] == (POOL, 1)   # a chunk: fills it and two more
    assert m.grow("a", 16) == [0, 1, 2, 3] and renamed[-1] == (POOL, 3) and m.num_free_tails == TAILS


def test_ids_return_on_free_and_the_format_is_told():
    m, _, freed = lazy_manager()
    m.grow("a", 6)
    m.grow("b", 2)
    assert m.num_free_tails == TAILS - 2
    assert m.free("a") == 1 and freed == [POOL, 0]                         # the id, then the pool page
    assert m.num_free_tails == TAILS - 1 and m.num_free_pages == POOL
    m.free("b")
    assert m.num_free_tails == TAILS and m.num_free_pages == POOL


def test_running_out_of_ids_is_refused_before_any_state_changes():
    m, _, _ = lazy_manager()
    for seq in "abc":
        m.grow(seq, 1)
    assert not m.can_grow("d", 1) and m.can_grow("d", PAGE)             # a whole page needs no id
    with pytest.raises(OutOfKVCacheError, match="staging-only page ids"):
        m.grow("d", 5)
    assert not m.has("d") and m.num_free_pages == POOL
    assert not m.can_admit("d", 3, []) and m.can_admit("d", 8, [])


def test_prefix_caching_registers_pool_pages_only():
    m, _, _ = lazy_manager(prefix=True)
    tokens = list(range(10))
    hits = m.match_prefix("a", 10, lambda s, e: tokens[s:e])
    m.admit("a", hits, 10, 10)
    m.cache_computed("a", 10, lambda s, e: tokens[s:e])
    assert m.block_table("a") == [0, 1, POOL]
    m.free("a")                                                            # two full pages stay cached
    hits = m.match_prefix("b", 10, lambda s, e: tokens[s:e])
    assert [h.page for h in hits] == [0, 1]
    assert m.admit("b", hits, 10, 10) == [0, 1, POOL]


def test_staging_only_ids_must_follow_the_pool():
    with pytest.raises(ValueError, match="staging-only page ids"):
        KVCacheManager(POOL, PAGE, staging_only_ids=range(POOL - 1, POOL + 2), on_page_renamed=lambda a, b: None)

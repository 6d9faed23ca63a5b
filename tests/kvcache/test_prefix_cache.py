"""Prefix caching in the KV manager: reuse by reference count, LRU eviction of freed cached pages (never a
page in use), token comparison on every hit (a digest collision is a miss), the pool's evictable list."""

from __future__ import annotations

import pytest

from moekv.errors import OutOfKVCacheError
from moekv.kvcache import prefix_cache as prefix_module
from moekv.kvcache.block_pool import BlockPool
from moekv.kvcache.manager import KVCacheManager
from moekv.kvcache.prefix_cache import PrefixCache

PAGE = 4


class Seq:
    """A sequence's tokens as the manager sees them (token_ids(start, end))."""

    def __init__(self, seq_id: str, tokens: list[int]):
        self.id, self.tokens = seq_id, list(tokens)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def manager(num_pages: int = 16, freed: list | None = None, keeps=None) -> KVCacheManager:
    return KVCacheManager(num_pages, PAGE, on_pages_freed=None if freed is None else freed.extend,
                          prefix_cache=PrefixCache(PAGE, b"test"), keeps_freed_page=keeps)


def run(m: KVCacheManager, seq: Seq) -> tuple[list[int], int]:
    """Admit a sequence from its cached prefix, 'compute' all its tokens and register them; returns its
    table and how many tokens were hit (as the scheduler does)."""
    hits = m.match_prefix(seq.id, len(seq.tokens), seq.token_ids)
    table = list(m.admit(seq.id, hits, len(seq.tokens), len(seq.tokens)))
    m.cache_computed(seq.id, len(seq.tokens), seq.token_ids)
    return table, len(hits) * PAGE


def test_pool_retains_evicts_oldest_first_and_reuses():
    evicted: list[int] = []
    pool = BlockPool(4, on_evict=evicted.extend)
    pages = pool.allocate(4)
    assert pool.free(pages[:3], retain=lambda p: p != pages[2]) == pages[:3]
    assert (pool.num_free, pool.num_evictable, pool.usage) == (3, 2, 0.25)
    pool.reuse([pages[1]])                                   # a hit takes a retained page back
    assert pool.ref_count(pages[1]) == 1 and pool.num_evictable == 1
    assert pool.allocate(2) == [pages[2], pages[0]]           # free first, then the oldest retained
    assert evicted == [pages[0]]
    with pytest.raises(OutOfKVCacheError, match="asked for 1 KV pages, 0 free of 4"):
        pool.allocate(1)
    pool.free([pages[2]])                                     # no retain: plainly free
    with pytest.raises(ValueError, match="holds nothing to reuse"):
        pool.reuse([pages[2]])
    assert pool.discard(pages[3]) is False


def test_a_shared_prefix_is_reused_by_reference_and_counted():
    m = manager()
    a = Seq("a", list(range(100, 110)))                      # 2 full pages + 2 tokens
    table_a, hit_a = run(m, a)
    assert hit_a == 0 and len(table_a) == 3
    b = Seq("b", list(range(100, 108)) + [7, 7, 7])           # same first two pages
    table_b, hit_b = run(m, b)
    assert hit_b == 8 and table_b[:2] == table_a[:2] and table_b[2] not in table_a
    assert [m.pool.ref_count(p) for p in table_a] == [2, 2, 1]
    assert (m.prefix_cache.queries, m.prefix_cache.hits) == (21, 8)
    # the tail page (partly filled) was never registered; the full ones were, once
    assert not m.prefix_cache.is_cached(table_a[2]) and m.prefix_cache.num_cached_pages == 2   # b added none
    m.free("a")
    assert [m.pool.ref_count(p) for p in table_b] == [1, 1, 1] and m.pool.num_used == 3
    m.free("b")
    assert m.usage == 0.0 and m.pool.num_evictable == 2       # idle: nothing in use, the cached pages kept


def test_the_last_token_is_never_hit_so_a_hit_page_is_never_written():
    m = manager()
    run(m, Seq("a", list(range(8))))                          # exactly two pages
    m.free("a")
    again = Seq("a2", list(range(8)))
    hits = m.match_prefix(again.id, 8, again.token_ids)
    assert len(hits) == 1                                     # the second page holds the last token: computed
    longer = Seq("b", list(range(9)))
    assert len(m.match_prefix(longer.id, 9, longer.token_ids)) == 2


def test_eviction_takes_the_least_recent_freed_pages_and_never_one_in_use():
    freed: list[int] = []
    m = manager(num_pages=6, freed=freed)
    table_a, _ = run(m, Seq("a", list(range(9))))             # 3 pages, 2 full + registered
    table_b, _ = run(m, Seq("b", list(range(50, 59))))        # 3 more: the pool is full
    m.free("a")                                               # a's 2 cached pages retained, its tail freed
    assert freed == [table_a[2]] and m.pool.num_free == 3
    m.grow("c", 8)                                            # 2 pages: the free tail, then a's oldest (its 2nd)
    assert freed == [table_a[2], table_a[1]]                  # the evicted page is reported to the format
    assert m.prefix_cache.is_cached(table_a[0]) and not m.prefix_cache.is_cached(table_a[1])
    assert all(m.pool.ref_count(p) == 1 for p in table_b)     # b's pages were never candidates
    hits = m.match_prefix("a2", 9, Seq("a2", list(range(9))).token_ids)
    assert [h.page for h in hits] == [table_a[0]]             # the surviving root still hits
    with pytest.raises(OutOfKVCacheError):
        m.grow("d", 8)                                        # 1 retained page left: b's are in use
    assert all(m.pool.ref_count(p) == 1 for p in table_b) and m.prefix_cache.is_cached(table_a[0])


def test_a_hit_on_retained_pages_does_not_count_them_as_free():
    m = manager(num_pages=3)
    run(m, Seq("a", list(range(9))))
    m.free("a")                                               # 2 retained + 1 free
    b = Seq("b", list(range(9)) + [1, 2, 3])                   # hits 2 pages, needs 3 - 2 = 1 more... of 1 free
    hits = m.match_prefix(b.id, 12, b.token_ids)
    assert len(hits) == 2 and m.can_admit(b.id, 12, hits)
    assert not m.can_admit(b.id, 13, hits)                    # 2 more pages: only 1 is free besides the hits
    table = m.admit(b.id, hits, 12, 12)
    assert table[:2] == [h.page for h in hits] and m.pool.num_free == 0


def test_a_digest_collision_is_a_miss_never_a_wrong_page(monkeypatch):
    monkeypatch.setattr(prefix_module, "chain_digest", lambda previous, tokens: b"same digest for every page")
    m = manager()
    table_a, _ = run(m, Seq("a", list(range(12))))
    assert m.prefix_cache.num_cached_pages == 1               # pages 1, 2 collide with page 0: not registered
    other = Seq("b", [9] * 12)                                 # different tokens, same digest
    assert m.match_prefix(other.id, 12, other.token_ids) == []
    same_start = Seq("c", list(range(4)) + [9] * 8)
    hits = m.match_prefix(same_start.id, 12, same_start.token_ids)
    assert [h.page for h in hits] == [table_a[0]]              # verified by its tokens, and only that page
    # the colliding entry's parent is not the page matched before it: a chain can never jump
    shifted = Seq("d", list(range(4, 8)) + list(range(4)) + [0] * 4)
    assert m.match_prefix(shifted.id, 12, shifted.token_ids) == []


def test_pages_the_format_does_not_keep_are_freed_not_retained():
    freed: list[int] = []
    m = manager(freed=freed, keeps=lambda page: page != 0)     # page 0 lives in side storage (a sink page)
    table, _ = run(m, Seq("a", list(range(9))))
    assert table[0] == 0 and m.prefix_cache.is_cached(0)       # shared while held
    m.free("a")
    assert sorted(freed) == sorted([0, table[2]])
    assert not m.prefix_cache.is_cached(0) and m.prefix_cache.is_cached(table[1])
    # the orphaned second page can never be reached (its parent is gone); a recompute replaces it
    b = Seq("b", list(range(9)))
    assert m.match_prefix(b.id, 9, b.token_ids) == []
    table_b, _ = run(m, b)
    assert table[1] not in table_b and m.prefix_cache.is_cached(table_b[1])
    assert not m.prefix_cache.is_cached(table[1]) and table[1] in freed   # the stale entry's page is free now


def test_two_sequences_computing_the_same_prefix_keep_one_copy_registered():
    m = manager()
    a, b = Seq("a", list(range(8)) + [1]), Seq("b", list(range(8)) + [2, 3, 4, 5, 6])
    for seq in (a, b):                                          # both admitted before either computed
        m.admit(seq.id, m.match_prefix(seq.id, len(seq.tokens), seq.token_ids), len(seq.tokens), len(seq.tokens))
    for seq in (a, b):
        m.cache_computed(seq.id, len(seq.tokens), seq.token_ids)
    table_a, table_b = m.block_table("a"), m.block_table("b")
    assert [m.prefix_cache.is_cached(p) for p in table_a] == [True, True, False]
    assert [m.prefix_cache.is_cached(p) for p in table_b] == [False, False, True, False]   # b's 3rd chains on a's
    c = Seq("c", list(range(8)) + [2, 3, 4, 5, 6])
    hits = m.match_prefix(c.id, 13, c.token_ids)
    assert [h.page for h in hits] == table_a[:2] + [table_b[2]]


def test_without_a_prefix_cache_nothing_is_retained():
    m = KVCacheManager(8, PAGE)
    seq = Seq("a", list(range(9)))
    assert m.match_prefix(seq.id, 9, seq.token_ids) == []
    m.admit(seq.id, [], 9, 9)
    m.cache_computed(seq.id, 9, seq.token_ids)
    assert m.free("a") == 3 and m.pool.num_evictable == 0 and m.num_free_pages == 8
    with pytest.raises(ValueError, match="pages of 8"):
        KVCacheManager(8, PAGE, prefix_cache=PrefixCache(8))

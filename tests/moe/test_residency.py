"""ExpertCache: LRU / LFU eviction order, protection levels, hit / miss / prefetch counters."""

from __future__ import annotations

from moekv.moe.prefetch.residency import NEEDED, PREDICTED, PREDICTED_FAR, UNPROTECTED, ExpertCache


def fill(cache: ExpertCache, experts: list[int]) -> None:
    for expert in experts:
        cache.admit(expert, NEEDED)
        cache.use(expert)
    cache.end_step()


def test_empty_slots_fill_first_then_lru_evicts_least_recent():
    cache = ExpertCache(num_experts=6, num_slots=3, policy="lru")
    fill(cache, [0, 1, 2])
    assert cache.expert_in_slot == [0, 1, 2]
    cache.use(0)                                   # order of last use now: 1, 2, 0
    assert cache.admit(3, NEEDED) == (1, 1)        # slot 1 held expert 1, the least recent
    cache.use(3)
    cache.end_step()
    assert cache.admit(4, NEEDED) == (2, 2)
    assert sorted(cache.resident_experts()) == [0, 3, 4]
    assert cache.slot_of_expert[1] == -1 and cache.slot_of_expert[4] == 2
    assert cache.counters.evictions == 2


def test_lfu_evicts_least_used_ties_by_recency():
    cache = ExpertCache(num_experts=5, num_slots=3, policy="lfu")
    fill(cache, [0, 1, 2])
    for expert in (0, 0, 2):                       # uses: 0 -> 3, 1 -> 1, 2 -> 2
        cache.use(expert)
    assert cache.admit(3, NEEDED) == (1, 1)
    cache.use(3)                                   # uses: 0 -> 3, 2 -> 2, 3 -> 1
    cache.end_step()
    assert cache.admit(4, NEEDED) == (1, 3)
    cache.use(4)                                   # 4 and 2... 4 has 1 use, 2 has 2
    cache.use(2)                                   # 2 -> 3 uses, most recent; 0 -> 3 uses, older
    cache.end_step()
    assert cache.admit(1, NEEDED) == (1, 4)        # 4 has the fewest uses


def test_predicted_experts_are_protected_for_the_step():
    cache = ExpertCache(num_experts=6, num_slots=3, policy="lru")
    fill(cache, [0, 1, 2])                         # 0 is the least recent
    before = (cache.last_use[0], cache.use_count[0])
    cache.protect(0, PREDICTED)                    # a hint: no use recorded
    assert (cache.last_use[0], cache.use_count[0]) == before
    assert cache.admit(3, PREDICTED) == (1, 1)     # a prediction cannot evict a predicted expert
    assert cache.admit(4, PREDICTED) == (2, 2)
    assert cache.admit(5, PREDICTED) is None       # every slot is protected at PREDICTED
    assert cache.admit(5, NEEDED) == (0, 0)        # the block's own need may evict a prediction
    cache.end_step()
    assert cache.protection == [UNPROTECTED] * 6


def test_one_ahead_prediction_may_evict_two_ahead_but_not_needed():
    cache = ExpertCache(num_experts=4, num_slots=2, policy="lru")
    cache.admit(0, PREDICTED_FAR, prefetch=True)
    cache.admit(1, NEEDED)
    assert cache.victim(PREDICTED_FAR) is None
    assert cache.admit(2, PREDICTED, prefetch=True) == (0, 0)
    assert cache.victim(NEEDED) == 0               # expert 2 (PREDICTED) yes; expert 1 (NEEDED) never
    assert cache.counters.wasted_prefetches == 1   # expert 0 was prefetched and evicted unused


def test_hit_miss_and_prefetch_counters():
    cache = ExpertCache(num_experts=4, num_slots=2, policy="lru")
    cache.admit(1, PREDICTED, prefetch=True)
    assert cache.record_need(1) is True            # prefetched and needed: a hit, a prefetch hit
    assert cache.record_need(2) is False
    cache.admit(2, NEEDED)
    cache.use(1)
    cache.use(2)
    cache.end_step()
    assert cache.record_need(1) is True            # resident from before: a hit, not a prefetch hit
    counters = cache.counters
    assert (counters.hits, counters.prefetch_hits, counters.misses, counters.prefetches) == (2, 1, 1, 1)
    assert counters.hit_rate == 2 / 3

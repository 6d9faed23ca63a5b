"""Staging in blocks and lazy partly filled pages (CacheConfig.staging_block_size / lazy_partial_page) through the
engine on the bundled model: where the partial page's rows live changes no number the model computes, so greedy
tokens equal the whole-page staging's, synchronous and overlapped, with preemption and with prefix caching; and
the KV cache is empty again when idle."""

from __future__ import annotations

import pytest

from tests.engine.test_overlap_decode import _greedy, _llm, _run

VARIANTS = [dict(staging_block_size=2), dict(staging_block_size=4, lazy_partial_page=True),
            dict(lazy_partial_page=True)]


def _idle(llm) -> None:
    engine = llm.engine
    assert engine.kv_cache.slots.num_used <= 1                  # the graph runner's scratch page keeps its block
    assert engine.kv_manager.num_free_tails in (len(engine.kv_cache.staging_only_ids() or []), 1 << 30)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_tokens_match_whole_page_staging(overlap):
    want = _run(_llm(overlap, "int3", warm=False), _greedy())
    for variant in VARIANTS:
        llm = _llm(overlap, "int3", warm=False, **variant)
        assert _run(llm, _greedy()) == want, variant
        _idle(llm)


def test_preemption_and_prefix_caching_match_whole_page_staging():
    params = _greedy([24] * 4)
    prompts = [list(range(1 + 20 * i, 15 + 20 * i)) for i in range(4)]
    shared = list(range(1, 20))
    second = [shared + [50 + i] for i in range(3)]
    results = []
    for variant in [dict()] + VARIANTS:
        small = _llm(False, "int3", num_pages=18, enable_prefix_caching=False, **variant)
        cached = _llm(True, "int3", enable_prefix_caching=True, **variant)
        first = _run(cached, _greedy([12] * 3), second)
        again = _run(cached, _greedy([6] * 3), [p + t for p, (t, _, _) in zip(second, first)])
        results.append((_run(small, params, prompts), small.engine.scheduler.num_preemptions, first, again,
                        cached.engine.prefix_cache_stats()["prefix_cache_hits"]))
        _idle(small)
        _idle(cached)
    assert results[0][1] > 0 and results[0][4] > 0
    for variant, result in zip(VARIANTS, results[1:]):
        assert result[0] == results[0][0] and result[2:] == results[0][2:], variant
        # a lazy partial page holds no pool page: the same pool runs these 4 sequences with fewer preemptions
        assert result[1] <= results[0][1] if variant.get("lazy_partial_page") else result[1] == results[0][1]

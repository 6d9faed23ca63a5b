"""Prefix caching through the engine: a request whose prefix is cached prefills only its uncached tokens,
outputs are identical with and without caching (mock model; bundled model with bf16 KV), every low-bit
dtype computes exactly what a chunked prefill at the hit boundary computes, and preemption, abort and
idle leave every reference count at 0 (KV usage 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moekv import LLM
from moekv.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from moekv.engine.engine import Engine
from moekv.errors import ConfigError
from moekv.engine.async_engine import AsyncEngine
from moekv.metrics import ServerMetrics, parse_metrics
from moekv.paths import default_model_dir
from moekv.sampling import SamplingParams
from tests.engine.test_engine_mock import GREEDY, run_all
from tests.mock_model import MockModel


def mock_engine(caching=True, num_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64):
    config = EngineConfig(
        model=ModelConfig(model="mock", max_model_len=max_model_len),
        cache=CacheConfig(kv_cache_dtype="fp32", page_size=page_size, num_pages=num_pages,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        device=DeviceConfig("cpu"))
    return Engine(config, model=MockModel())


def assert_idle(engine):
    pool = engine.kv_manager.pool
    assert engine.kv_manager.usage == 0.0
    assert all(pool.ref_count(page) == 0 for page in range(pool.num_pages))
    assert pool.num_free == pool.num_pages
    cache = engine.kv_manager.prefix_cache
    if cache is not None:               # every registered page is retained (or in use): none was lost or freed
        registered = [page for page in range(pool.num_pages) if cache.is_cached(page)]
        assert len(registered) == cache.num_cached_pages == pool.num_evictable
        assert all(pool.is_evictable(page) for page in registered)


def test_config_switch_and_validation():
    assert CacheConfig().enable_prefix_caching is True
    with pytest.raises(ConfigError, match="enable_prefix_caching must be True or False"):
        CacheConfig(enable_prefix_caching="yes")
    assert mock_engine(caching=False).kv_manager.prefix_cache is None
    assert mock_engine().prefix_cache_stats() == {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0,
                                                  "prefix_cached_pages": 0.0}


def test_a_cached_prefix_is_not_prefilled_again_and_outputs_match():
    shared = list(range(1, 14))                                 # 13 tokens: 3 full pages of 4
    prompts = [shared + [40], shared + [50, 51], shared]
    results = {}
    for caching in (False, True):
        engine = mock_engine(caching)
        tokens = []
        for prompt in prompts:                                  # one after the other: each can hit the last
            rid = engine.add_request(prompt, SamplingParams(max_tokens=3, **GREEDY))
            tokens.append(run_all(engine)[rid].token_ids)
        results[caching] = (tokens, list(engine.model.forward_calls))
        assert_idle(engine)
    assert results[True][0] == results[False][0]
    # prefill forwards: 14 tokens, then 15 - 12 cached, then 13 - 12 (the last token is always computed)
    prefill_sizes = [n for n in results[True][1] if n > 1]
    assert prefill_sizes == [14, 3] and results[True][1].count(1) == 3 * 2 + 1
    assert [n for n in results[False][1] if n > 1] == [14, 15, 13]


def test_hits_are_counted_in_tokens_and_exported_as_vllm_names_them():
    engine = mock_engine()
    for prompt in (list(range(1, 10)), list(range(1, 10)) + [30]):
        engine.add_request(prompt, SamplingParams(max_tokens=2, **GREEDY))
        run_all(engine)
    stats = engine.prefix_cache_stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (9 + 10, 8)
    metrics = ServerMetrics("m")
    AsyncEngine(engine, metrics)._publish_stats()               # the snapshot the engine thread publishes
    values = parse_metrics(metrics.render().decode())
    assert values["moekv:prefix_cache_queries_total"] == 19 and values["moekv:prefix_cache_hits_total"] == 8


def test_requests_arriving_together_prefill_their_shared_prefix_once():
    engine = mock_engine()
    ids = [engine.add_request(list(range(1, 13)) + [30 + i], SamplingParams(max_tokens=2, **GREEDY))
           for i in range(4)]
    other = engine.add_request(list(range(40, 45)), SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    assert engine.model.forward_calls == [13 + 5]    # the sharers wait (their next page is computed in this
    assert [r.request_id for r in engine.scheduler.waiting] == ids[1:]   # step), keeping their place; `other` runs
    engine.step()
    assert engine.model.forward_calls[1] == 2 + 3    # two decode, the others hit 12 and prefill 1 each
    assert engine.requests[other].num_computed_tokens == 6
    run_all(engine)
    assert [engine.requests[rid].output_token_ids for rid in ids] == [[31 + i, 32 + i] for i in range(4)]
    assert engine.prefix_cache_stats()["prefix_cache_hits"] == 3 * 12
    assert_idle(engine)


def test_a_long_queue_of_sharers_is_scanned_only_so_far():
    from moekv.scheduler.scheduler import MAX_DEFERRED

    engine = mock_engine(num_pages=512, max_num_seqs=128, max_num_batched_tokens=4096, max_model_len=32)
    sharers = [engine.add_request(list(range(1, 9)) + [20 + i % 30], SamplingParams(max_tokens=1, **GREEDY))
               for i in range(MAX_DEFERRED + 2)]
    late = engine.add_request([60, 61], SamplingParams(max_tokens=1, **GREEDY))
    engine.step()
    waiting = [r.request_id for r in engine.scheduler.waiting]
    assert waiting == sharers[1:] + [late]           # 64 held back, then the scan stopped: order kept
    engine.step()
    assert engine.prefix_cache_stats()["prefix_cache_hits"] == len(sharers[1:]) * 8
    run_all(engine)
    assert_idle(engine)


def test_generated_pages_are_cached_for_the_next_turn():
    engine = mock_engine()
    first = engine.add_request([1, 2, 3], SamplingParams(max_tokens=10, **GREEDY))
    out = run_all(engine)[first]
    turn = [1, 2, 3] + out.token_ids + [60]                      # the conversation so far + a new message
    engine.model.forward_calls.clear()
    second = engine.add_request(turn, SamplingParams(max_tokens=1, **GREEDY))
    run_all(engine)
    assert engine.requests[second].num_computed_tokens == 14 and engine.model.forward_calls == [2]
    assert_idle(engine)


def test_shared_pages_survive_preemption_and_reference_counts_stay_exact():
    # 10 pages of 4 tokens for 4 sequences of 9 + 12 tokens sharing 2 pages: some must be preempted
    outputs = {}
    for caching in (False, True):
        engine = mock_engine(caching, num_pages=10, max_model_len=24)
        ids = [engine.add_request(list(range(1, 9)) + [20 + i], SamplingParams(max_tokens=12, **GREEDY))
               for i in range(4)]
        seen_shared = 0
        while engine.has_unfinished():
            engine.step()
            pool = engine.kv_manager.pool
            held = {}
            for request in engine.scheduler.running:
                for page in engine.kv_manager.block_table(request.request_id):
                    held[page] = held.get(page, 0) + 1
            assert all(pool.ref_count(page) == count for page, count in held.items())
            assert all(pool.ref_count(p) == 0 for p in range(pool.num_pages) if p not in held)
            seen_shared = max(seen_shared, max(held.values(), default=0))
        outputs[caching] = [engine.requests[i].output_token_ids for i in ids]
        assert engine.scheduler.num_preemptions >= 1
        assert seen_shared >= 2 if caching else seen_shared == 1
        assert_idle(engine)
    assert outputs[True] == outputs[False]


def test_abort_mid_prefill_and_mid_decode_releases_exactly():
    engine = mock_engine(max_num_batched_tokens=8)
    engine.add_request(list(range(1, 17)), SamplingParams(max_tokens=2, **GREEDY))
    run_all(engine)
    a = engine.add_request(list(range(1, 17)) + list(range(30, 46)), SamplingParams(max_tokens=8, **GREEDY))
    b = engine.add_request(list(range(1, 17)) + [50], SamplingParams(max_tokens=8, **GREEDY))
    engine.step()                                   # a: hit 16, a first chunk of 8 of its 16 new; b waits
    assert engine.requests[a].num_computed_tokens == 24 and engine.requests[b].num_computed_tokens == 0
    assert engine.abort(a)                          # mid-prefill
    for _ in range(3):
        engine.step()                               # b: hit, prefill 1, decode
    assert engine.requests[b].num_computed_tokens > 17
    shared = engine.kv_manager.block_table(b)[:4]
    assert all(engine.kv_manager.pool.ref_count(p) == 1 for p in shared)
    assert engine.abort(b)                          # mid-decode
    assert_idle(engine)
    assert engine.kv_manager.pool.num_evictable > 0


# -- the bundled model ---------------------------------------------------------------------------------
def bundled(caching: bool, kv_cache_dtype: str = "auto", **kwargs) -> LLM:
    return LLM(model=default_model_dir(), kv_cache_dtype=kv_cache_dtype, device="cpu", max_model_len=512,
               cuda_graphs=False, enable_prefix_caching=caching, num_pages=48, **kwargs)


@pytest.fixture(scope="module")
def text_ids():
    llm = bundled(False)
    text = (Path(default_model_dir()) / "validation_slice.txt").read_text()
    return llm.tokenizer.encode(text)[:600]


def test_bundled_bf16_greedy_outputs_identical_with_and_without_caching(text_ids):
    prefix = text_ids[:96]                                      # 6 pages of 16
    prompts = [prefix + text_ids[100 + 9 * i:105 + 10 * i] for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    runs = {}
    for caching in (False, True):
        llm = bundled(caching)
        first = llm.generate(prompts[:1], params)                # warms the cache
        rest = llm.generate(prompts[1:], params)                  # one batch of two, both hitting
        runs[caching] = [out.outputs[0].token_ids for out in first + rest]
        if caching:
            assert llm.engine.prefix_cache_stats()["prefix_cache_hits"] == 2 * 96
        assert_idle(llm.engine)
    assert runs[True] == runs[False]
    assert all(len(tokens) == 12 for tokens in runs[True])


@pytest.mark.parametrize("kv_cache_dtype", ["int4", "int3", "int2"])
def test_low_bit_hit_computes_what_a_chunked_prefill_at_its_boundary_computes(text_ids, kv_cache_dtype):
    """A hit reads the prefix from quantized pages, as the second chunk of a prefill split at the same page
    boundary does: logprobs bit-identical (same pages, same kernels), for every low-bit width."""
    prefix = text_ids[:128]                                     # one 128-token low-bit page
    prompt = prefix + text_ids[200:260]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    cached = bundled(True, kv_cache_dtype)
    cached.generate([prefix], params)
    hit = cached.generate([prompt], params)[0].outputs[0]
    assert cached.engine.prefix_cache_stats()["prefix_cache_hits"] == 128
    chunked = bundled(False, kv_cache_dtype, max_num_batched_tokens=128, max_num_seqs=128)
    reference = chunked.generate([prompt], params)[0].outputs[0]
    assert hit.token_ids == reference.token_ids and hit.logprobs == reference.logprobs
    assert_idle(cached.engine)
    assert cached.engine.kv_cache.stats()["staging_pages_used"] == 0


def test_low_bit_sink_pages_are_shared_while_held_and_freed_after(text_ids):
    llm = bundled(True, "int3", fp_sink_pages=1)
    prompt = text_ids[:300]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    together = llm.generate([prompt, prompt], params)          # the second waits a step and hits both pages
    assert llm.engine.prefix_cache_stats()["prefix_cache_hits"] == 256   # the fp sink page while it was held
    again = llm.generate([prompt], params)[0].outputs[0]         # the sink page went with its holders
    assert llm.engine.prefix_cache_stats()["prefix_cache_hits"] == 256
    assert again.token_ids == together[0].outputs[0].token_ids   # computed alone from scratch, both times
    assert_idle(llm.engine)
    assert llm.engine.kv_cache.stats()["staging_pages_used"] == 0

"""Overlapped decode steps (engine/overlap.py, DeviceConfig.overlap_decode), on the CPU in static graph mode:
the step code a CUDA graph captures runs eagerly, the launch, the token feed and the one-step-later read-back
as on the GPU. Outputs must equal synchronous steps' (greedy and seeded, stop tokens and strings, max_tokens,
a request added mid-run, an abort, a preemption, the low-bit cache), and the host's waits on the device must
leave no step without the next one queued behind it.
"""

from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.config import DeviceConfig, EngineConfig, ModelConfig, ParallelConfig
from moekv.errors import ConfigError
from moekv.paths import default_model_dir
from tests.helpers import poison_graph_key

PAGE = 8
PROMPTS = [[5, 17, 33, 9, 100, 3, 44], [7], [12, 13, 14], list(range(1, 15)), [40, 41]]
MAX_TOKENS = [9, 14, 3, 7, 11]


def _llm(overlap: bool, kv: str = "fp32", max_num_seqs: int = 8, warm: bool = True, **kwargs) -> LLM:
    """The bundled model in static graph mode; `warm`: every bucket built up front, as on a GPU once each has
    been captured (an overlapped step never builds one: the first step of a new batch size runs synchronously)."""
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype=kv, device="cpu", page_size=PAGE,
              max_model_len=kwargs.pop("max_model_len", 128), max_num_seqs=max_num_seqs, cuda_graphs=False, **kwargs)
    runner = llm.engine.runner
    assert runner.enable_graphs(capture=False), runner.graph_fallback_reason
    if overlap:
        assert llm.engine.enable_overlap()
    if warm:
        for size in runner.buckets:
            runner._bucket(size)
    return llm


def _run(llm: LLM, params, prompts=PROMPTS):
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]


def _greedy(max_tokens=MAX_TOKENS, **kwargs):
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kwargs) for n in max_tokens]


def _pools(engine) -> list[torch.Tensor]:
    cache = engine.kv_cache
    if hasattr(cache, "key_pages") and isinstance(cache.key_pages, torch.Tensor):
        return [cache.key_pages.clone(), cache.value_pages.clone()]
    return [t.clone() for pages in (cache.key_pages, cache.value_pages) for p in pages
            for t in vars(p).values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("kv", ["fp32", "int3"])
def test_greedy_outputs_expert_load_and_kv_pages_match_synchronous_steps(kv):
    sync, overlap = _llm(False, kv, warm=False), _llm(True, kv, warm=False)
    want, got = _run(sync, _greedy()), _run(overlap, _greedy())
    assert got == want and [len(t) for t, _, _ in got] == MAX_TOKENS
    stats = overlap.engine.overlap.stats
    # the first run builds the buckets 8, 4, 2, 1 as the batch shrinks: each first use drains and runs synchronously
    assert stats["drained"] == 4 and stats["overlapped"] == 5
    # the buckets are there now (the second run's prompts hit the first run's cached pages: other tokens for int3)
    assert _run(overlap, _greedy()) == _run(sync, _greedy())
    # 13 decode steps (the first token comes from the prefill): one launched from a synchronous schedule, 12 behind
    # another step, then the drain at the end; max_tokens is known ahead, so no row is discarded
    assert stats["overlapped"] == 5 + 12 and stats["drained"] == 4 + 1 and stats["discarded_rows"] == 0
    assert overlap.engine.runner.graph_steps == sync.engine.runner.graph_steps
    assert torch.equal(overlap.engine.expert_load(), sync.engine.expert_load())
    assert overlap.engine.routing_stats()["expert_load"] == sync.engine.routing_stats()["expert_load"]
    for a, b in zip(_pools(overlap.engine), _pools(sync.engine)):
        assert torch.equal(a, b)
    assert overlap.engine.kv_cache.stats() == sync.engine.kv_cache.stats()
    assert overlap.engine.overlap.in_flight is None and not overlap.engine.has_unfinished()
    assert overlap.engine.kv_manager.num_free_pages == sync.engine.kv_manager.num_free_pages


def test_seeded_sampling_matches_synchronous_steps():
    params = [SamplingParams(max_tokens=n, temperature=0.9, top_k=20, top_p=0.9, seed=7 + i, ignore_eos=True)
              for i, n in enumerate(MAX_TOKENS)]
    params[2] = SamplingParams(max_tokens=MAX_TOKENS[2], temperature=0.0, ignore_eos=True)   # greedy beside them
    overlap = _llm(True)
    want, got = _run(_llm(False), params), _run(overlap, params)
    assert got == want
    assert overlap.engine.overlap.stats["overlapped"] >= 10


@pytest.mark.parametrize("kv", ["fp32", "int3"])
def test_stop_tokens_end_on_the_same_token_and_emit_nothing_after(kv):
    plain = _run(_llm(False, kv), _greedy([12] * len(PROMPTS)))
    # a stop token each request meets mid-run, where possible the token whose position ends a KV page: the
    # discarded row of the step after computes that page full, which must not register it in the prefix cache
    stops = [(PAGE - 1 - len(prompt)) % PAGE or PAGE for prompt in PROMPTS]     # output index of the stop
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[j]])
              for (tokens, _, _), j in zip(plain, stops)]
    sync, overlap = _llm(False, kv), _llm(True, kv)
    want, got = _run(sync, params), _run(overlap, params)
    assert got == want
    assert all(reason == "stop" and len(tokens) <= j + 1 for (tokens, reason, _), j in zip(got, stops))
    assert sum((len(p) + len(t) - 1) % PAGE == PAGE - 1 for p, (t, _, _) in zip(PROMPTS, got)) >= 2
    assert overlap.engine.prefix_cache_stats() == sync.engine.prefix_cache_stats()
    stats = overlap.engine.overlap.stats
    assert stats["discarded_rows"] >= 1 and stats["overlapped"] >= 2
    assert all(r.num_pending_tokens == 0 for r in overlap.engine.requests.values())
    assert overlap.engine.kv_manager.num_free_pages == sync.engine.kv_manager.num_free_pages
    if kv == "int3":            # every staging slot is back (the scratch page keeps one if padding rows took it)
        assert overlap.engine.kv_cache.slots.num_used == sync.engine.kv_cache.slots.num_used <= 1
        assert not overlap.engine.kv_cache._pending


def test_non_finite_logits_end_only_that_request():
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    clean = [t for t, _, _ in _run(_llm(False), params, PROMPTS[:3])]
    llm = _llm(True)
    model = llm.engine.model
    compute, calls = model.compute_logits, [0]

    def poisoned(hidden):
        logits = compute(hidden)
        calls[0] += 1
        if calls[0] == 5:                 # a graph step of all three: row 1 (the second request) broken
            logits = logits.clone()
            logits[1, 0] = float("nan")
        return logits
    model.compute_logits = poisoned
    outs = llm.generate(PROMPTS[:3], params)
    assert outs[1].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].token_ids == clean[1][:len(outs[1].outputs[0].token_ids)]
    assert [outs[i].outputs[0].token_ids for i in (0, 2)] == [clean[0], clean[2]]
    assert llm.engine.overlap.stats["discarded_rows"] == 1


def test_non_finite_kv_found_a_step_later_recovers_like_a_synchronous_step():
    """The low-bit cache's non-finite flag of step n is read after step n+1 was launched: step n+1 is read and
    dropped, the bad request ends, the other is recomputed and matches a clean run token for token."""
    prompts = [[5, 17, 33], [7, 8]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = _llm(False, "int3", max_num_seqs=2)
    clean = [t for t, _, _ in _run(reference, params, prompts)]
    llm = _llm(True, "int3", max_num_seqs=2)
    engine = llm.engine
    cache = engine.kv_cache
    poison = poison_graph_key(cache)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.overlap.in_flight is not None
    poison["armed"] = True
    while engine.has_unfinished():
        engine.step()
    assert not poison["armed"] and engine.overlap.stats["overlapped"] >= 2
    first, second = engine.requests[ids[0]], engine.requests[ids[1]]
    assert first.finish_reason == "error" and "non-finite keys or values" in first.error
    assert second.finish_reason == "length" and second.output_token_ids == clean[1]
    assert cache.slots.num_used == reference.engine.kv_cache.slots.num_used <= 1
    assert not cache._pending and not engine.runner._in_flight


def test_stop_strings_match_synchronous_steps():
    prompts = ["ROMEO:", "First Citizen:\nBefore we", "KING"]
    plain = _llm(False)
    texts = [t for _, _, t in _run(plain, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), prompts)]
    stops = [text[5:8] for text in texts]                  # strings met mid-run
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[s]) for s in stops]
    sync, overlap = _llm(False), _llm(True)
    want, got = _run(sync, params, prompts), _run(overlap, params, prompts)
    assert got == want
    assert all(reason == "stop" for _, reason, _ in got)
    assert overlap.engine.overlap.stats["overlapped"] >= 2


def test_requests_that_cannot_overlap_still_match():
    """logprobs and penalties need the last token on the host: those steps run synchronously (drained)."""
    params = _greedy()
    params[2] = SamplingParams(max_tokens=MAX_TOKENS[2], temperature=0.0, logprobs=2, ignore_eos=True)
    params[3] = SamplingParams(max_tokens=MAX_TOKENS[3], temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    sync, overlap = _llm(False), _llm(True)
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in sync.generate(PROMPTS, params)]
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in overlap.generate(PROMPTS, params)]
    assert got == want
    stats = overlap.engine.overlap.stats
    # while the logprobs (3 tokens) and penalty (7) requests run, steps are synchronous; then they overlap
    assert stats["launched"] == 14 - 7 and stats["overlapped"] == 14 - 7 - 1


def _step_until_done(engine, at_position: int, add: list[int], params) -> dict[str, list[int]]:
    """Step until every request finishes; add a request once the first running request has `at_position`
    tokens computed (the same engine state with and without overlap: the step computing that position has run)."""
    added = False
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        if not added and running and running[0].num_computed_tokens >= at_position:
            engine.add_request(add, params, request_id="late")
            added = True
    assert added
    return {rid: list(r.output_token_ids) for rid, r in engine.requests.items()}


def test_request_added_mid_run_matches():
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = []
    for overlap in (False, True):
        engine = _llm(overlap).engine
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(prompt, params, request_id=f"r{i}")
        results.append(_step_until_done(engine, 12, [300, 301, 302, 303], params))
    assert results[0] == results[1] and len(results[1]["late"]) == 10


def test_abort_while_a_step_is_in_flight():
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = {o.request_id: o.outputs[0].token_ids for o in _llm(False).generate(PROMPTS[:3], params)}
    engine = _llm(True).engine
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    free = engine.kv_manager.num_free_pages
    for _ in range(5):
        engine.step()
    assert engine.overlap.in_flight is not None
    victim = engine.requests[ids[1]]
    assert victim.num_pending_tokens == 1
    assert engine.abort(ids[1])
    assert victim.num_pending_tokens == 0 and victim.finish_reason == "abort"
    seen = list(victim.output_token_ids)
    while engine.has_unfinished():
        engine.step()
    assert victim.output_token_ids == seen == want[ids[1]][:len(seen)] and len(seen) >= 3
    for rid in (ids[0], ids[2]):
        assert engine.requests[rid].output_token_ids == want[rid]
    assert engine.overlap.stats["discarded_rows"] == 1
    # aborting everything with a step in flight leaves nothing launched
    more = [engine.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(4):
        engine.step()
    assert engine.overlap.in_flight is not None
    for rid in more:
        engine.abort(rid)
    assert engine.overlap.in_flight is None and not engine.has_unfinished() and not engine.runner._in_flight
    assert all(not engine.kv_manager.has(r) for r in engine.requests)
    assert engine.kv_manager.num_free_pages == free == engine.kv_manager.pool.num_pages - 1   # the scratch page only


def test_preemption_drains_and_matches():
    """A pool too small for every sequence: the synchronous schedule preempts; an overlapped step never
    does (schedule_ahead declines), so the engine drains and preempts exactly as without overlap."""
    params = _greedy([24] * 4)
    prompts = [list(range(1 + 20 * i, 15 + 20 * i)) for i in range(4)]
    sync, overlap = _llm(False, num_pages=18, enable_prefix_caching=False), \
        _llm(True, num_pages=18, enable_prefix_caching=False)
    want, got = _run(sync, params, prompts), _run(overlap, params, prompts)
    assert sync.engine.scheduler.num_preemptions > 0
    assert overlap.engine.scheduler.num_preemptions == sync.engine.scheduler.num_preemptions
    assert got == want
    assert overlap.engine.overlap.stats["drained"] > 0 and overlap.engine.overlap.stats["overlapped"] > 0


def test_prefix_cached_pages_match():
    """Prefix caching on: pages of steps still in flight are registered only once read; a second batch sharing
    the prefixes hits the same pages with and without overlap."""
    shared = list(range(1, 20))
    prompts = [shared + [50 + i] for i in range(3)]
    results = []
    for overlap in (False, True):
        llm = _llm(overlap, enable_prefix_caching=True)
        first = _run(llm, _greedy([12] * 3), prompts)
        second = _run(llm, _greedy([6] * 3), [p + t for p, (t, _, _) in zip(prompts, first)])
        results.append((first, second, llm.engine.prefix_cache_stats()))
    assert results[0] == results[1] and results[1][2]["prefix_cache_hits"] > 0


def _count_waits(monkeypatch, engine) -> list[dict]:
    """Per engine step: the host's waits on the device for a step's results, and how many of them had no
    later step queued behind them (the GPU idles from the end of that step until the host launches again)."""
    runner = engine.runner
    log: list[dict] = []
    current = {"waits": 0, "idle": 0}
    collect = runner.collect_graph

    def counted(step):
        behind = [s for s in runner._in_flight if s is not step]
        current["waits"] += 1
        current["idle"] += not behind
        return collect(step)
    monkeypatch.setattr(runner, "collect_graph", counted)
    step = engine.step

    def stepped():
        current.update(waits=0, idle=0)
        outputs = step()
        log.append(dict(current))
        return outputs
    monkeypatch.setattr(engine, "step", stepped)
    return log


def test_host_waits_leave_no_idle_gap_in_steady_state(monkeypatch):
    counts = {}
    for overlap in (False, True):
        llm = _llm(overlap, max_num_seqs=2)
        log = _count_waits(monkeypatch, llm.engine)
        _run(llm, _greedy([20, 20]), [[5, 17, 33], [7, 8]])
        counts[overlap] = log
        monkeypatch.undo()
    sync, overlap = counts[False], counts[True]
    # synchronous: every graph step waits once for its own result, nothing queued behind it
    assert sum(s["waits"] for s in sync) >= 18 and all(s["idle"] == s["waits"] for s in sync)
    # overlapped: the same one wait per step, but with the next step queued behind it, but for the drain at the end
    assert sum(s["waits"] for s in overlap) == sum(s["waits"] for s in sync)
    assert sum(s["idle"] for s in overlap) == 1 and sum(s["waits"] for s in sync) == 19


def test_overlap_switch():
    assert DeviceConfig().overlap_decode is None                       # auto, resolved by EngineConfig
    assert EngineConfig(model=ModelConfig(model="x")).device.overlap_decode is True
    assert EngineConfig(model=ModelConfig(model="x"), parallel=ParallelConfig(expert_parallel_size=2)
                        ).device.overlap_decode is False
    assert EngineConfig(model=ModelConfig(model="x"), device=DeviceConfig(overlap_decode=False)
                        ).device.overlap_decode is False
    with pytest.raises(ConfigError, match="overlap_decode must be True, False or None"):
        DeviceConfig(overlap_decode=1)
    with pytest.raises(ConfigError, match="overlap_decode needs expert_parallel_size == 1"):
        EngineConfig(model=ModelConfig(model="x"), device=DeviceConfig(overlap_decode=True),
                     parallel=ParallelConfig(expert_parallel_size=2))
    # without graph steps (the CPU) the switch leaves the engine synchronous, with the same outputs
    llm = LLM(model=default_model_dir(), dtype="fp32", device="cpu", max_model_len=64, overlap_decode=True)
    assert llm.engine.overlap is None
    out = llm.generate([[5, 17, 33]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


# -- CUDA: captured graphs, real asynchrony ----------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (captured graphs, pinned copies, events)")
@pytest.mark.parametrize("kv_cache_dtype,dtype", [("bf16", "bf16"), ("int3", "bf16"), ("fp32", "fp32")])
def test_cuda_overlapped_steps_match_synchronous_ones(kv_cache_dtype, dtype):
    """Replayed graphs with the token feed, status rows copied to pinned memory and read a step later: greedy and
    seeded tokens and the expert load (no request ends on a token here: no discarded row) equal the synchronous
    graph steps'."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    params[1] = SamplingParams(max_tokens=MAX_TOKENS[1], temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    results = []
    for overlap in (False, True):
        llm = LLM(model=default_model_dir(), dtype=dtype, kv_cache_dtype=kv_cache_dtype, device="cuda",
                  page_size=16, max_model_len=256, max_num_seqs=8, overlap_decode=overlap)
        runner = llm.engine.runner
        assert runner.graph_mode == "cuda", runner.graph_fallback_reason
        assert (llm.engine.overlap is not None) == overlap
        first = _run(llm, params)                   # captures the buckets
        again = _run(llm, params)                   # every step of a batch size seen before may overlap
        results.append((first, again, llm.engine.expert_load()))
        if overlap:
            assert llm.engine.overlap.stats["overlapped"] >= 10 and runner.captures == 4
    (sync_first, sync_again, sync_load), (first, again, load) = results
    assert first == sync_first and again == sync_again and torch.equal(load, sync_load)


def test_server_loop_streams_the_same_tokens():
    """AsyncEngine (the server's engine thread) over an overlapped engine: each delta arrives a step later, the
    streams carry the same tokens and finish reasons, and an abort from a client ends its stream."""
    import asyncio

    from moekv.engine.async_engine import AsyncEngine

    async def stream_all(async_engine, abort_after: int | None = None):
        streams = [await async_engine.add([(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0,
                                                                       ignore_eos=True))])
                   for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))]

        async def collect(stream, limit):
            tokens, reason = [], None
            async with stream:
                async for delta in stream:
                    tokens += delta.token_ids
                    reason = delta.finish_reason if delta.finished else reason
                    if limit is not None and len(tokens) >= limit:
                        break                       # leaving the block aborts the request
            return tokens, reason
        return await asyncio.gather(*(collect(s, abort_after if i == 1 else None) for i, s in enumerate(streams)))

    results = []
    for overlap in (False, True):
        engine = _llm(overlap).engine
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            results.append(asyncio.run(asyncio.wait_for(stream_all(async_engine, abort_after=4), timeout=60)))
        finally:
            async_engine.shutdown()
        assert not engine.has_unfinished()
        assert engine.kv_manager.num_free_pages == engine.kv_manager.pool.num_pages - 1
        assert not overlap or engine.overlap.stats["overlapped"] >= 5
    sync, overlapped = results
    assert [r for i, r in enumerate(overlapped) if i != 1] == [r for i, r in enumerate(sync) if i != 1]
    assert overlapped[1][0][:4] == sync[1][0][:4] and len(overlapped[1][0]) >= 4

"""AsyncEngine around a mock engine, without HTTP: deltas, validation, abort, failure isolation, a dead
loop (the app's answers through an in-process ASGI transport: tests/entrypoints/openai/test_server_asgi.py)."""

from __future__ import annotations

import asyncio

import pytest

from moekv.engine.async_engine import AsyncEngine
from moekv.engine.streams import EngineDeadError
from moekv.errors import InvalidRequestError
from moekv.sampling import SamplingParams
from tests.entrypoints.openai.helpers import make_engine

GREEDY = dict(temperature=0.0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def collect(stream):
    tokens, finish, errors = {}, {}, {}
    async with stream:
        async for delta in stream:
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            if delta.finished:
                finish[delta.request_id] = delta.finish_reason
                errors[delta.request_id] = delta.error
    return tokens, finish, errors


def started(engine, **kwargs) -> AsyncEngine:
    async_engine = AsyncEngine(engine, **kwargs)
    async_engine.start()
    return async_engine


def test_deltas_carry_every_token_and_release_the_request():
    engine = make_engine(None)
    async_engine = started(engine)

    async def main():
        a = await async_engine.add([("a", [1, 2, 3], SamplingParams(max_tokens=5, **GREEDY))])
        b = await async_engine.add([("b0", [10], SamplingParams(max_tokens=3, **GREEDY)),
                                    ("b1", [20], SamplingParams(max_tokens=2, **GREEDY))])
        return await asyncio.gather(collect(a), collect(b))

    (a_tokens, a_finish, _), (b_tokens, b_finish, _) = run(main())
    async_engine.shutdown()
    assert a_tokens == {"a": [4, 5, 6, 7, 8]} and a_finish == {"a": "length"}
    assert b_tokens == {"b0": [11, 12, 13], "b1": [21, 22]}
    assert not engine.requests and engine.kv_manager.usage == 0.0
    assert async_engine.stats.kv_cache_usage == 0.0 and async_engine.stats.num_running == 0


def test_a_bad_request_in_a_batch_is_rejected_and_nothing_is_kept():
    engine = make_engine(None)
    async_engine = started(engine)

    async def main():
        with pytest.raises(InvalidRequestError) as info:
            await async_engine.add([("ok", [1, 2], SamplingParams(max_tokens=2)),
                                    ("bad", [1, 10_000], SamplingParams(max_tokens=2))])
        assert info.value.param == "prompt"
        await asyncio.sleep(0.1)

    run(main())
    async_engine.shutdown()
    assert not engine.requests and engine.kv_manager.usage == 0.0


def test_abort_frees_pages_and_ends_the_stream():
    engine = make_engine(None, delay_s=0.005)
    async_engine = started(engine)

    async def main():
        stream = await async_engine.add([("long", [1], SamplingParams(max_tokens=60, **GREEDY))])
        first = await stream.__anext__()
        stream.abort()
        for _ in range(200):
            if async_engine.stats.kv_cache_usage == 0.0 and not engine.requests:
                break
            await asyncio.sleep(0.01)
        return first

    first = run(main())
    async_engine.shutdown()
    assert first.token_ids == [2]
    assert engine.kv_manager.usage == 0.0 and not engine.requests


def test_a_failing_request_is_isolated_from_the_rest_of_its_batch():
    # Token 40 poisons any batch it is in: prompts [30] and [35] reach it after 10 and 5 tokens.
    engine = make_engine(None, poison_token=40)
    async_engine = started(engine)
    prompts = {"r0": [1], "r1": [30], "r2": [5], "r3": [35], "r4": [50]}

    async def main():
        stream = await async_engine.add([(rid, p, SamplingParams(max_tokens=8, **GREEDY))
                                         for rid, p in prompts.items()])
        return await collect(stream)

    tokens, finish, errors = run(main())
    alive = async_engine.is_alive
    async_engine.shutdown()
    assert alive
    assert finish == {"r0": "length", "r1": "length", "r2": "length", "r3": "error", "r4": "length"}
    assert "poisoned batch" in errors["r3"]
    assert tokens["r0"] == list(range(2, 10)) and tokens["r2"] == list(range(6, 14))
    assert tokens["r1"] == list(range(31, 39)) and tokens["r4"] == list(range(51, 59))
    assert tokens["r3"] == [36, 37, 38, 39, 40]      # 40 was sampled; the step that fed it back failed
    assert engine.kv_manager.usage == 0.0 and not engine.requests


def test_a_dead_loop_ends_streams_and_refuses_new_requests():
    engine = make_engine(None, delay_s=0.005)
    async_engine = started(engine)

    async def main():
        stream = await async_engine.add([("r", [1], SamplingParams(max_tokens=50, **GREEDY))])
        await stream.__anext__()

        def broken():
            raise RuntimeError("scheduler bug")

        engine.has_unfinished = broken
        tokens, finish, errors = await collect(stream)
        with pytest.raises(EngineDeadError):
            await async_engine.add([("s", [1], SamplingParams(max_tokens=2))])
        return finish, errors

    finish, errors = run(main())
    assert finish == {"r": "error"} and "scheduler bug" in errors["r"]
    assert not async_engine.is_alive and "scheduler bug" in async_engine.dead_reason

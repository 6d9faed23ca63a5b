"""Engine and scheduler with a mock model (no weights): batching, chunked prefill, preemption,
abort, stop conditions."""

from __future__ import annotations

import pytest
import torch

from moekv.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from moekv.engine.engine import Engine
from moekv.errors import InvalidRequestError
from moekv.sampling import SamplingParams
from tests.mock_model import MockModel, mock_arch

GREEDY = dict(temperature=0.0)


def make_engine(num_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, arch=None,
                max_model_len=64):
    config = EngineConfig(
        model=ModelConfig(model="mock", max_model_len=max_model_len),  # mock arch allows 512
        cache=CacheConfig(kv_cache_dtype="fp32", page_size=page_size, num_pages=num_pages),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        device=DeviceConfig("cpu"))
    return Engine(config, model=MockModel(arch))


def run_all(engine):
    finished = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_ragged_batch_counts_up():
    engine = make_engine()
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, **GREEDY))
    b = engine.add_request([10], SamplingParams(max_tokens=3, **GREEDY))
    done = run_all(engine)
    assert done[a].token_ids == [4, 5, 6, 7, 8]
    assert done[b].token_ids == [11, 12, 13]
    assert done[a].finish_reason == "length"
    assert engine.kv_manager.usage == 0.0


def test_chunked_prefill_respects_token_budget():
    engine = make_engine(max_num_batched_tokens=8)
    rid = engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=2, **GREEDY))
    done = run_all(engine)
    assert done[rid].token_ids == [21, 22]
    assert max(engine.model.forward_calls) <= 8
    assert engine.model.forward_calls[:3] == [8, 8, 4]


def test_max_num_seqs_limits_the_batch():
    engine = make_engine(max_num_seqs=2)
    ids = {engine.add_request([i], SamplingParams(max_tokens=4, **GREEDY)): i for i in range(1, 6)}
    done = {}
    while engine.has_unfinished():
        outs = engine.step()
        assert len(outs) <= 2 and engine.scheduler.num_running <= 2
        done.update({o.request_id: o for o in outs if o.finished})
    assert {rid: done[rid].token_ids for rid in ids} == {rid: [i + 1, i + 2, i + 3, i + 4] for rid, i in ids.items()}
    assert engine.kv_manager.usage == 0.0


def test_preemption_by_recompute_gives_same_tokens():
    # 6 pages of 4 tokens: two sequences of 3 + 12 tokens cannot both stay resident.
    engine = make_engine(num_pages=6, page_size=4, max_model_len=24)
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=12, **GREEDY))
    b = engine.add_request([30, 31, 32], SamplingParams(max_tokens=12, **GREEDY))
    done = run_all(engine)
    assert done[a].token_ids == list(range(4, 16))
    assert done[b].token_ids == [(33 + k) % 64 for k in range(12)]
    assert engine.scheduler.num_preemptions >= 1
    assert engine.kv_manager.usage == 0.0


def test_abort_frees_pages_at_once():
    engine = make_engine()
    rid = engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert engine.kv_manager.usage > 0
    assert engine.abort(rid)
    assert engine.kv_manager.usage == 0.0
    assert engine.requests[rid].finish_reason == "abort"
    assert not engine.has_unfinished()
    assert not engine.abort(rid)


def test_stop_token_and_eos():
    engine = make_engine(arch=mock_arch(eos_token_ids=(7,)))
    a = engine.add_request([4], SamplingParams(max_tokens=10, **GREEDY))
    b = engine.add_request([4], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[9], **GREEDY))
    done = run_all(engine)
    assert done[a].token_ids == [5, 6, 7] and done[a].finish_reason == "stop"
    assert done[b].token_ids == [5, 6, 7, 8, 9] and done[b].finish_reason == "stop"


def test_max_model_len_ends_with_length():
    engine = make_engine(max_model_len=6)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=100, **GREEDY))
    done = run_all(engine)
    assert done[rid].token_ids == [4, 5, 6]
    assert done[rid].finish_reason == "length"


def test_bad_requests_are_rejected_and_leave_nothing_behind():
    engine = make_engine(max_model_len=8)
    with pytest.raises(InvalidRequestError, match="8 tokens; max_model_len=8"):
        engine.add_request(list(range(8)), SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request([1, 99999], SamplingParams())
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.add_request("hello", SamplingParams())
    assert not engine.has_unfinished() and engine.requests == {}


def test_nonfinite_logits_end_only_that_request():
    engine = make_engine()
    model = engine.model
    original = model.compute_logits

    def poisoned(hidden):
        logits = original(hidden)
        bad = hidden[:, 0].round().long() == 13
        logits[bad] = float("nan")
        return logits

    model.compute_logits = poisoned
    a = engine.add_request([10], SamplingParams(max_tokens=6, **GREEDY))
    b = engine.add_request([20], SamplingParams(max_tokens=6, **GREEDY))
    done = run_all(engine)
    assert done[a].finish_reason == "error" and done[a].token_ids == [11, 12, 13]
    assert done[b].token_ids == [21, 22, 23, 24, 25, 26]
    assert engine.kv_manager.usage == 0.0


def test_seeded_sampling_reproduces():
    engine = make_engine()
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=123)
    a = engine.add_request([3], params)
    b = engine.add_request([3], params)
    done = run_all(engine)
    assert done[a].token_ids == done[b].token_ids


class NaNKeyModel(MockModel):
    """Writes non-finite keys for every token with id 13 (a request whose activations blew up)."""

    def forward(self, input_ids, positions, kv_cache, meta):
        arch = self.arch
        num_tokens = input_ids.shape[0]
        x = input_ids.to(self.anchor.dtype)
        q = x.view(-1, 1, 1).expand(num_tokens, arch.num_heads, arch.head_dim).contiguous() * 0.01
        k = x.view(-1, 1, 1).expand(num_tokens, arch.num_kv_heads, arch.head_dim).contiguous() * 0.01
        k[input_ids == 13] = float("nan")
        for layer in range(arch.num_layers):
            kv_cache.attention(layer, q, k, k.clone(), meta, 1.0)
        return input_ids.view(-1, 1).to(self.anchor.dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["int3", "fp32"])
def test_nonfinite_keys_end_only_that_request(kv_cache_dtype):
    from dataclasses import replace

    arch = replace(mock_arch(), head_dim=32)
    config = EngineConfig(
        model=ModelConfig(model="mock", max_model_len=64),
        cache=CacheConfig(kv_cache_dtype=kv_cache_dtype, page_size=16, num_pages=32),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), device=DeviceConfig("cpu"))
    engine = Engine(config, model=NaNKeyModel(arch))
    bad = engine.add_request([10], SamplingParams(max_tokens=8, **GREEDY))      # reaches token 13
    good = engine.add_request([20, 21, 22], SamplingParams(max_tokens=20, **GREEDY))
    done = run_all(engine)
    if kv_cache_dtype == "int3":        # the low-bit format checks every write and names the request
        assert done[bad].finish_reason == "error" and "non-finite" in done[bad].error
        assert done[bad].token_ids == [11, 12, 13]
    assert done[good].token_ids == list(range(23, 43))                          # crosses a page boundary
    assert done[good].finish_reason == "length"
    assert engine.kv_manager.usage == 0.0


def test_prompt_tokens_are_counted_once_each():
    # The counter used to read chunk.start after num_computed_tokens had advanced, and counted 0.
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=2, **GREEDY))   # chunks of 8, 8, 4
    engine.add_request([30], SamplingParams(max_tokens=2, **GREEDY))
    run_all(engine)
    assert engine.counters["prompt_tokens"] == 21
    assert engine.counters["generation_tokens"] == 4


class LongTokenTokenizer:
    """Token 5 decodes to a long piece of text that starts with the stop string; others to a letter."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join("AB" + "-" * 30 if i == 5 else chr(ord("a") + i % 26) for i in ids)


def test_stop_string_at_the_start_of_a_long_token_text():
    config = EngineConfig(
        model=ModelConfig(model="mock", max_model_len=64),
        cache=CacheConfig(kv_cache_dtype="fp32", page_size=4, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), device=DeviceConfig("cpu"))
    engine = Engine(config, model=MockModel(), tokenizer=LongTokenTokenizer())
    rid = engine.add_request([2], SamplingParams(max_tokens=10, stop=["AB"], **GREEDY))
    streamed = ""
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.new_text
    request = engine.requests[rid]
    assert request.finish_reason == "stop"
    assert request.output_token_ids == [3, 4, 5]
    assert request.output_text == "de" == streamed


def test_token_ids_slices_prompt_and_output():
    from moekv.core.request import Request
    from moekv.tokenizer import IncrementalDetokenizer

    request = Request("r", [1, 2, 3], SamplingParams(), IncrementalDetokenizer(None), output_token_ids=[4, 5])
    everything = [1, 2, 3, 4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert request.token_ids(start, end) == everything[start:end]


def test_masked_logits_are_not_an_error():
    """-inf in a row is a mask (e.g. padded vocabulary), not a broken model."""
    engine = make_engine()
    original = engine.model.compute_logits

    def masked(hidden):
        logits = original(hidden)
        logits[:, -4:] = float("-inf")
        return logits

    engine.model.compute_logits = masked
    rid = engine.add_request([3], SamplingParams(max_tokens=3, **GREEDY))
    done = run_all(engine)
    assert done[rid].finish_reason == "length" and done[rid].token_ids == [4, 5, 6]

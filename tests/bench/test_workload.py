"""`moekv bench serve`'s workload and numbers: datasets, arrivals, goodput, vLLM's result fields."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from moekv.bench.report import meets_slo, parse_goodput, percentiles, throughput_over_time, vllm_fields
from moekv.bench.serve import BenchConfig, RequestResult
from moekv.bench.workload import (arrival_offsets, length_range, random_requests, sharegpt_conversations,
                                  sharegpt_requests)


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps():
    offsets = arrival_offsets(4000, request_rate=20.0, burstiness=1.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.06)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.08)   # exponential: cv 1
    smooth = arrival_offsets(4000, 20.0, burstiness=16.0, seed=1)
    smooth_gaps = [b - a for a, b in zip(smooth, smooth[1:])]
    assert statistics.pstdev(smooth_gaps) / statistics.mean(smooth_gaps) == pytest.approx(0.25, rel=0.1)
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    with pytest.raises(ValueError, match="request-rate"):
        arrival_offsets(5, 0.0, 1.0, 0)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_random_dataset_lengths_stay_in_range(ratio):
    requests = random_requests(200, input_len=40, output_len=10, range_ratio=ratio, vocab_size=50, seed=0)
    low, high = length_range(40, ratio)
    assert all(low <= len(r.prompt) == r.prompt_len <= high for r in requests)
    assert all(length_range(10, ratio)[0] <= r.output_len <= length_range(10, ratio)[1] for r in requests)
    assert all(1 <= t < 50 for r in requests for t in r.prompt)
    if ratio:
        assert len({r.prompt_len for r in requests}) > 20      # spread over the range
    else:
        assert {r.prompt_len for r in requests} == {40}
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 4, 4, 1.0, 50, 0)


def test_sharegpt_file(tmp_path):
    data = [{"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello you"}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            {"id": "x"},
            {"conversations": [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A two three"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    pairs = sharegpt_conversations(str(path))
    assert sorted(pairs) == [("Hi there", "Hello you"), ("Q2", "A two three")]
    requests = sharegpt_requests(pairs, 5, seed=0, output_len=None, count_tokens=lambda t: len(t.split()))
    assert len(requests) == 5 and {(r.prompt, r.output_len) for r in requests} == {("Hi there", 2), ("Q2", 3)}
    assert {r.output_len for r in sharegpt_requests(pairs, 3, 0, 7, len)} == {7}
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="no conversation"):
        sharegpt_conversations(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="no such file"):
        sharegpt_conversations(str(tmp_path / "missing.json"))


def _result(index, ttft, itl, status="ok"):
    result = RequestResult(index, status=status, ttft=ttft, itl=list(itl), output_tokens=len(itl) + 1,
                           prompt_tokens=10)
    result.e2e = ttft + sum(itl)
    return result


def test_goodput_and_vllm_fields():
    assert parse_goodput(["ttft:100", "tpot:20", "e2e:500"]) == {"ttft": 100.0, "tpot": 20.0, "e2el": 500.0}
    with pytest.raises(ValueError, match="ttft, tpot, e2el"):
        parse_goodput(["latency:5"])
    fast, slow = _result(0, 0.05, [0.01] * 4), _result(1, 0.3, [0.01] * 4)
    failed = RequestResult(2, error="boom")
    assert meets_slo(fast, {"ttft": 100.0}) and not meets_slo(slow, {"ttft": 100.0})
    assert not meets_slo(fast, {"tpot": 5.0}) and meets_slo(fast, {"tpot": 10.5, "e2el": 100.0})
    fields = vllm_fields([fast, slow, failed], duration=2.0, slos={"ttft": 100.0}, extra_percentiles=(95,))
    assert fields["completed"] == 2 and fields["failed"] == 1 and fields["request_throughput"] == 1.0
    assert fields["request_goodput"] == 0.5 and fields["total_output_tokens"] == 10
    assert fields["total_input_tokens"] == 20 and fields["output_throughput"] == 5.0
    assert fields["mean_ttft_ms"] == pytest.approx(175.0) and fields["median_ttft_ms"] == pytest.approx(175.0)
    assert fields["std_ttft_ms"] == pytest.approx(125.0) and fields["p95_ttft_ms"] == pytest.approx(287.5)
    assert fields["mean_tpot_ms"] == pytest.approx(10.0) and fields["p99_itl_ms"] == pytest.approx(10.0)
    assert fields["errors"] == ["", "", "boom"] and fields["input_lens"] == [10, 10, None]
    assert vllm_fields([fast], 1.0, {}, ())["request_goodput"] is None


def test_percentiles_and_throughput_over_time():
    stats = percentiles([1.0, 2.0, 3.0, 4.0], extra=(75, 99.9))
    assert stats["p50"] == 2.5 and stats["p75"] == 3.25 and stats["p99.9"] == pytest.approx(3.997)
    assert stats["std"] == pytest.approx(math.sqrt(1.25))
    result = _result(0, 0.5, [0.25, 0.25, 0.5])        # chunks at 0.5, 0.75, 1.0, 1.5 s
    starts, rates = throughput_over_time([result], 0.5)
    assert starts == [0.0, 0.5, 1.0, 1.5] and rates == [0.0, 4.0, 2.0, 2.0]


def test_bench_config_checks():
    with pytest.raises(ValueError, match="dataset-path"):
        BenchConfig(dataset_name="sharegpt")
    with pytest.raises(ValueError, match="burstiness"):
        BenchConfig(burstiness=0)
    with pytest.raises(ValueError, match="goodput"):
        BenchConfig(goodput=("ttft",))

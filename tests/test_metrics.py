"""ServerMetrics: per-app registries, the values pushed and collected, and the small text parser."""

from __future__ import annotations

import torch

from moekv.bench.serve import percentiles
from moekv.metrics import EngineStats, ServerMetrics, outlier_budget_hits, parse_metrics


def test_two_apps_in_one_process_do_not_clash():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.observe_first_token(0.5, num_prompt_tokens=7)
    assert parse_metrics(a.render().decode())["moekv:prompt_tokens_total"] == 7
    assert parse_metrics(b.render().decode())["moekv:prompt_tokens_total"] == 0


def test_pushed_and_collected_values():
    metrics = ServerMetrics("m")
    metrics.bind(lambda: EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions=4,
                                     kv_bits_per_value=3.5),
                 lambda: torch.tensor([[5, 0], [1, 2]]),
                 lambda: {"key_budget_hit_rate": 0.25, "value_budget_hit_rate": 0.5, "pages_quantized": 2.0,
                          "page_heads_per_page": 8.0})
    metrics.observe_first_token(0.2, num_prompt_tokens=10)
    metrics.observe_tokens(1, None)
    metrics.observe_tokens(2, 0.05)
    metrics.observe_finished(1.5, "stop")
    metrics.observe_finished(0.5, "abort")
    metrics.observe_finished(0.5, "error")
    values = parse_metrics(metrics.render().decode())
    assert values['moekv:num_requests_running{model_name="m"}'] == 3
    assert values["moekv:num_requests_waiting"] == 2 and values["moekv:kv_cache_usage_perc"] == 0.25
    assert values["moekv:num_preemptions_total"] == 4 and values["moekv:kv_cache_bits_per_value"] == 3.5
    assert values["moekv:generation_tokens_total"] == 3 and values["moekv:inter_token_latency_seconds_count"] == 2
    assert values['moekv:request_success_total{finished_reason="stop",model_name="m"}'] == 1
    assert values['moekv:request_success_total{finished_reason="abort",model_name="m"}'] == 1
    assert values["moekv:request_failure_total"] == 1 and values["moekv:e2e_request_latency_seconds_count"] == 3
    assert values['moekv:expert_load{expert="0",layer="0",model_name="m"}'] == 5
    assert values['moekv:expert_load{expert="1",layer="1",model_name="m"}'] == 2
    assert values["moekv:kv_outlier_budget_hits_total"] == 12        # (0.25 + 0.5) x 2 pages x 8 page-heads


def test_outlier_budget_hits_spellings():
    assert outlier_budget_hits({}) == 0
    assert outlier_budget_hits({"outlier_budget_hits": 9}) == 9


def test_percentiles_interpolate():
    stats = percentiles([float(v) for v in range(1, 102)])     # 1..101
    assert (stats["p50"], stats["p90"], stats["p99"], stats["mean"]) == (51.0, 91.0, 100.0, 51.0)
    assert percentiles([])["p50"] is None


def test_routing_metrics_recall_and_expert_cache():
    metrics = ServerMetrics("m")
    routing = {"prediction": {"overall": {1: 0.8, 2: 0.7}, "per_layer": {1: [None, 0.75, 0.85], 2: [None, None, 0.7]}},
               "offload": {"hits": 30, "misses": 6, "prefetches": 9, "wasted_prefetches": 2, "bytes_copied": 1024}}
    metrics.bind(lambda: EngineStats(), routing=lambda: routing)
    values = parse_metrics(metrics.render().decode())
    assert values['moekv:expert_prediction_recall{lookahead="1",model_name="m"}'] == 0.8
    assert values['moekv:expert_prediction_recall{lookahead="2",model_name="m"}'] == 0.7
    assert values['moekv:expert_prediction_recall_per_layer{layer="2",lookahead="1",model_name="m"}'] == 0.85
    assert 'moekv:expert_prediction_recall_per_layer{layer="0",lookahead="1",model_name="m"}' not in values
    assert values["moekv:expert_cache_hits_total"] == 30 and values["moekv:expert_cache_misses_total"] == 6
    assert values["moekv:expert_cache_bytes_copied_total"] == 1024


def test_vllm_prefix_renames_the_shared_series_only():
    from moekv.metrics import RequestTimings

    metrics = ServerMetrics("m", prefix="vllm", max_model_len=1000)
    metrics.bind(lambda: EngineStats(num_running=1, kv_bits_per_value=3.29, kv_full_precision_token_share=0.25))
    metrics.set_cache_info(block_size=128, cache_dtype="int3", num_gpu_blocks=40)
    metrics.observe_tokens(3, 0.02)
    metrics.observe_request(RequestTimings(queue=0.5, prefill=0.25, decode=1.0, inference=1.25,
                                           time_per_output_token=0.1, prompt_tokens=7, generation_tokens=11,
                                           max_tokens=16))
    metrics.observe_request(RequestTimings(queue=None, prefill=None, decode=None, inference=None,
                                           time_per_output_token=None, prompt_tokens=3, generation_tokens=0,
                                           max_tokens=4))
    text = metrics.render().decode()
    values = parse_metrics(text)
    assert values["vllm:num_requests_running"] == 1 and "moekv:num_requests_running" not in values
    assert values["vllm:time_per_output_token_seconds_count"] == 3 == values["vllm:inter_token_latency_seconds_count"]
    assert values["vllm:request_queue_time_seconds_count"] == 1 and values["vllm:request_queue_time_seconds_sum"] == 0.5
    for name, total in (("prefill", 0.25), ("decode", 1.0), ("inference", 1.25)):
        assert values[f"vllm:request_{name}_time_seconds_sum"] == total
    assert values["vllm:request_time_per_output_token_seconds_sum"] == 0.1
    assert values["vllm:request_prompt_tokens_sum"] == 10 and values["vllm:request_prompt_tokens_count"] == 2
    assert values["vllm:request_generation_tokens_sum"] == 11 and values["vllm:request_params_max_tokens_sum"] == 20
    assert values['vllm:request_prompt_tokens_bucket{le="5.0",model_name="m"}'] == 1
    assert 'le="1000.0"' in text and 'le="2000.0"' not in text      # token buckets stop at max_model_len
    assert values['vllm:cache_config_info{block_size="128",cache_dtype="int3",model_name="m",num_gpu_blocks="40"}'] == 1
    assert values["moekv:kv_cache_bits_per_value"] == 3.29 and values["moekv:kv_cache_full_precision_token_share"] == 0.25
    assert values["vllm:gpu_cache_usage_perc"] == values["vllm:kv_cache_usage_perc"] == 0


def test_unknown_prefix_is_an_error():
    import pytest

    with pytest.raises(ValueError, match="prefix"):
        ServerMetrics("m", prefix="sglang")

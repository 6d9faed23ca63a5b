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

"""OffloadConfig: cache-size spellings, validation, kwargs routing, and the engine's routing_stats()."""

from __future__ import annotations

import pytest
import torch

from moekv.config import OffloadConfig, parse_expert_cache_size
from moekv.entrypoints.llm import make_engine_config
from moekv.errors import ConfigError
from moekv.moe.prefetch import resolve_cache_slots


@pytest.mark.parametrize("value, expected", [
    (None, None), (4, ("slots", 4.0)), ("4", ("slots", 4.0)), ("50%", ("share", 0.5)),
    ("12GB", ("bytes", 12e9)), ("1.5 GiB", ("bytes", 1.5 * 2**30)), ("512MB", ("bytes", 512e6)),
])
def test_cache_size_spellings(value, expected):
    assert parse_expert_cache_size(value) == expected


@pytest.mark.parametrize("value", [0, -2, "0%", "150%", "12", "lots", "3TB", True, "GB"])
def test_bad_cache_sizes_are_config_errors(value):
    if value == "12":
        assert parse_expert_cache_size(value) == ("slots", 12.0)
        return
    with pytest.raises(ConfigError, match="expert_cache_size"):
        OffloadConfig(cpu_offload_experts=True, expert_cache_size=value)


def test_resolve_cache_slots():
    expert = 3 * 4096 * 14336 * 2                                    # one Mixtral-8x7B expert in bf16
    assert resolve_cache_slots(None, 8, expert, 32) == 4
    assert resolve_cache_slots("25%", 8, expert, 32) == 2
    assert resolve_cache_slots("75%", 8, expert, 32) == 6
    assert resolve_cache_slots(20, 8, expert, 32) == 8               # capped at the expert count
    assert resolve_cache_slots("1%", 8, expert, 32) == 1
    assert resolve_cache_slots("46GB", 8, expert, 32) == 46_000_000_000 // (32 * expert)
    with pytest.raises(ConfigError, match="less than one expert per MoE layer"):
        resolve_cache_slots("5GB", 8, expert, 32)


@pytest.mark.parametrize("field, value", [("lookahead", 3), ("extra_candidates", -1), ("eviction", "fifo"),
                                          ("load_decay", 0.0)])
def test_offload_config_validation(field, value):
    with pytest.raises(ConfigError, match=field):
        OffloadConfig(**{field: value})


def test_make_engine_config_routes_offload_kwargs():
    config = make_engine_config("m", cpu_offload_experts=True, expert_cache_size="25%", prefetch=False,
                                lookahead=2, extra_candidates=1, eviction="lfu", page_size=8)
    assert config.offload == OffloadConfig(True, "25%", False, 2, 1, "lfu")
    assert config.cache.page_size == 8
    assert make_engine_config("m").offload == OffloadConfig()
    assert not OffloadConfig().predicts and OffloadConfig(cpu_offload_experts=True).predicts
    with pytest.raises(TypeError, match="prefech"):
        make_engine_config("m", prefech=True)


def test_engine_routing_stats_with_a_mock_model():
    from moekv.config import EngineConfig
    from moekv.engine.engine import Engine
    from moekv.sampling import SamplingParams
    from tests.mock_model import MockModel, mock_engine_config

    config = mock_engine_config(max_model_len=32, num_pages=16)
    engine = Engine(config, model=MockModel())
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    stats = engine.routing_stats()
    assert stats["prediction"] is None and stats["offload"] is None
    assert stats["expert_load"]["total"][0][0] == 3 + 2            # prefill 3 tokens, then 2 decode steps
    assert stats["expert_load"]["steps"] == 3
    with pytest.raises(ConfigError, match="routed MoE layers"):
        Engine(EngineConfig(model=config.model, cache=config.cache, device=config.device,
                            offload=OffloadConfig(cpu_offload_experts=True)), model=MockModel())


def test_llm_with_offloading_matches_resident_and_reports_stats(tmp_path):
    from moekv.entrypoints.llm import LLM
    from moekv.sampling import SamplingParams
    from tests.hf_fixtures import make_checkpoint

    folder, _ = make_checkpoint(tmp_path, "mixtral", num_layers=3, num_experts=8, top_k=2)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [[3, 4, 5, 6], [7, 8]]
    kwargs = dict(dtype="fp32", device="cpu", num_pages=32, page_size=4, max_model_len=64)
    resident = LLM(str(folder), **kwargs)
    offloaded = LLM(str(folder), cpu_offload_experts=True, expert_cache_size=2, lookahead=2, **kwargs)
    expected = [o.outputs[0].token_ids for o in resident.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in offloaded.generate(prompts, params)] == expected
    stats = offloaded.engine.routing_stats()
    assert stats["offload"]["slots_per_layer"] == 2 and stats["offload"]["moe_layers"] == 3
    assert set(stats["prediction"]["overall"]) == {1, 2}
    assert 0.0 <= stats["prediction"]["overall"][1] <= 1.0
    assert len(stats["prediction"]["per_layer"][1]) == 3
    assert stats["expert_load"]["hot_experts"] and len(stats["expert_load"]["imbalance"]) == 3
    assert resident.engine.routing_stats()["prediction"] is None
    assert all(p.device.type == "cpu" for p in offloaded.engine.model.parameters())


def test_issue_24_switches_route_and_parse():
    from moekv.cli import build_parser
    from moekv.offload_config import parse_prefetch_threshold

    config = make_engine_config("m", cpu_offload_experts=True, prefetch_threshold="auto", host_format="fp8",
                                staging_slots=3)
    assert (config.offload.prefetch_threshold, config.offload.host_format, config.offload.staging_slots) == \
        ("auto", "fp8", 3)
    assert parse_prefetch_threshold("auto") == "auto" and parse_prefetch_threshold("0.25") == 0.25
    assert parse_prefetch_threshold("none") is None and parse_prefetch_threshold(None) is None
    with pytest.raises(ConfigError, match="--prefetch-threshold"):
        parse_prefetch_threshold("often")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--cpu-offload-experts", "--host-format", "fp8",
                                      "--expert-staging", "device", "--prefetch-threshold", "auto"])
    assert (args.host_format, args.expert_staging, args.prefetch_threshold) == ("fp8", "device", "auto")
    # device staging loads on demand: it runs no predictor unless statistics ask for one
    device = OffloadConfig(cpu_offload_experts=True, staging="device")
    assert not device.prefetches and not device.predicts
    for field, value in (("host_format", "int4"), ("staging", "gpu"), ("staging_slots", 0)):
        with pytest.raises(ConfigError, match=field):
            OffloadConfig(**{field: value})

"""bench_decode's scenarios and per-row switches (benchmarks/decode_scenarios.py): parsing, the combinations run,
the engine config each row gets, and the report's switch columns."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import decode_report, decode_scenarios as ds
from moekv.config import EngineConfig, KernelConfig, ModelConfig


def test_parse_scenarios():
    assert ds.parse_scenarios("1x16384:bf16,int3;64X16384:int3;") == [(1, 16384, "bf16"), (1, 16384, "int3"),
                                                                       (64, 16384, "int3")]
    assert ds.parse_scenarios("") == []


def test_prompts_are_seeded_and_in_range():
    a, b = ds.prompts(2, 5, 40), ds.prompts(2, 5, 40)
    assert a == b and len(a) == 2 and all(len(p) == 5 and all(3 <= t < 40 for t in p) for p in a)
    assert ds.prompts(2, 5, 40, seed=1) != a


def test_switch_values():
    assert ds.switch_values("") == []
    assert ds.switch_values("on") == [True]
    assert ds.switch_values("on, off") == [True, False]
    assert ds.switch_values("off,on") == [False, True]
    for bad in ("maybe", "on,on", "1"):
        with pytest.raises(ValueError, match="on, off or on,off"):
            ds.switch_values(bad)


def test_switch_flags_parse_and_reject_at_the_boundary():
    parser = argparse.ArgumentParser()
    ds.add_switch_flags(parser)
    args = parser.parse_args(["--fusion", "on,off"])
    assert ds.parse_switch_flags(args, parser) == {"fusion": [True, False]}
    assert ds.parse_switch_flags(parser.parse_args([]), parser) == {}
    with pytest.raises(SystemExit):
        ds.parse_switch_flags(parser.parse_args(["--fusion", "sometimes"]), parser)
    args = parser.parse_args(["--attention-combine", "off,on", "--fusion", "on"])     # a hyphenated switch
    assert ds.parse_switch_flags(args, parser) == {"fusion": [True], "attention-combine": [False, True]}
    args = parser.parse_args(["--moe-combine", "on,off", "--attention-combine", "off"])
    assert ds.parse_switch_flags(args, parser) == {"attention-combine": [False], "moe-combine": [True, False]}


def test_switch_settings_are_every_combination_first_switch_outermost():
    assert ds.switch_settings({}) == [{}]
    assert ds.switch_settings({"fusion": [True, False]}) == [{"fusion": True}, {"fusion": False}]
    assert ds.switch_settings({"a": [True, False], "b": [False, True]}) == [
        {"a": True, "b": False}, {"a": True, "b": True}, {"a": False, "b": False}, {"a": False, "b": True}]


def test_apply_switches_sets_the_field_and_keeps_the_rest():
    base = EngineConfig(model=ModelConfig(model="random:mixtral-8x7b"),
                        kernels=KernelConfig(fused_decode_layer=True, backend="reference"))
    off = ds.apply_switches(base, {"fusion": False})
    assert off.kernels.fused_decode_layer is False and off.kernels.backend == "reference"
    assert base.kernels.fused_decode_layer is True                          # a copy, not an edit
    assert ds.apply_switches(base, {}) == base and ds.apply_switches(base, None) == base
    two = ds.apply_switches(base, {"attention-combine": False, "fusion": False})
    assert two.kernels.fused_attention_combine is False and two.kernels.fused_decode_layer is False
    combined = ds.apply_switches(base, {"moe-combine": False})
    assert combined.kernels.fused_moe_combine is False and base.kernels.fused_moe_combine is True


def test_moe_combine_switch_reports_what_dispatch_runs():
    from moekv.ops import dispatch

    switch = next(s for s in ds.SWITCHES if s.name == "moe-combine")
    with dispatch.override(fused_moe_combine=True, fused_decode_layer=True, fused_layer_ops=True):
        assert switch.value_of(None) == "on"
        with dispatch.override(fused_decode_layer=False):       # needs the fused decode layer
            assert switch.value_of(None) == "off"
    with dispatch.override(fused_moe_combine=False):
        assert switch.value_of(None) == "off"


def test_route_fold_row_reports_what_the_layers_run():
    from moekv.ops import dispatch

    switch = next(s for s in ds.SWITCHES if s.name == "route-fold")
    assert ds.apply_switches(EngineConfig(ModelConfig("m")), {"route-fold": False}).kernels.fused_route_fold is False
    with dispatch.override(fused_route_fold=True, fused_decode_layer=True, fused_layer_ops=True, batch_invariant=False):
        assert switch.value_of(None) == "on"
        with dispatch.override(fused_decode_layer=False):
            assert switch.value_of(None) == "off"
    with dispatch.override(fused_route_fold=False):
        assert switch.value_of(None) == "off"


def test_report_columns_follow_the_registered_switches():
    names = [s.name for s in ds.SWITCHES]
    assert names[0] == "fusion" and len(set(names)) == len(names)
    assert decode_report.switch_header() == "".join(f"{n} | " for n in names)
    row = {"fusion": "off"}
    assert decode_report.switch_cells(row).startswith("off | ")
    assert decode_report.switch_cells({}) == "- | " * len(names)
    assert decode_report.switch_suffix(row) == ", fusion off" and decode_report.switch_suffix({}) == ""
    assert decode_report.switch_label(row).startswith("fusion off")


def test_attention_combine_row_reports_what_the_engine_runs():
    from types import SimpleNamespace

    from moekv.config import CacheConfig
    from moekv.ops import dispatch

    switch = next(s for s in ds.SWITCHES if s.name == "attention-combine")
    int3 = SimpleNamespace(config=EngineConfig(ModelConfig("m"), cache=CacheConfig(kv_cache_dtype="int3")))
    bf16 = SimpleNamespace(config=EngineConfig(ModelConfig("m"), cache=CacheConfig(kv_cache_dtype="bf16")))
    assert switch.value_of(int3) == "n/a (low-bit)"
    for on in (True, False):
        with dispatch.override(fused_attention_combine=on):
            assert switch.value_of(bf16) == ("on" if on else "off")


def test_pdl_switch_reports_what_the_launches_do():
    import torch

    from moekv.ops import dispatch

    switch = next(s for s in ds.SWITCHES if s.name == "pdl")
    assert ds.apply_switches(EngineConfig(ModelConfig("m")), {"pdl": True}).kernels.pdl is True
    with dispatch.override(pdl=False):
        assert switch.value_of(None) == "off"
    with dispatch.override(pdl=True):
        hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
        assert (switch.value_of(None) == "on") == hopper
        if not hopper:
            assert switch.value_of(None).startswith("off (needs")

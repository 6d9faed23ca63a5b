"""KernelConfig: defaults, the MOEKV_* overrides (read by moekv.envs), validation, and how ops.dispatch
applies it (installed by the engine, scoped overrides on top); the op table resolves."""

from __future__ import annotations

import pytest

from moekv.config import EngineConfig, KernelConfig, ModelConfig
from moekv.errors import ConfigError
from moekv.ops import choices, dispatch

KERNEL_VARS = ("MOEKV_OPS_BACKEND", "MOEKV_LOWBIT_DECODE", "MOEKV_FUSED_LAYER_OPS", "MOEKV_SKINNY_GEMM",
               "MOEKV_FUSED_DECODE_LAYER", "MOEKV_FUSED_ATTENTION_COMBINE", "MOEKV_FUSED_MOE_COMBINE",
               "MOEKV_FUSED_ROUTE_FOLD")


@pytest.fixture
def clean_env(monkeypatch):
    for name in KERNEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_and_env_overrides(clean_env):
    assert KernelConfig.from_env() == KernelConfig() == KernelConfig("auto", "auto", True, 0)
    clean_env.setenv("MOEKV_OPS_BACKEND", "reference")
    clean_env.setenv("MOEKV_LOWBIT_DECODE", "v4")
    clean_env.setenv("MOEKV_FUSED_LAYER_OPS", "0")
    clean_env.setenv("MOEKV_SKINNY_GEMM", "auto")
    assert KernelConfig.from_env() == KernelConfig("reference", "v4", False, 1)
    assert KernelConfig.from_env(backend="triton").backend == "reference"     # the environment overrides
    assert EngineConfig(ModelConfig("m")).kernels == KernelConfig("reference", "v4", False, 1)
    clean_env.setenv("MOEKV_SKINNY_GEMM", "1")
    assert KernelConfig.from_env().skinny_gemm_rows == 16
    assert KernelConfig().fused_decode_layer and KernelConfig.from_env().fused_decode_layer
    clean_env.setenv("MOEKV_FUSED_DECODE_LAYER", "0")
    assert KernelConfig.from_env().fused_decode_layer is False
    assert KernelConfig().fused_attention_combine is False and KernelConfig.from_env().fused_attention_combine is False
    clean_env.setenv("MOEKV_FUSED_ATTENTION_COMBINE", "on")
    assert KernelConfig.from_env().fused_attention_combine is True
    assert KernelConfig().fused_moe_combine is True and KernelConfig.from_env().fused_moe_combine is True
    clean_env.setenv("MOEKV_FUSED_MOE_COMBINE", "0")
    assert KernelConfig.from_env().fused_moe_combine is False


def test_fused_decode_layer_needs_the_layer_ops():
    with dispatch.override(fused_layer_ops=True, fused_decode_layer=True):
        assert dispatch.fused_decode_layer()
        with dispatch.override(fused_decode_layer=False):
            assert not dispatch.fused_decode_layer()
        with dispatch.override(fused_layer_ops=False):           # MOEKV_FUSED_LAYER_OPS=0: the torch ops only
            assert not dispatch.fused_decode_layer()


@pytest.mark.parametrize("name,value", [("MOEKV_OPS_BACKEND", "cuda"), ("MOEKV_FUSED_LAYER_OPS", "maybe"),
                                        ("MOEKV_SKINNY_GEMM", "yes"), ("MOEKV_FUSED_DECODE_LAYER", "2"),
                                        ("MOEKV_FUSED_ATTENTION_COMBINE", "last"),
                                        ("MOEKV_FUSED_MOE_COMBINE", "sometimes"),
                                        ("MOEKV_FUSED_ROUTE_FOLD", "last")])
def test_bad_env_values_name_the_variable(clean_env, name, value):
    clean_env.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        KernelConfig.from_env()


@pytest.mark.parametrize("fields,match", [(dict(backend="gpu"), "backend"), (dict(fused_layer_ops=1), "fused"),
                                          (dict(skinny_gemm_rows=-1), "skinny"), (dict(lowbit_decode=""), "lowbit"),
                                          (dict(fused_decode_layer="yes"), "fused_decode_layer"),
                                          (dict(fused_attention_combine=1), "fused_attention_combine"),
                                          (dict(fused_moe_combine=1), "fused_moe_combine"),
                                          (dict(fused_route_fold="on"), "fused_route_fold")])
def test_validation(fields, match):
    with pytest.raises(ConfigError, match=match):
        KernelConfig(**fields)


def test_install_and_scoped_overrides():
    before = dispatch.kernel_config()
    try:
        dispatch.install(KernelConfig(lowbit_decode="v4"))
        assert dispatch.kernel_config().lowbit_decode == "v4"
        with dispatch.override(backend="reference") as active:
            assert active is dispatch.kernel_config() and active.backend == "reference"
            dispatch.install(KernelConfig(lowbit_decode="v4"))    # an engine built inside the block
            assert dispatch.kernel_config() == KernelConfig(backend="reference", lowbit_decode="v4")
            with dispatch.override(backend="triton", skinny_gemm_rows=1):
                assert dispatch.get_backend() == "triton" and dispatch.skinny_gemm_max_rows() == 1
            assert dispatch.get_backend() == "reference" and not dispatch.skinny_gemm_enabled()
        assert dispatch.kernel_config() == KernelConfig(lowbit_decode="v4")
    finally:
        dispatch.install(before)
    assert dispatch.kernel_config() == before


def test_engine_installs_its_kernel_config(monkeypatch):
    from moekv.engine.engine import Engine

    installed = []
    monkeypatch.setattr(dispatch, "install", installed.append)
    with pytest.raises(Exception):
        Engine(EngineConfig(ModelConfig("/nonexistent"), kernels=KernelConfig(lowbit_decode="v4")))
    assert installed == [KernelConfig(lowbit_decode="v4")]


def test_every_op_and_decode_kernel_resolves():
    for name, op in dispatch.OPS.items():
        assert callable(getattr(dispatch, name)), name
        for target in (op.reference, op.kernel):
            assert callable(target) or callable(choices.resolve(target)), (name, target)
    for name, target in choices.LOWBIT_DECODE_KERNELS.items():
        if target is not None:
            assert callable(choices.resolve(target)) and hasattr(choices.resolve(target.split(":")[0]), "supports")
    assert dispatch.DEFAULT_LOWBIT_DECODE in dispatch.LOWBIT_DECODE_KERNELS

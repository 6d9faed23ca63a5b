"""Helpers shared by the test folders: the ops backend of one test (the folders' `backend` fixtures), a block
in which reading a tensor back to the host fails the test, and the bundled checkpoint (tests that need it skip
without it)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from moekv.ops import dispatch

BACKENDS = ("reference", "triton")


@contextlib.contextmanager
def ops_backend(name: str, cpu_tensors: bool = False):
    """moekv.ops.dispatch on `name` for the block. "triton" skips without triton, and with `cpu_tensors` (a test
    whose tensors stay on the CPU) also without Triton's interpreter (on a CUDA machine it is not set)."""
    if name == "triton":
        pytest.importorskip("triton")
        if cpu_tensors and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton backend on CPU tensors needs the interpreter (set without CUDA)")
    with dispatch.override(backend=name):
        yield name


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def no_host_reads(monkeypatch, what: str):
    """Inside the block every host read of a tensor (the methods of HOST_READS: .item(), .tolist(), .cpu(),
    .numpy(), bool / int / float of one) and torch.tensor raise AssertionError("<what> read a tensor back to
    the host"): what a CUDA-graph capture or a device-only path must never do."""
    def forbidden(*args, **kwargs):
        raise AssertionError(f"{what} read a tensor back to the host")

    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, forbidden)
        patch.setattr(torch, "tensor", forbidden)
        yield


def bundled_model() -> Path | None:
    """The bundled checkpoint if it is complete (weights, config and tokenizer), else None."""
    from moekv.datasets import bundled_model_dir

    try:
        folder = bundled_model_dir()
    except FileNotFoundError:
        return None
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json")
    if all((folder / name).is_file() for name in needed) and any(folder.glob("*.safetensors")):
        return folder
    return None


needs_bundled_model = pytest.mark.skipif(
    bundled_model() is None, reason="needs the bundled checkpoint (models/tiny-shakespeare-moe), not in this checkout")


def poison_graph_key(cache) -> dict:
    """Wrap the cache's attention so that, once armed (`poison["armed"] = True`), the next graph step's layer-1
    call sees a NaN in the first sequence's new key (disarms itself); returns the switch. A format that offers a
    fused write target (the low-bit decode step's checked write in the rotary kernel) offers none for that
    layer while armed, so the layer hands its key to `attention` (the unfused path, the same check)."""
    original, poison = cache.attention, {"armed": False}
    original_target = cache.fused_write_target

    def poisoned(layer, meta):
        return poison["armed"] and layer == 1 and meta.fixed_num_splits is not None

    def fused_write_target(layer, meta):
        return None if poisoned(layer, meta) else original_target(layer, meta)

    def attention(layer, query, key, value, meta, scale):
        if poisoned(layer, meta):
            key = key.clone()
            key[0, 0, 0] = float("nan")                  # the first sequence's new key, in a graph step
            poison["armed"] = False
        return original(layer, query, key, value, meta, scale)
    cache.fused_write_target = fused_write_target
    cache.attention = attention
    return poison


def check_kernel_switch(monkeypatch, field: str, env: str, default: bool) -> None:
    """A KernelConfig bool switch: its default, a non-bool refused naming the field, the environment variable's
    0 / 1 read by from_env() and any other value refused naming the variable."""
    from moekv.config import KernelConfig
    from moekv.errors import ConfigError

    assert getattr(KernelConfig(), field) is default
    assert getattr(KernelConfig(**{field: not default}), field) is (not default)
    with pytest.raises(ConfigError, match=field):
        KernelConfig(**{field: 1})
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv(env, value)
        assert getattr(KernelConfig.from_env(), field) is expected
    monkeypatch.setenv(env, "sometimes")
    with pytest.raises(ConfigError, match=env):
        KernelConfig.from_env()


"""The dispatch point picks a decode-only low-bit kernel for decode steps and the general kernel
otherwise; every choice agrees with the reference."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moekv.config import KernelConfig
from moekv.ops import dispatch
from moekv.ops.reference.lowbit import paged_attention_lowbit as reference
from moekv.testing.attention_cases import build_case
from tests.ops.helpers import assert_close

SCALE = 0.125


@pytest.fixture
def decode_kernel():
    """decode_kernel(name): KernelConfig.lowbit_decode = name for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda name: stack.enter_context(dispatch.override(lowbit_decode=name))


@pytest.mark.parametrize("name", ["tc", "v4", "auto"])
def test_decode_choice_matches_reference(device, triton_backend, decode_kernel, name):
    decode_kernel(name)
    case = build_case([0, 40, 33], [1, 1, 1], 2, 4, 64, 3, 16, kind="outlier_channels", seed=11, device=device)
    chosen = dispatch.lowbit_decode_kernel(case.key_spec, case.value_spec, 64)
    assert (chosen is None) == (name == "v4")
    assert_close(dispatch.paged_attention_lowbit(*case.args(), SCALE), reference(*case.args(), SCALE), torch.float32)


def test_prefill_uses_the_general_kernel(device, triton_backend, decode_kernel):
    decode_kernel("tc")
    case = build_case([0, 17], [5, 1], 2, 2, 64, 4, 16, seed=12, device=device)
    assert not case.meta.is_decode
    assert_close(dispatch.paged_attention_lowbit(*case.args(), SCALE), reference(*case.args(), SCALE), torch.float32)


def test_unknown_choice_is_rejected():
    with pytest.raises(ValueError, match="low-bit decode kernel"):
        with dispatch.override(lowbit_decode="fast"):
            pass
    with pytest.raises(ValueError, match="low-bit decode kernel"):
        dispatch.install(KernelConfig(lowbit_decode="fast"))
    assert dispatch.kernel_config().lowbit_decode != "fast"


def test_fused_layer_ops_switch_under_auto(monkeypatch):
    monkeypatch.setattr(dispatch, "use_triton", lambda op, tensor, has_triton=True: True)   # as on a GPU
    x = torch.ones(2, 4)
    with dispatch.override(backend="auto", fused_layer_ops=False):
        assert not dispatch._layer_op_triton("rms_norm", x)
    with dispatch.override(backend="auto", fused_layer_ops=True):
        assert dispatch._layer_op_triton("route_topk", x)
    with dispatch.override(backend="reference", fused_layer_ops=True):
        assert not dispatch._layer_op_triton("route_topk", x)

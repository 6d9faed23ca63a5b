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


@pytest.mark.parametrize("name", ["v7", "v4", "auto"])
def test_decode_choice_matches_reference(device, triton_backend, decode_kernel, name):
    decode_kernel(name)
    case = build_case([0, 40, 33], [1, 1, 1], 2, 4, 64, 3, 16, kind="outlier_channels", seed=11, device=device)
    # v7 takes head_dim 128 and 128-token pages only: this format falls back to the general kernel
    assert dispatch.lowbit_decode_kernel(case.key_spec, case.value_spec, case.query, case.staging_keys) is None
    assert_close(dispatch.paged_attention_lowbit(*case.args(), SCALE), reference(*case.args(), SCALE), torch.float32)


@pytest.mark.parametrize("name", ["v7", "v4", "auto"])
def test_decode_choice_by_format_dtype_and_device(decode_kernel, name):
    """v7 is chosen for the engine's format (D = 128, 128-token pages, equal widths) with 16-bit queries on a
    CUDA device of compute capability >= 8.0; everything else takes the general kernel (None)."""
    decode_kernel(name)
    case = build_case([130], [1], 1, 4, 128, 3, 128, dtype=torch.bfloat16, seed=13)
    cuda = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    for device in ("cpu",) + (("cuda",) if cuda else ()):
        query, staging = case.query.to(device), case.staging_keys.to(device)
        chosen = dispatch.lowbit_decode_kernel(case.key_spec, case.value_spec, query, staging)
        want = name != "v4" and device == "cuda"
        assert (chosen is not None) == want, (name, device)
        if want:
            assert chosen.__module__ == "moekv.ops.cuda.lowbit_decode"
            assert dispatch.lowbit_decode_kernel(case.key_spec, case.value_spec, query.float(), staging) is None


def test_prefill_uses_the_general_kernel(device, triton_backend, decode_kernel):
    decode_kernel("v7")
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

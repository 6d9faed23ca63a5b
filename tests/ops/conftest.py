"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else under Triton's CPU
interpreter (TRITON_INTERPRET=1, set by the root tests/conftest.py before triton is imported)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def triton_backend():
    """Force the Triton path of moekv.ops.dispatch for one test."""
    from moekv.ops import dispatch

    with dispatch.override(backend="triton"):
        yield


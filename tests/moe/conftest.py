"""Shared tiny models for the expert prefetch / offload tests, and the ops backend they run on."""

from __future__ import annotations

import pytest
import torch

from moekv.models.loader import build_random_model
from moekv.models.registry import named_arch
from tests.helpers import BACKENDS, ops_backend


def tiny_arch(num_layers: int = 3, num_experts: int = 8, top_k: int = 2):
    return named_arch("mixtral-8x7b", num_layers=num_layers, hidden_size=32, expert_intermediate_size=48,
                      num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=64, num_experts=num_experts, top_k=top_k)


@pytest.fixture
def tiny_model():
    """A 3-layer, 8-expert top-2 Mixtral-shaped model with random fp32 weights on the CPU."""
    def make(seed: int = 0, **arch_overrides):
        return build_random_model(tiny_arch(**arch_overrides), torch.float32, "cpu", seed=seed)
    return make


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each test once on the reference ops and once on the Triton kernels (skipped without triton)."""
    with ops_backend(request.param):
        yield request.param

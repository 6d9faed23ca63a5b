"""moe_experts_reference against a per-(token, slot) loop, and the MoE block's shared expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moekv.ops.reference.moe import moe_experts_reference


def naive_moe(hidden, w_gate_up, w_down, ids, weights):
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        for slot in range(ids.shape[1]):
            expert = ids[token, slot]
            x = hidden[token].double()
            gate_up = w_gate_up[expert].double() @ x
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[token] += weights[token, slot].double() * (w_down[expert].double() @ act)
    return out


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 1), (9, 8, 2), (13, 6, 4), (0, 4, 2)])
def test_matches_naive_loop(num_tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    hidden_size, inter = 24, 10
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) * 0.3
    w_down = torch.randn(num_experts, hidden_size, inter, generator=gen) * 0.3
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, top_k, dtype=torch.long)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    out = moe_experts_reference(hidden, w_gate_up, w_down, ids, weights)
    assert out.shape == (num_tokens, hidden_size) and out.dtype == torch.float32
    assert torch.allclose(out.double(), naive_moe(hidden, w_gate_up, w_down, ids, weights), atol=1e-5)


def test_unused_experts_and_all_tokens_on_one_expert():
    hidden = torch.randn(5, 8)
    w_gate_up, w_down = torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    ids = torch.full((5, 1), 3)
    weights = torch.ones(5, 1)
    out = moe_experts_reference(hidden, w_gate_up, w_down, ids, weights)
    gate_up = hidden @ w_gate_up[3].T
    expected = (F.silu(gate_up[:, :6]) * gate_up[:, 6:]) @ w_down[3].T
    assert torch.allclose(out, expected, atol=1e-5)


def test_bf16_output_dtype_and_accuracy():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 16, generator=gen)
    w_gate_up, w_down = torch.randn(4, 8, 16, generator=gen) * 0.2, torch.randn(4, 16, 4, generator=gen) * 0.2
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(6, 2, generator=gen)
    ref = naive_moe(hidden, w_gate_up, w_down, ids, weights)
    out = moe_experts_reference(hidden.bfloat16(), w_gate_up.bfloat16(), w_down.bfloat16(), ids, weights)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= 0.05 * ref.abs().max()

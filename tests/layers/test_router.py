"""route(): softmax in fp32 over experts, top-k, optional renormalisation; ties."""

from __future__ import annotations

import pytest
import torch

from moekv.layers.router import Router, route


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_softmax_then_topk(top_k, renormalize):
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(top_k))
    weights, ids = route(logits, top_k, renormalize)
    assert weights.shape == ids.shape == (7, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    probs = torch.softmax(logits.double(), dim=-1)
    expected_ids = probs.argsort(dim=-1, descending=True)[:, :top_k]
    assert torch.equal(ids, expected_ids)
    expected = probs.gather(1, expected_ids)
    if renormalize:
        expected = expected / expected.sum(dim=-1, keepdim=True)
        assert torch.allclose(weights.sum(dim=-1), torch.ones(7))
    assert torch.allclose(weights.double(), expected, atol=1e-6)


def test_top1_renormalized_weight_is_one():
    weights, _ = route(torch.randn(5, 6), 1, renormalize=True)
    assert torch.equal(weights, torch.ones(5, 1))


def test_softmax_runs_in_fp32_for_half_logits():
    logits = torch.randn(4, 8).to(torch.bfloat16)
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits.float(), dim=-1)
    assert weights.dtype == torch.float32
    assert torch.equal(weights, probs.gather(1, ids))


def test_ties_pick_distinct_experts_with_the_tied_weight():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0],     # three-way tie for two slots
                           [2.0, 2.0, 2.0, 2.0, 2.0]])    # all equal
    weights, ids = route(logits, 2, renormalize=True)
    for row in range(2):
        assert len(set(ids[row].tolist())) == 2
    assert set(ids[0].tolist()) <= {1, 2, 3}
    assert torch.allclose(weights, torch.full((2, 2), 0.5))
    weights, _ = route(logits, 2, renormalize=False)
    assert torch.allclose(weights[1], torch.full((2,), 0.2))


def test_router_module_uses_gate_weight():
    router = Router(hidden_size=6, num_experts=4, top_k=2, renormalize=False, dtype=torch.float32, device="cpu")
    router.weight.copy_(torch.eye(4, 6) * 5)
    hidden = torch.zeros(1, 6)
    hidden[0, 2] = 1.0                                     # expert 2 gets logit 5, others 0
    weights, ids = router(hidden)
    assert ids[0, 0].item() == 2
    assert weights[0, 0].item() == pytest.approx(torch.softmax(torch.tensor([0., 0., 5., 0.]), 0)[2].item())

"""The expert-parallel exchange's routing step: ops.triton.moe.ep_routing against ops.reference.ep_routing
(interpreter on CPU, compiled on CUDA). Integer lookups and a select: results must be identical."""

from __future__ import annotations

import pytest
import torch

from moekv.ops import dispatch
from moekv.ops.reference.ep_routing import ep_local_routing as reference
from moekv.ops.triton.moe import ep_routing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gathered(rows: int, top_k: int, span: int, generator, hidden_bytes: int = 48):
    """Codes and weights as strided views of packed byte rows, the way the exchange gathers them."""
    codes_off = -(-hidden_bytes // 16) * 16
    weights_off = codes_off + 8 * (top_k + 1)
    width = -(-(weights_off + 4 * top_k) // 16) * 16
    packed = torch.zeros(rows, width, dtype=torch.uint8)
    codes = torch.randint(1, 2 * span + 1, (rows, top_k + 1), generator=generator)
    codes[:, top_k] = 0                                                   # the floor column
    weights = torch.rand(rows, top_k, generator=generator)
    packed[:, codes_off:weights_off] = codes.view(torch.uint8).view(rows, -1)
    packed[:, weights_off:weights_off + 4 * top_k] = weights.view(torch.uint8).view(rows, -1)
    packed = packed.to(DEVICE)
    return packed[:, codes_off:weights_off].view(torch.int64), packed[:, weights_off:weights_off + 4 * top_k].view(torch.float32)


def table_for(span: int, num_local: int, held: float, generator) -> torch.Tensor:
    own = torch.randint(0, max(num_local, 1), (span,), generator=generator)
    own = torch.where(torch.rand(span, generator=generator) < held, own, torch.full_like(own, -1))
    return torch.cat([torch.zeros(1, dtype=torch.int64), own, torch.full((span,), -1)]).to(DEVICE)


@pytest.mark.parametrize("rows,top_k,held", [(1, 2, 0.5), (2, 2, 0.0), (128, 2, 0.5), (128, 1, 1.0),
                                             (37, 3, 0.3), (2048, 2, 0.5), (5000, 2, 0.7)])
def test_kernel_matches_reference(rows, top_k, held):
    gen = torch.Generator().manual_seed(rows * 10 + top_k)
    span = 32
    table = table_for(span, 4, held, gen)
    codes, weights = gathered(rows, top_k, span, gen)
    want_ids, want_w = reference(table, codes, weights, top_k)
    got_ids, got_w = ep_routing.ep_local_routing(table, codes, weights, top_k)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w)
    # every choice held elsewhere: weight exactly 0 on a slot some row of the call uses (or the floor 0)
    elsewhere = table[codes[:, :top_k]] < 0
    assert (got_w[elsewhere] == 0).all()
    assert (got_ids >= 0).all()


def test_dispatch_falls_back_beyond_one_program(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    table = table_for(16, 2, 0.5, gen)
    codes, weights = gathered(64, 2, 16, gen)
    monkeypatch.setattr(ep_routing, "MAX_ELEMENTS", 8)
    with dispatch.override(backend="triton"), pytest.warns(RuntimeWarning, match="no Triton EP routing"):
        ids, w = dispatch.ep_local_routing(table, codes, weights, 2)
    want_ids, want_w = reference(table, codes, weights, 2)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


def test_empty_call():
    table = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    codes = torch.zeros(0, 3, dtype=torch.int64, device=DEVICE)
    ids, w = ep_routing.ep_local_routing(table, codes, torch.zeros(0, 2, device=DEVICE), 2)
    assert ids.shape == (0, 2) and w.shape == (0, 2)

"""The split-K combine kernel vs its torch twin, and the split planner."""

from __future__ import annotations

import torch

from moekv.ops.triton.attention.split_k import combine_splits, combine_splits_torch, plan_splits


def test_combine_matches_torch(device):
    gen = torch.Generator().manual_seed(0)
    partial = torch.randn(3, 4, 5, 64, generator=gen).to(device)
    lse = (torch.randn(3, 4, 5, generator=gen) * 30).to(device)
    lse[0, :, 3:] = float("-inf")                                  # empty splits weigh nothing
    out = combine_splits(partial, lse, torch.empty(3, 4, 64, device=device))
    torch.testing.assert_close(out, combine_splits_torch(partial, lse), rtol=1e-5, atol=1e-6)


def test_plan_splits_covers_context():
    for batch, heads, length in [(1, 8, 16384), (1, 8, 131072), (128, 8, 16384), (4, 2, 1), (2, 8, 100)]:
        splits, per_split = plan_splits(batch, heads, length, 64, torch.device("cpu"))
        assert splits >= 1 and per_split % 64 == 0
        assert splits * per_split >= length > (splits - 1) * per_split or length <= per_split

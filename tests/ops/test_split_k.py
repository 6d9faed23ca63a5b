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


def test_combine_adds_fixes(device):
    """With `fix` [B, Hkv, CHUNKS, HG, D] (the value-outlier pass's partials): head h gets the sum over chunks
    of row h % G of kv head h // G; rows >= G (HG > G) are ignored. 20 chunks: more than one BLOCK_F step."""
    gen = torch.Generator().manual_seed(1)
    batch, kv_heads, group, splits, head_dim = 2, 2, 3, 3, 64
    partial = torch.randn(batch, kv_heads * group, splits, head_dim, generator=gen).to(device)
    lse = (torch.randn(batch, kv_heads * group, splits, generator=gen) * 10).to(device)
    fix = torch.randn(batch, kv_heads, 20, 4, head_dim, generator=gen).to(device)
    fix[:, :, :, 3] = 1e30                                          # the padding row: must never be read
    out = combine_splits(partial, lse, torch.empty(batch, kv_heads * group, head_dim, device=device), fix)
    want = combine_splits_torch(partial, lse) + fix[:, :, :, :group].sum(2).reshape(batch, kv_heads * group, head_dim)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(combine_splits_torch(partial, lse, fix), want, rtol=1e-6, atol=1e-6)

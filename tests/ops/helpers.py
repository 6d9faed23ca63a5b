"""Shared by the kernel tests: tolerance checks and full-precision paged cache states."""

from __future__ import annotations

import torch

from moekv.core.attention_metadata import AttentionMetadata


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Errors relative to the expected magnitudes: the largest error against the largest value and the
    mean error against the mean value (fp32 1e-5 / 1e-5, fp16 2e-3 / 1e-3, bf16 2e-2 / 1e-2)."""
    max_tol, mean_tol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3),
                         torch.bfloat16: (2e-2, 1e-2)}[dtype]
    expected = expected.float()
    actual = actual.float()
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    error = (actual - expected).abs()
    max_scale = expected.abs().max().clamp_min(1e-6)
    mean_scale = expected.abs().mean().clamp_min(1e-6)
    assert error.max() <= max_tol * max_scale, f"max error {error.max():.3e} > {max_tol:.0e} * {max_scale:.3e}"
    assert error.mean() <= mean_tol * mean_scale, f"mean error {error.mean():.3e} > {mean_tol:.0e} * {mean_scale:.3e}"

def build_fp_case(context_lens: list[int], query_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
                  page_size: int, dtype: torch.dtype, device: str, seed: int = 0, value_scale: float = 1.0,
                  key_scale: float = 1.0):
    """Random full-precision pages holding every sequence's context and new tokens, scattered over
    a shuffled page pool. Returns (query [T, Hq, D], key_pages, value_pages, meta)."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [-(-(c + q) // page_size) for c, q in zip(context_lens, query_lens)]
    num_pages = sum(pages_needed) + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, start = [], 0
    for n in pages_needed:
        tables.append(perm[start:start + n])
        start += n
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    key_pages = (torch.randn(shape, generator=gen) * key_scale).to(dtype).to(device)
    value_pages = (torch.randn(shape, generator=gen) * value_scale).to(dtype).to(device)
    query = torch.randn((sum(query_lens), num_kv_heads * group, head_dim), generator=gen).to(dtype).to(device)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, page_size, device)
    return query, key_pages, value_pages, meta

"""Shared by the kernel tests: tolerance checks and full-precision paged cache states."""

from __future__ import annotations

import torch



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

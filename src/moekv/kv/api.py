"""`moekv.kv.quantize`: the low-bit KV page format applied to one tensor, for experiments.

The tensor is cut into pages of `page_size` tokens exactly as the cache does; a last page shorter
than `page_size` is quantized too, as a short page with its own statistics and an outlier budget
scaled to its length (the cache instead keeps a partly filled page in full precision).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.config import CacheConfig
from moekv.core.lowbit_layout import PackedPages, QuantSpec

KINDS = ("key", "value")


@dataclass
class QuantizedKV:
    """A quantized [tokens, kv_heads, head_dim] tensor: full pages plus an optional short last page."""

    spec: QuantSpec                  # the format of the full pages
    pages: PackedPages | None        # [n_full, H, ...]
    tail_spec: QuantSpec | None      # the format of the short last page (page_size = tokens % page_size)
    tail: PackedPages | None         # [1, H, ...]
    shape: tuple[int, int, int]
    dtype: torch.dtype
    num_qualifying: torch.Tensor     # [n_pages, H] int32: values that passed tau, per (page, head)

    @property
    def parts(self) -> list[tuple[QuantSpec, PackedPages]]:
        return [(s, p) for s, p in ((self.spec, self.pages), (self.tail_spec, self.tail)) if p is not None]

    def dequantize(self) -> torch.Tensor:
        """[tokens, kv_heads, head_dim] in the original dtype."""
        from moekv.ops.reference.lowbit import dequantize_pages

        tokens, heads, head_dim = self.shape
        chunks = [dequantize_pages(p, s).transpose(1, 2).reshape(-1, heads, head_dim) for s, p in self.parts]
        if not chunks:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.cat(chunks, dim=0).to(self.dtype)

    @property
    def nbytes(self) -> int:
        """Exact bytes of everything stored: codes, scales, zero points, outliers, their indices and counts."""
        return sum(p.nbytes for _, p in self.parts)

    @property
    def bits_per_value(self) -> float:
        """nbytes * 8 / number of elements (0.0 for an empty tensor)."""
        elements = self.shape[0] * self.shape[1] * self.shape[2]
        return 8.0 * self.nbytes / elements if elements else 0.0

    @property
    def num_outliers(self) -> int:
        return sum(int(p.outlier_count.sum()) for _, p in self.parts)

    @property
    def budget_hits(self) -> int:
        """(page, head) pairs where more values qualified as outliers than the budget holds."""
        capacities = [s.outlier_capacity for s, p in self.parts for _ in range(p.num_pages)]
        if not capacities:
            return 0
        capacity = torch.tensor(capacities, device=self.num_qualifying.device).unsqueeze(1)
        return int((self.num_qualifying > capacity).sum())


def quantize(x: torch.Tensor, kind: str = "key", bits: int = 3, outlier_fraction: float | None = None, *,
             page_size: int | None = None, axis: str | None = None, outlier_tau: float | None = None,
             group_size: int | None = None, clip_steps: int | None = None,
             clip_refine: int | None = None, outlier_select: str | None = None) -> QuantizedKV:
    """Quantize keys or values x [tokens, kv_heads, head_dim] in moekv's low-bit page format.

    kind: "key" (default axis "channel": per-channel statistics over each page) or "value" (axis "token").
    bits: 2, 3 or 4. outlier_fraction: fp16 outlier budget per (page, head) as a share of its values
    (None: the cache default: 0 for channel-axis keys, else 0.25%). page_size: tokens per page (None:
    the cache default, 128). axis: "channel" | "token" overrides the kind's axis. outlier_tau: the
    qualifying threshold in standard deviations (None: 3). group_size: token axis, head_dim values
    per group (None: head_dim). clip_steps: range-search candidates (None: the cache default for the kind,
    CacheConfig.key_clip_steps / value_clip_steps). clip_refine: steps each end of the searched range then
    moves alone (None: the cache default, CacheConfig.key_clip_refine / value_clip_refine; at most clip_steps,
    a larger value is capped). outlier_select: "deviation" (the largest |x - mean| / std beyond outlier_tau) or
    "range" (greedily the values whose removal shrinks their group's squared range the most); None: the cache
    default for the width (CacheConfig.resolved_outlier_select). Non-finite input raises ValueError.
    """
    from moekv.ops.reference.lowbit import quantize_pages

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor shaped [tokens, kv_heads, head_dim], got "
                         f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or Inf; the KV format stores finite values only")
    if bits not in (2, 3, 4):
        raise ValueError(f"bits must be 2, 3 or 4, got {bits!r}")
    axis = axis or (CacheConfig().key_axis if kind == "key" else "token")
    if axis not in ("channel", "token"):
        raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")
    defaults = CacheConfig(kv_cache_dtype=f"int{bits}", key_axis=axis)
    page_size = page_size or defaults.resolved_page_size
    if outlier_fraction is None:
        outlier_fraction = defaults.key_outlier_fraction if kind == "key" else defaults.value_outlier_fraction
    if not 0.0 <= outlier_fraction <= 0.5:
        raise ValueError(f"outlier_fraction must be in [0, 0.5], got {outlier_fraction!r}")
    if clip_steps is None:
        clip_steps = defaults.key_clip_steps if kind == "key" else defaults.value_clip_steps
    if clip_refine is None:
        clip_refine = defaults.key_clip_refine if kind == "key" else defaults.value_clip_refine
    if not isinstance(clip_refine, int) or clip_refine < 0:
        raise ValueError(f"clip_refine must be a non-negative integer, got {clip_refine!r}")
    if outlier_select is None:
        outlier_select = defaults.resolved_outlier_select
    tokens, heads, head_dim = x.shape
    spec = QuantSpec(outlier_select=outlier_select, clip_steps=clip_steps,
                     clip_refine=min(clip_refine, clip_steps) if isinstance(clip_steps, int) else 0, bits=bits, axis=axis, head_dim=head_dim, page_size=page_size, group_size=group_size,
                     outlier_capacity=QuantSpec.capacity_for(outlier_fraction, page_size, head_dim),
                     outlier_tau=outlier_tau if outlier_tau is not None else defaults.outlier_tau)
    num_full, rest = divmod(tokens, page_size)
    pages = tail = tail_spec = None
    qualifying = []
    if num_full:
        full = x[:num_full * page_size].unflatten(0, (num_full, page_size)).transpose(1, 2)   # [n, H, P, D]
        pages, counts = quantize_pages(full, spec)
        qualifying.append(counts)
    if rest:
        tail_spec = spec.with_page_size(rest, outlier_fraction)
        tail, counts = quantize_pages(x[num_full * page_size:].unsqueeze(0).transpose(1, 2), tail_spec)
        qualifying.append(counts)
    num_qualifying = torch.cat(qualifying) if qualifying else torch.zeros(0, heads, dtype=torch.int32)
    return QuantizedKV(spec=spec, pages=pages, tail_spec=tail_spec, tail=tail, shape=(tokens, heads, head_dim),
                       dtype=x.dtype, num_qualifying=num_qualifying)

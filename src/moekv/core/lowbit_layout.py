"""The low-bit page layout: how one of keys/values is quantized (`QuantSpec`) and the dense tensors
that hold a batch of quantized pages (`PackedPages`). Byte layout: docs/kv-format.md.

Two quantization axes:

- "channel" (keys, KIVI/KVQuant style): scale and zero point per (page, head, channel), statistics
  over the page's P tokens; fp16 scale and fp16 zero. A kernel folds the scales into the query:
  q . k_t = sum_d (q_d * S_d) * code_td + sum_d q_d * Z_d.
- "token" (values; keys in the per-token mode): scale and zero point per (token, head, group of
  head_dim), statistics over the group. Stored compactly as two uint8 codes per group plus one fp16
  `scale_base` per (page, head):  S = scale_base * 2 ** (-scale_code / 16),
  Z = -S * zero_code / 2 ** (8 - bits). The group's range is widened to include 0, so Z <= 0 <= Z + L*S.
  A kernel folds S into the probabilities: sum_t p_t v_t = sum_t (p_t S_t) code_t + sum_t p_t Z_t.

Outliers: per (page, head) a fixed budget of `outlier_capacity` slots holding an fp16 *residual*
over the dequantized code and an int16 index token_in_page * head_dim + channel (read as unsigned
16-bit). Unused slots hold residual 0 at index 0, so a kernel may add all slots unconditionally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from moekv.core import lowbit_order
from moekv.core.lowbit_pack import SUPPORTED_BITS, words_per_row

AXES = ("channel", "token")
OUTLIER_SELECTS = ("deviation", "range")  # how the budgeted outliers are chosen (docs/kv-format.md §4)
SCALE_CODE_STEPS = 16          # token axis: scale codes step by 2 ** (1/16) (4.4%) below scale_base
MAX_OUTLIER_INDEX = 1 << 16    # indices are 16-bit: page_size * head_dim must not exceed this
MAX_OUTLIER_COUNT = (1 << 15) - 1   # outlier_count is int16: slots per (page, head) must fit
CLIP_STEP = 1.0 / 16           # range search: candidate k shrinks a group's range by k/16 (exact in fp32)
MAX_CLIP_STEPS = 8             # at most down to half the min/max range


@dataclass(frozen=True)
class QuantSpec:
    """How keys or values of one page (per kv head) are quantized. Validated; derived values are properties."""

    bits: int                    # code width: 2, 3 or 4
    axis: str                    # "channel": stats per channel over the page's tokens; "token": per token group
    head_dim: int
    page_size: int               # tokens per page (P)
    group_size: int | None = None   # token axis: head_dim values per group (None: head_dim); unused for channel
    outlier_capacity: int = 0    # fp16 outlier slots per (page, head)
    outlier_tau: float = 3.0     # a value qualifies when |x - mean| > tau * std of its group
    clip_steps: int = 0          # range search: candidates k = 0..clip_steps shrink each group's inlier range
                                 # [lo, hi] by k/16 about its centre; the one of least squared error wins
    clip_refine: int = 0         # range search, then each end of the best range alone moved by -R..R steps
    outlier_select: str = "deviation"   # "deviation": the largest |x - mean| / std beyond tau; "range": greedily
                                 # the values whose removal shrinks their group's squared range the most

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits!r}")
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        if self.head_dim < 1 or self.page_size < 1:
            raise ValueError(f"head_dim and page_size must be positive, got {self.head_dim}, {self.page_size}")
        if self.group_size is None:
            object.__setattr__(self, "group_size", self.head_dim)
        if self.group_size < 1 or self.head_dim % self.group_size:
            raise ValueError(f"group_size {self.group_size} must divide head_dim {self.head_dim}")
        if self.page_size * self.head_dim > MAX_OUTLIER_INDEX:
            raise ValueError(f"page_size * head_dim = {self.page_size * self.head_dim} exceeds the 16-bit "
                             f"outlier index ({MAX_OUTLIER_INDEX}); use smaller pages")
        if not 0 <= self.outlier_capacity <= min(self.page_size * self.head_dim, MAX_OUTLIER_COUNT):
            raise ValueError(f"outlier_capacity must be in [0, min(page_size * head_dim, {MAX_OUTLIER_COUNT})] "
                             f"(the count is 16-bit), got {self.outlier_capacity}")
        if self.outlier_tau <= 0:
            raise ValueError(f"outlier_tau must be positive, got {self.outlier_tau}")
        if not isinstance(self.clip_steps, int) or not 0 <= self.clip_steps <= MAX_CLIP_STEPS:
            raise ValueError(f"clip_steps must be an integer in [0, {MAX_CLIP_STEPS}], got {self.clip_steps!r}")
        if self.outlier_select not in OUTLIER_SELECTS:
            raise ValueError(f"outlier_select must be one of {OUTLIER_SELECTS}, got {self.outlier_select!r}")
        if not isinstance(self.clip_refine, int) or not 0 <= self.clip_refine <= self.clip_steps:
            raise ValueError(f"clip_refine must be an integer in [0, clip_steps = {self.clip_steps}], "
                             f"got {self.clip_refine!r}")

    @staticmethod
    def capacity_for(fraction: float, page_size: int, head_dim: int) -> int:
        """Outlier slots per (page, head) for a share of the page's values (rounded up)."""
        return math.ceil(fraction * page_size * head_dim - 1e-9) if fraction > 0 else 0

    def with_page_size(self, page_size: int, outlier_fraction: float | None = None) -> "QuantSpec":
        """The same format for pages of another size (e.g. a short last page), capacity rescaled."""
        if outlier_fraction is None:
            outlier_fraction = self.outlier_capacity / (self.page_size * self.head_dim)
        return replace(self, page_size=page_size,
                       outlier_capacity=self.capacity_for(outlier_fraction, page_size, self.head_dim))

    @property
    def levels(self) -> int:
        """Largest code, L = 2**bits - 1."""
        return (1 << self.bits) - 1

    @property
    def zero_fraction_bits(self) -> int:
        """Token axis: zero codes count in steps of S / 2**(8 - bits), so L * 2**(8 - bits) <= 255."""
        return 8 - self.bits

    @property
    def num_groups(self) -> int:
        """Token axis: groups per token row."""
        return self.head_dim // self.group_size

    @property
    def words_per_row(self) -> int:
        return words_per_row(self.bits, self.head_dim)

    @property
    def code_order(self) -> str | None:
        """How a page-head's packed rows are stored: "key" / "value" fragment order (core.lowbit_order: int3,
        head_dim 128, pages of a multiple of 32 tokens; by the axis), or None: rows in token order."""
        if not lowbit_order.applies(self.bits, self.page_size, self.head_dim):
            return None
        return lowbit_order.kind_of(self.axis)


LAYER_ALIGN = 16   # bytes: each layer's pages of stacked PackedPages start aligned (the v7 kernel's 16-byte copies)


def stacked_zeros(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros [L, *shape] whose layers are dense and LAYER_ALIGN-byte aligned: the layer stride is numel(shape)
    rounded up to a multiple of LAYER_ALIGN bytes (an allocation starts aligned)."""
    element = torch.empty((), dtype=dtype).element_size()
    per_layer = math.prod(shape)
    step = max(LAYER_ALIGN // element, 1)
    stride = -(-per_layer // step) * step
    flat = torch.zeros(num_layers * stride, dtype=dtype, device=device)
    inner = torch.empty(shape, dtype=dtype, device="meta").stride()
    return flat.as_strided((num_layers, *shape), (stride, *inner))


@dataclass
class PackedPages:
    """Quantized pages, all tensors indexed [N, Hkv, ...] (N pages of one layer, one of keys/values).

    channel axis: scale, zero [N, H, D] fp16; scale_base None.
    token axis:   scale, zero [N, H, P, G] uint8 codes; scale_base [N, H] fp16.
    """

    codes: torch.Tensor           # [N, H, P, W] int32: packed rows (lowbit_pack)
    scale: torch.Tensor
    zero: torch.Tensor
    scale_base: torch.Tensor | None
    outlier_vals: torch.Tensor    # [N, H, C] fp16: residual over the dequantized code (0 in unused slots)
    outlier_idx: torch.Tensor     # [N, H, C] int16: token_in_page * D + channel, as unsigned 16-bit
    outlier_count: torch.Tensor   # [N, H] int16: slots in use (the first `count`, ascending index)

    @staticmethod
    def empty(spec: QuantSpec, num_pages: int, num_kv_heads: int, device,
              num_layers: int | None = None) -> "PackedPages":
        """Zero-filled storage for `num_pages` pages (zeros decode to finite values). With `num_layers`: the
        pages of that many layers in one allocation per tensor, every tensor [L, N, H, ...]: layer l's pages
        are dense (`layer(l)`, a view) and start LAYER_ALIGN-byte aligned (the layer stride, `t.stride(0)`, is
        rounded up where N * page bytes is not a multiple of it: at most LAYER_ALIGN - 1 bytes a layer)."""
        n, h, p, c = num_pages, num_kv_heads, spec.page_size, spec.outlier_capacity

        def zeros(*shape, dtype):
            if num_layers is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            return stacked_zeros(num_layers, shape, dtype, device)

        if spec.axis == "channel":
            scale, zero = zeros(n, h, spec.head_dim, dtype=torch.float16), zeros(n, h, spec.head_dim,
                                                                                  dtype=torch.float16)
            scale_base = None
        else:
            scale = zeros(n, h, p, spec.num_groups, dtype=torch.uint8)
            zero = zeros(n, h, p, spec.num_groups, dtype=torch.uint8)
            scale_base = zeros(n, h, dtype=torch.float16)
        return PackedPages(codes=zeros(n, h, p, spec.words_per_row, dtype=torch.int32), scale=scale, zero=zero,
                           scale_base=scale_base, outlier_vals=zeros(n, h, c, dtype=torch.float16),
                           outlier_idx=zeros(n, h, c, dtype=torch.int16),
                           outlier_count=zeros(n, h, dtype=torch.int16))

    def layer(self, index: int) -> "PackedPages":
        """Of stacked pages (`empty(..., num_layers=L)`): layer `index`'s pages, as views (dense, [N, H, ...],
        LAYER_ALIGN-byte aligned)."""
        return PackedPages(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                              for f in fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by field name (None fields left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def num_pages(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        """Exact bytes of the stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def select(self, pages: torch.Tensor) -> "PackedPages":
        """The pages at `pages` [n] (int64), as a new PackedPages of n pages."""
        return PackedPages(**{f.name: None if getattr(self, f.name) is None
                              else getattr(self, f.name).index_select(0, pages) for f in fields(self)})

    def store(self, pages: torch.Tensor, packed: "PackedPages") -> None:
        """Write `packed` (n pages) into the pages at `pages` [n] (int64), in place."""
        theirs = packed.tensors()
        for name, mine in self.tensors().items():
            mine.index_copy_(0, pages, theirs[name])

"""The knobs of the transformers low-bit cache, validated once (no torch, no transformers import)."""

from __future__ import annotations

from dataclasses import dataclass

from moekv.config import OUTLIER_SELECTS, default_outlier_select

SUPPORTED_BITS = (2, 3, 4)
DEFAULT_VALUE_GROUP = 32       # channels per value scale/zero when it divides head_dim


@dataclass(frozen=True)
class LowBitCacheSettings:
    """How `LowBitCache` stores each attention layer's keys and values.

    bits: code width of the quantized pages (2, 3 or 4).
    residual_length: capacity of the full-precision window of newest tokens. When the window holds
        `window = max(residual_length, page_size)` tokens, all its full pages are quantized and fewer than
        page_size stay (with the defaults it holds 0 to 127 tokens, exactly like transformers' QuantizedCache
        with residual_length=128, which quantizes its whole window when it fills).
    page_size: tokens per quantized page (keys: scale and zero point per channel over a page).
    value_group_size: values are quantized per token in groups of this many channels; None: 32 when it
        divides head_dim, else head_dim.
    outlier_fraction: fp16 outlier slots per (page, kv head) as a share of its values, for keys and (unless
        value_outlier_fraction is given) values. The slots are stored whether used or not.
    outlier_tau: a value may take a slot beyond tau standard deviations of its group; the largest deviations
        win. 2.0 lets the budget fill on typical models (at 3.0 only ~0.2% of values qualify).
    key_clip_steps, value_clip_steps: range search of each group's scale and zero point (moekv.config.CacheConfig,
        docs/kv-format.md section 3): same stored bits, less error; keys default 0 (min/max wins on attention);
        values None: 0 (min/max) at int4, 8 at int3 / int2 (the search costs int4 KL: docs/kv-fidelity.md).
    outlier_select: how the outlier slots are filled, "deviation" (the largest deviations beyond outlier_tau) or
        "range" (greedily the values whose removal shrinks their group's squared range the most); None: "range" at
        int4, "deviation" at int3 / int2 (docs/kv-fidelity.md, issue 23).
    key_clip_refine, value_clip_refine: then each end of the searched range moves alone by up to this many
        steps (capped at the clip steps); values default 2.
    dequantized_copy: keep a dequantized copy of the quantized part so each step only dequantizes new pages
        (fast, but as much memory as a full-precision cache); False: dequantize every page at every step.

    The defaults (value groups of 32, 0.35% outliers, tau 2) were chosen on held-out windows of the bundled
    model's validation text (docs/transformers-cache.md); with 64-dim heads they cost bits + 0.49 bits per
    value, under the 0.5 of 16-bit scale + zero per 64 values that transformers' quanto and HQQ caches pay.
    """

    bits: int = 3
    residual_length: int = 128
    page_size: int = 128
    outlier_fraction: float = 0.0035
    value_outlier_fraction: float | None = None
    outlier_tau: float = 2.0
    value_group_size: int | None = None
    dequantized_copy: bool = True
    key_clip_steps: int = 0
    value_clip_steps: int | None = None
    key_clip_refine: int = 0
    value_clip_refine: int = 2
    outlier_select: str | None = None

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits!r}")
        if not isinstance(self.residual_length, int) or self.residual_length < 0:
            raise ValueError(f"residual_length must be an integer >= 0, got {self.residual_length!r}")
        if not isinstance(self.page_size, int) or not 1 <= self.page_size <= 4096:
            raise ValueError(f"page_size must be an integer in [1, 4096], got {self.page_size!r}")
        if not 0.0 <= self.outlier_fraction <= 0.5:
            raise ValueError(f"outlier_fraction must be in [0, 0.5], got {self.outlier_fraction!r}")
        if self.value_outlier_fraction is not None and not 0.0 <= self.value_outlier_fraction <= 0.5:
            raise ValueError(f"value_outlier_fraction must be in [0, 0.5] or None, got {self.value_outlier_fraction!r}")
        if self.value_group_size is not None and (not isinstance(self.value_group_size, int)
                                                  or self.value_group_size < 1):
            raise ValueError(f"value_group_size must be a positive integer or None, got {self.value_group_size!r}")
        for name in ("key_clip_steps", "value_clip_steps", "key_clip_refine", "value_clip_refine"):
            if name == "value_clip_steps" and self.value_clip_steps is None:
                continue
            if not isinstance(getattr(self, name), int) or not 0 <= getattr(self, name) <= 8:
                raise ValueError(f"{name} must be an integer in [0, 8], got {getattr(self, name)!r}")
        if self.outlier_select is not None and self.outlier_select not in OUTLIER_SELECTS:
            raise ValueError(f"outlier_select must be one of {OUTLIER_SELECTS} or None, got {self.outlier_select!r}")
        if not self.outlier_tau > 0:
            raise ValueError(f"outlier_tau must be positive, got {self.outlier_tau!r}")

    @property
    def window(self) -> int:
        """The full-precision window is flushed into pages when it reaches this many tokens."""
        return max(self.residual_length, self.page_size)

    @property
    def resolved_value_clip_steps(self) -> int:
        """value_clip_steps, or the width's default: 0 (min/max) at int4, 8 at int3 / int2."""
        if self.value_clip_steps is not None:
            return self.value_clip_steps
        return 0 if self.bits == 4 else 8

    @property
    def resolved_outlier_select(self) -> str:
        """outlier_select, or the width's default: "range" at int4, "deviation" at int3 / int2."""
        return self.outlier_select if self.outlier_select is not None else default_outlier_select(self.bits)

    @property
    def resolved_value_outlier_fraction(self) -> float:
        return self.outlier_fraction if self.value_outlier_fraction is None else self.value_outlier_fraction

    def resolved_value_group_size(self, head_dim: int) -> int:
        if self.value_group_size is not None:
            if head_dim % self.value_group_size:
                raise ValueError(f"value_group_size {self.value_group_size} must divide head_dim {head_dim}")
            return self.value_group_size
        return DEFAULT_VALUE_GROUP if head_dim % DEFAULT_VALUE_GROUP == 0 else head_dim

    def expected_lowbit_bits_per_value(self, head_dim: int) -> float:
        """Bits per key/value scalar of full pages (docs/kv-format.md, section 8), averaged over keys and values:
        codes (padded words included); keys: fp16 scale + zero per channel and page; values: two uint8 codes per
        group plus an fp16 scale_base per page; outliers: 32 bits per slot (fp16 residual + 16-bit index) + a
        16-bit count. Counted by moekv.kvcache.accounting (imports torch)."""
        from moekv.kvcache.accounting import format_bits_per_value
        from moekv.core.lowbit_layout import QuantSpec

        key_spec = QuantSpec(bits=self.bits, axis="channel", head_dim=head_dim, page_size=self.page_size,
                             outlier_capacity=QuantSpec.capacity_for(self.outlier_fraction, self.page_size, head_dim))
        value_spec = QuantSpec(bits=self.bits, axis="token", head_dim=head_dim, page_size=self.page_size,
                               group_size=self.resolved_value_group_size(head_dim),
                               outlier_capacity=QuantSpec.capacity_for(self.resolved_value_outlier_fraction,
                                                                       self.page_size, head_dim))
        return format_bits_per_value(key_spec, value_spec)

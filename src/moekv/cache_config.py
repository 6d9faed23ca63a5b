"""The KV cache's configuration (CacheConfig: format, pages, the low-bit format's knobs, staging) and the
KV-cache dtype spellings; re-exported by config.py."""

from __future__ import annotations

from dataclasses import dataclass

from moekv.errors import ConfigError

# Spellings a user may give for a KV cache dtype -> canonical name.
KV_CACHE_DTYPES = {
    "auto": "auto",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "int4": "int4", "int3": "int3", "int2": "int2",
}
LOW_BIT_KV_DTYPES = ("int4", "int3", "int2")
# low-bit outlier choice (docs/kv-format.md §4): core.lowbit_layout.OUTLIER_SELECTS, spelled here because config
# and core share a layer (neither imports the other); tests/test_config.py checks the two agree
OUTLIER_SELECTS = ("deviation", "range")


def default_outlier_select(bits: int) -> str:
    """The outlier choice a code width gets by default: "range" at int4, "deviation" at int3 / int2 (measured:
    docs/kv-fidelity.md, issue 23)."""
    return "range" if bits == 4 else "deviation"


KEY_AXIS_MODES = ("channel", "token")  # "channel": per-channel keys (KIVI); "token": the brief's per-token scheme


def canonical_kv_cache_dtype(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in KV_CACHE_DTYPES:
        accepted = ", ".join(sorted({v for v in KV_CACHE_DTYPES.values()}))
        raise ConfigError(f"unknown kv_cache_dtype {name!r}; accepted: {accepted}")
    return KV_CACHE_DTYPES[name.lower()]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: format, page size and capacity, and the low-bit format's knobs."""

    kv_cache_dtype: str = "auto"        # auto (= model dtype), bf16, fp16, fp32, int4, int3, int2
    page_size: int | None = None        # tokens per page; None: 16 for full precision, 128 for low-bit
    num_pages: int | None = None        # None: sized from memory_fraction (CUDA) or cpu_cache_bytes (CPU)
    memory_fraction: float = 0.90       # CUDA: share of total device memory the engine may use (weights + KV)
    cpu_cache_bytes: int = 1 << 30      # CPU: bytes given to KV pages when num_pages is None
    # Low-bit formats only:
    key_axis: str = "channel"           # "channel": per-channel key statistics over a page; "token": per token
    # Outlier capacity: fp16 slots per (page, head) as a share of its values (measured: docs/kv-fidelity.md).
    outlier_fraction: float | None = None   # keys; None: 0 with key_axis "channel" (per-channel ranges absorb
                                            # key outliers: no measured gain), value_outlier_fraction with "token"
    value_outlier_fraction: float = 0.0025  # values: 21 slots of a 128 x 64 page; int3 = 3.29 bits/value
    outlier_tau: float = 3.0            # a value qualifies as an outlier beyond tau * sigma of its group
    # How the budgeted outliers are chosen (docs/kv-format.md §4): "deviation" = the largest |x - mean| / std
    # beyond tau; "range" = greedily the values whose removal shrinks their group's squared range the most
    # (tau unused). None: "range" at int4, "deviation" at int3 / int2 (measured: docs/kv-fidelity.md, issue 23:
    # int4 KL -11 % with it, int3 / int2 not better).
    outlier_select: str | None = None
    # Range search (docs/kv-format.md §3): candidates k = 0..N shrink each group's min/max range by k/16; the
    # one of least squared error wins. Same stored layout and dequantization; 0 = plain min/max. Measured
    # (docs/kv-fidelity.md): values gain at every width; keys lose on attention (clipped extremes carry the
    # large scores), so keys keep min/max.
    key_clip_steps: int = 0
    value_clip_steps: int = 8
    # Then each end of the best range moves alone by up to N steps (an asymmetric range; capped at the
    # clip steps). Measured (docs/kv-fidelity.md): values -3 to -4 % error at the same stored layout.
    key_clip_refine: int = 0
    value_clip_refine: int = 2
    fp_sink_pages: int = 0              # keep the first N pages of each sequence in full precision
    token_group_size: int | None = None  # per-token quantization: head_dim values per group (None: head_dim)
    staging_pages: int | None = None    # full-precision staging pages (one per running sequence's partly
                                        # filled page, plus sink pages); None: max_num_seqs * (2 +
                                        # fp_sink_pages) + 1 (the CUDA-graph padding rows' scratch
                                        # page), at most num_pages (engine)
    # Staging held in blocks of this many tokens (a power of two dividing the page; None: the page size; the v7 CUDA
    # decode kernel takes blocks of 32, 64 or 128 rows):
    # a partly filled page holds ceil(rows / block) blocks instead of a whole staging page (docs/kv-format.md §5).
    staging_block_size: int | None = None
    # The partly filled last page takes its low-bit storage only when it fills (until then it is a staging-only
    # page id beyond the pool's pages, kvcache/manager.py): all-in bits at 16k int3 3.365 -> 3.29 with blocks of 32.
    lazy_partial_page: bool = False
    enable_prefix_caching: bool = True  # reuse full pages across requests by their token prefix (every dtype)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", canonical_kv_cache_dtype(self.kv_cache_dtype))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.page_size is not None and (not isinstance(self.page_size, int) or not 1 <= self.page_size <= 4096):
            raise ConfigError(f"page_size must be an integer in [1, 4096], got {self.page_size!r}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 1):
            raise ConfigError(f"num_pages must be a positive integer, got {self.num_pages!r}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.key_axis not in KEY_AXIS_MODES:
            raise ConfigError(f"key_axis must be one of {KEY_AXIS_MODES}, got {self.key_axis!r}")
        if self.outlier_fraction is not None and not 0.0 <= self.outlier_fraction <= 0.5:
            raise ConfigError(f"outlier_fraction must be in [0, 0.5] or None, got {self.outlier_fraction!r}")
        if self.outlier_tau <= 0:
            raise ConfigError(f"outlier_tau must be positive, got {self.outlier_tau!r}")
        for name in ("key_clip_steps", "value_clip_steps", "key_clip_refine", "value_clip_refine"):
            steps = getattr(self, name)
            if not isinstance(steps, int) or not 0 <= steps <= 8:
                raise ConfigError(f"{name} must be an integer in [0, 8], got {steps!r}")
        if self.outlier_select is not None and self.outlier_select not in OUTLIER_SELECTS:
            raise ConfigError(f"outlier_select must be one of {OUTLIER_SELECTS} or None, got {self.outlier_select!r}")
        if self.fp_sink_pages < 0:
            raise ConfigError(f"fp_sink_pages must be >= 0, got {self.fp_sink_pages!r}")
        if not 0.0 <= self.value_outlier_fraction <= 0.5:
            raise ConfigError(f"value_outlier_fraction must be in [0, 0.5], got {self.value_outlier_fraction!r}")
        if self.token_group_size is not None and (not isinstance(self.token_group_size, int)
                                                  or self.token_group_size < 1):
            raise ConfigError(f"token_group_size must be a positive integer or None, got {self.token_group_size!r}")
        if self.staging_pages is not None and (not isinstance(self.staging_pages, int) or self.staging_pages < 1):
            raise ConfigError(f"staging_pages must be a positive integer or None, got {self.staging_pages!r}")
        block = self.staging_block_size
        if block is not None and (not isinstance(block, int) or block < 1 or block & (block - 1)
                                  or self.resolved_page_size % block):
            raise ConfigError(f"staging_block_size must be a power of two dividing the page size "
                              f"({self.resolved_page_size}), or None, got {block!r}")
        if not isinstance(self.lazy_partial_page, bool):
            raise ConfigError(f"lazy_partial_page must be True or False, got {self.lazy_partial_page!r}")

    @property
    def is_low_bit(self) -> bool:
        return self.kv_cache_dtype in LOW_BIT_KV_DTYPES

    @property
    def bits(self) -> int | None:
        return int(self.kv_cache_dtype[3:]) if self.is_low_bit else None

    @property
    def key_outlier_fraction(self) -> float:
        """outlier_fraction, or its default for the key axis."""
        if self.outlier_fraction is not None:
            return self.outlier_fraction
        return 0.0 if self.key_axis == "channel" else self.value_outlier_fraction

    @property
    def resolved_outlier_select(self) -> str:
        """outlier_select, or its default for the width: "range" at int4, else "deviation"."""
        return self.outlier_select if self.outlier_select is not None else default_outlier_select(self.bits)

    @property
    def resolved_page_size(self) -> int:
        if self.page_size is not None:
            return self.page_size
        return 128 if self.is_low_bit else 16

    @property
    def resolved_staging_block(self) -> int:
        """Tokens per staging block (low-bit formats): staging_block_size, or the whole page."""
        return self.staging_block_size if self.staging_block_size is not None else self.resolved_page_size

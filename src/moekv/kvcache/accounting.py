"""Exact bit accounting of the low-bit KV format: every stored byte, by what it is for.

Counts follow the tensors of `PackedPages` one to one (a test checks the two agree), so a bits-per-value
number always means device bytes * 8 / stored key and value elements. A "value" here is one element
of a key or value vector; numbers are averaged over keys and values.
"""

from __future__ import annotations

from moekv.core.lowbit_layout import QuantSpec


def packed_bytes_breakdown(spec: QuantSpec, num_kv_heads: int = 1) -> dict[str, int]:
    """Bytes of one page of one layer, for keys or values (whichever `spec` describes), by tensor."""
    h, p, d, c = num_kv_heads, spec.page_size, spec.head_dim, spec.outlier_capacity
    if spec.axis == "channel":
        scale, zero, scale_base = h * d * 2, h * d * 2, 0            # fp16 per (head, channel)
    else:
        scale = zero = h * p * spec.num_groups                        # uint8 codes per (head, token, group)
        scale_base = h * 2                                            # fp16 per head
    return {
        "codes": h * p * spec.words_per_row * 4,
        "scale": scale,
        "zero": zero,
        "scale_base": scale_base,
        "outlier_vals": h * c * 2,
        "outlier_idx": h * c * 2,
        "outlier_count": h * 2,
    }


def packed_page_bytes(spec: QuantSpec, num_kv_heads: int = 1) -> int:
    return sum(packed_bytes_breakdown(spec, num_kv_heads).values())


def lowbit_page_bytes(key_spec: QuantSpec, value_spec: QuantSpec, num_kv_heads: int, num_layers: int) -> int:
    """Bytes of one low-bit page across all layers, keys and values."""
    return num_layers * (packed_page_bytes(key_spec, num_kv_heads) + packed_page_bytes(value_spec, num_kv_heads))


def staging_page_bytes(page_size: int, num_kv_heads: int, head_dim: int, element_size: int, num_layers: int) -> int:
    """Bytes of one full-precision staging page across all layers, keys and values."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * element_size


def bits_breakdown(key_spec: QuantSpec, value_spec: QuantSpec) -> dict[str, float]:
    """Steady-state bits per value of full low-bit pages, by component (sums to format_bits_per_value)."""
    keys, values = packed_bytes_breakdown(key_spec), packed_bytes_breakdown(value_spec)
    elements = 2 * key_spec.page_size * key_spec.head_dim
    merged = {
        "codes": keys["codes"] + values["codes"],
        "scale_zero": sum(part[name] for part in (keys, values) for name in ("scale", "zero", "scale_base")),
        "outliers": sum(part[name] for part in (keys, values) for name in ("outlier_vals", "outlier_idx")),
        "outlier_counts": keys["outlier_count"] + values["outlier_count"],
    }
    return {name: 8.0 * count / elements for name, count in merged.items()}


def format_bits_per_value(key_spec: QuantSpec, value_spec: QuantSpec) -> float:
    """Steady-state bits per value of a full low-bit page (no staging)."""
    return sum(bits_breakdown(key_spec, value_spec).values())


def pages_held(num_tokens: int, page_size: int, fp_sink_pages: int = 0, staging_block: int | None = None,
               lazy_partial_page: bool = False) -> tuple[int, int]:
    """(pages with low-bit storage, staging blocks) a sequence of `num_tokens` holds. Every page has low-bit
    storage, except with `lazy_partial_page` the partly filled last page (its storage is taken when it fills).
    Staging (blocks of `staging_block` tokens, None: whole pages): all blocks of each of the first
    `fp_sink_pages` pages (ceil(rows / block) of a partly filled sink page), and ceil(rows / block) of the
    partly filled last page. With whole-page blocks the second number is the staging pages held."""
    block = staging_block or page_size
    per_page = page_size // block
    pages, tail = -(-num_tokens // page_size), num_tokens % page_size
    full = num_tokens // page_size
    sinks_full = min(fp_sink_pages, full)
    blocks = sinks_full * per_page
    if tail:                                             # the partly filled last page, sink or not
        blocks += -(-tail // block)
    lowbit = full + (0 if lazy_partial_page or not tail else 1)
    return lowbit, blocks


def full_precision_tokens(num_tokens: int, page_size: int, fp_sink_pages: int = 0) -> int:
    """Tokens of a sequence that a low-bit cache holds in full-precision staging pages: its sink pages'
    and its partly filled last page's (quantized once the page fills)."""
    sink_tokens = min(num_tokens, fp_sink_pages * page_size)
    tail = num_tokens % page_size
    tail_is_sink = -(-num_tokens // page_size) <= fp_sink_pages
    return sink_tokens + (tail if tail and not tail_is_sink else 0)


def cache_bits_per_value(key_spec: QuantSpec, value_spec: QuantSpec, num_kv_heads: int, element_size: int,
                         num_tokens_per_seq: list[int], fp_sink_pages: int = 0, staging_block: int | None = None,
                         lazy_partial_page: bool = False) -> float:
    """All-in bits per value of a cache holding sequences of these lengths: low-bit storage of every page
    held, plus each staging block held (`staging_block` tokens in the model dtype, `element_size` bytes; None:
    whole staging pages), as `pages_held` counts them."""
    page_size, head_dim = key_spec.page_size, key_spec.head_dim
    block = staging_block or page_size
    lowbit = lowbit_page_bytes(key_spec, value_spec, num_kv_heads, 1)
    staging = staging_page_bytes(block, num_kv_heads, head_dim, element_size, 1)
    total_bytes = total_values = 0
    for num_tokens in num_tokens_per_seq:
        pages, blocks = pages_held(num_tokens, page_size, fp_sink_pages, block, lazy_partial_page)
        total_bytes += pages * lowbit + blocks * staging
        total_values += 2 * num_tokens * num_kv_heads * head_dim
    return 8.0 * total_bytes / total_values if total_values else 0.0


def page_cycle_bits(key_spec: QuantSpec, value_spec: QuantSpec, num_kv_heads: int, element_size: int,
                    context: int, fp_sink_pages: int = 0, staging_block: int | None = None,
                    lazy_partial_page: bool = False) -> float:
    """cache_bits_per_value averaged over one page's fill cycle from `context` (page-aligned down): lengths
    start .. start + P - 1, the mean a decoding sequence near `context` holds."""
    start = context - context % key_spec.page_size
    lengths = range(max(start, 1), start + key_spec.page_size)
    return sum(cache_bits_per_value(key_spec, value_spec, num_kv_heads, element_size, [n], fp_sink_pages,
                                    staging_block, lazy_partial_page) for n in lengths) / len(lengths)

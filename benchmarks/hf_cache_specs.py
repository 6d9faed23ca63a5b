"""The caches benchmarks/bench_hf_cache.py compares: one CacheSpec per table row (DynamicCache, quanto and HQQ at
their defaults and with moekv's grouping, moekv's LowBitCache variants), and how each is built."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheSpec:
    """One row of the table: how to build the cache, and how to describe it."""

    name: str
    family: str                     # "dynamic" | "quanto" | "hqq" | "moekv"
    bits: int
    grouping: str
    kwargs: dict = field(default_factory=dict)


def cache_specs(head_dim: int) -> list[CacheSpec]:
    specs = [CacheSpec("DynamicCache (reference)", "dynamic", 16, "none")]
    default = "transformers defaults: axis_key=0, axis_value=0, q_group_size=64"
    for bits in (2, 4):
        specs.append(CacheSpec(f"quanto int{bits} default", "quanto", bits, default + " (contiguous groups of 64)",
                               dict(nbits=bits)))
        specs.append(CacheSpec(f"quanto int{bits} matched", "quanto", bits,
                               f"keys per channel over {head_dim} tokens (axis_key=-1), values per token over "
                               f"{head_dim} channels (axis_value=0), q_group_size={head_dim}",
                               dict(nbits=bits, axis_key=-1, axis_value=0, q_group_size=head_dim)))
    for bits in (2, 3, 4):
        specs.append(CacheSpec(f"HQQ {bits}-bit default", "hqq", bits, default + " (strided groups)",
                               dict(nbits=bits)))
        specs.append(CacheSpec(f"HQQ {bits}-bit matched", "hqq", bits,
                               f"keys and values per token over {head_dim} channels (axis 1), q_group_size={head_dim}"
                               " (quantized as a [B*H*T, D] view: see flat_hqq_layer_class)",
                               dict(nbits=bits, axis_key=1, axis_value=1, q_group_size=head_dim)))

    def moekv_grouping(bits: int, values: str | None = None, outliers: str | None = None) -> str:
        """LowBitCache's layout (the same stored bits at every setting) and how its numbers are chosen; None:
        the width's default (int4: values min/max, outliers by range; int3 / int2: value range search,
        outliers by deviation beyond tau 2)."""
        if values is None:
            values = "min/max" if bits == 4 else "with a range search (value_clip_steps=8, value_clip_refine=2)"
        if outliers is None:
            outliers = "range" if bits == 4 else "deviation"
        choice = ("chosen by range (greedy: the largest cut of a group's squared range)" if outliers == "range"
                  else "chosen by deviation beyond tau 2")
        return ("LowBitCache: keys per channel over 128-token pages, values per token in groups of 32 channels "
                f"{values}, 0.35% fp16 outlier slots per page and head (keys and values) {choice}")

    for bits in (4, 3, 2):
        specs.append(CacheSpec(f"moekv int{bits}", "moekv", bits, moekv_grouping(bits), dict(bits=bits)))
    search = "with a range search (value_clip_steps=8, value_clip_refine=2)"
    specs.append(CacheSpec("moekv int4 outliers by deviation", "moekv", 4, moekv_grouping(4, outliers="deviation"),
                           dict(bits=4, outlier_select="deviation")))
    specs.append(CacheSpec("moekv int4 values range search", "moekv", 4, moekv_grouping(4, values=search),
                           dict(bits=4, value_clip_steps=8)))
    specs.append(CacheSpec("moekv int4 before issue 23 (deviation, values range search)", "moekv", 4,
                           moekv_grouping(4, values=search, outliers="deviation"),
                           dict(bits=4, value_clip_steps=8, outlier_select="deviation")))
    for bits in (3, 2):
        specs.append(CacheSpec(f"moekv int{bits} values min/max", "moekv", bits, moekv_grouping(bits, values="min/max"),
                               dict(bits=bits, value_clip_steps=0)))
        specs.append(CacheSpec(f"moekv int{bits} values symmetric search", "moekv", bits,
                               moekv_grouping(bits, values=search.replace("value_clip_refine=2", "value_clip_refine=0")),
                               dict(bits=bits, value_clip_refine=0)))
        specs.append(CacheSpec(f"moekv int{bits} outliers by range", "moekv", bits,
                               moekv_grouping(bits, outliers="range"), dict(bits=bits, outlier_select="range")))
    specs.append(CacheSpec("moekv int3 (dequantized_copy=False)", "moekv", 3, moekv_grouping(3),
                           dict(bits=3, dequantized_copy=False)))
    return specs


def backend_missing(family: str) -> str | None:
    """Why a backend cannot run here, or None."""
    module = {"quanto": "optimum.quanto", "hqq": "hqq.core.quantize"}.get(family)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as error:                      # noqa: BLE001 - any import failure means skip
        package = {"quanto": "optimum-quanto", "hqq": "hqq"}[family]
        return f"{package} is not importable ({type(error).__name__}: {error}); pip install '{package}' or moekv[bench]"
    return None


def build_cache(spec: CacheSpec, config):
    from transformers import DynamicCache, QuantizedCache

    from moekv.integrations.transformers import LowBitCache

    if spec.family == "dynamic":
        return DynamicCache(config=config)
    if spec.family == "moekv":
        return LowBitCache(config, residual_length=128, **spec.kwargs)
    cache = QuantizedCache(backend=spec.family, config=config, residual_length=128, **spec.kwargs)
    if spec.family == "hqq" and spec.kwargs.get("axis_key") == 1:
        flat = flat_hqq_layer_class()
        cache.layers = [flat(residual_length=128, **spec.kwargs) for _ in cache.layers]
    return cache


def flat_hqq_layer_class():
    """HQQ's 3-bit unpacking assumes a 2-D weight: with axis=1 it keeps shape[0] * shape[1] // group_size rows
    of a [B, H, T, D] tensor (B * H // 64 = 0 here) and fails. Quantizing the same tensor viewed as
    [B * H * T, D] gives identical axis-1 groups (contiguous runs of q_group_size values) and works."""
    from transformers.cache_utils import HQQQuantizedLayer

    class FlatHQQQuantizedLayer(HQQQuantizedLayer):
        def _quantize(self, tensor, axis):
            codes, meta = super()._quantize(tensor.reshape(-1, tensor.shape[-1]), axis)
            meta["kv_shape"] = tuple(tensor.shape)
            return codes, meta

        def _dequantize(self, qtensor):
            return super()._dequantize(qtensor).reshape(qtensor[1]["kv_shape"])

    return FlatHQQQuantizedLayer

"""Attention cases for kernel tests and benchmarks: full-precision pages (`build_fp_case`) and low-bit
cache states (`build_case`): pages quantized by the reference quantizer, the partly filled tail page
of each sequence (and, if asked, its first pages) in fp staging pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.core.attention_metadata import AttentionMetadata
from moekv.core.lowbit_layout import PackedPages, QuantSpec
from moekv.ops.reference import lowbit as reference


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


@dataclass
class LowBitCase:
    query: torch.Tensor             # [T, Hq, D]
    key: torch.Tensor               # [T, Hkv, D] new tokens
    value: torch.Tensor
    key_pages: PackedPages
    value_pages: PackedPages
    key_spec: QuantSpec
    value_spec: QuantSpec
    staging_keys: torch.Tensor      # [num_blocks, SB, Hkv, D]
    staging_values: torch.Tensor
    block_map: torch.Tensor         # [num_ids, P / SB] int32 (num_ids: the pages plus any staging-only ids)
    meta: AttentionMetadata

    def args(self):
        return (self.query, self.key, self.value, self.key_pages, self.value_pages, self.key_spec,
                self.value_spec, self.staging_keys, self.staging_values, self.block_map, self.meta)


DATA_KINDS = ("normal", "outlier_channels", "large", "spikes", "heavy_tail", "constant", "near_max")


def make_data(shape, dtype, kind: str, generator: torch.Generator) -> torch.Tensor:
    """Random KV rows [..., H, D]: "normal", "outlier_channels" (a few channels 50x), "large" (~1e4), "spikes"
    (0.2% of the values +-40 sigma: sparse huge outliers), "heavy_tail" (Student t with 2 degrees of freedom),
    "constant" (every value of a 128-token run equal: all-equal pages), "near_max" (~3e4, half the fp16
    maximum: codes times scales near fp16's top)."""
    x = torch.randn(shape, generator=generator)
    if kind == "outlier_channels":
        channels = torch.randperm(shape[-1], generator=generator)[:3]
        x[..., channels] *= 50.0
    elif kind == "large":
        x = x * 1e4
    elif kind == "spikes":
        spikes = torch.rand(shape, generator=generator) < 0.002
        x = torch.where(spikes, 40.0 * torch.sign(torch.randn(shape, generator=generator)), x)
    elif kind == "heavy_tail":
        chi2 = torch.randn((2, *shape), generator=generator).square().sum(0)
        x = x / torch.sqrt(chi2 / 2).clamp(min=1e-3)
    elif kind == "constant":
        runs = x.reshape(-1, *shape[-2:])[::128].repeat_interleave(128, dim=0)[:x.reshape(-1, *shape[-2:]).shape[0]]
        x = runs[:, :1, :1].expand_as(runs).reshape(shape).clone()
    elif kind == "near_max":
        x = x.clamp(-1.0, 1.0) * 3e4
    elif kind != "normal":
        raise ValueError(f"unknown data kind {kind!r}; one of {DATA_KINDS}")
    return x.to(dtype)


def build_case(context_lens: list[int], query_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
               bits: int, page_size: int, dtype: torch.dtype = torch.float32, kind: str = "normal",
               key_axis: str = "channel", group_size: int | None = None, outlier_fraction: float = 0.02,
               sink_pages: int = 0, seed: int = 0, device: str = "cpu",
               key_outlier_fraction: float | None = None, staging_block: int | None = None,
               staging_only: bool = False) -> LowBitCase:
    """A random low-bit attention case. Staging in blocks of `staging_block` rows (None: whole pages), handed
    out in a shuffled order, a partly filled page holding only the blocks its rows need; `staging_only`: each
    partly filled last page is an id beyond the low-bit pages (CacheConfig.lazy_partial_page)."""
    gen = torch.Generator().manual_seed(seed)
    block = staging_block or page_size
    per_page = page_size // block
    # "large": values ~1e4; keys ~1e4 only in fp32 -- with 16-bit queries, logits that large make the softmax
    # an argmax that any rounding of q may flip (an ill-posed comparison), so keys stay normal there
    key_kind = "normal" if kind in ("large", "near_max") and dtype != torch.float32 else kind
    capacity = QuantSpec.capacity_for(outlier_fraction, page_size, head_dim)
    key_fraction = outlier_fraction if key_outlier_fraction is None else key_outlier_fraction
    key_spec = QuantSpec(bits=bits, axis=key_axis, head_dim=head_dim, page_size=page_size, group_size=group_size,
                         outlier_capacity=QuantSpec.capacity_for(key_fraction, page_size, head_dim))
    value_spec = QuantSpec(bits=bits, axis="token", head_dim=head_dim, page_size=page_size,
                           group_size=group_size, outlier_capacity=capacity)
    pages_needed = [-(-(c + q) // page_size) for c, q in zip(context_lens, query_lens)]
    num_pages = sum(pages_needed) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()
    key_pages = PackedPages.empty(key_spec, num_pages, num_kv_heads, "cpu")
    value_pages = PackedPages.empty(value_spec, num_pages, num_kv_heads, "cpu")
    num_blocks = (sum(pages_needed) + 1) * per_page
    block_gen = torch.Generator().manual_seed(seed + 7919)         # its own stream: the data do not change
    block_order = torch.randperm(num_blocks, generator=block_gen).tolist() if per_page > 1 else list(range(num_blocks))
    staging_shape = (num_blocks, block, num_kv_heads, head_dim)
    staging_keys = torch.zeros(staging_shape, dtype=dtype)
    staging_values = torch.zeros(staging_shape, dtype=dtype)
    num_ids = num_pages + (len(context_lens) + 2 if staging_only else 0)
    block_map = torch.full((num_ids, per_page), -1, dtype=torch.int32)
    tables, next_page, next_slot, next_tail = [], 0, 0, num_pages + 1
    for ctx, pages in zip(context_lens, pages_needed):
        table = perm[next_page:next_page + pages]
        next_page += pages
        if staging_only and ctx % page_size and (ctx - 1) // page_size >= sink_pages:
            table[(ctx - 1) // page_size] = next_tail          # the partly filled page: a staging-only id
            next_tail += 1
        tables.append(table)
        keys = make_data((pages * page_size, num_kv_heads, head_dim), dtype, key_kind, gen)
        values = make_data((pages * page_size, num_kv_heads, head_dim), dtype, kind, gen)
        for index, page in enumerate(table):
            rows = slice(index * page_size, (index + 1) * page_size)
            full = (index + 1) * page_size <= ctx
            if full and index >= sink_pages:
                ids = torch.tensor([page])
                for pages_of, spec, x in ((key_pages, key_spec, keys), (value_pages, value_spec, values)):
                    packed, _ = reference.quantize_pages(x[rows].transpose(0, 1).unsqueeze(0), spec)
                    pages_of.store(ids, packed)
            elif index * page_size < ctx or index < sink_pages:
                held = per_page if full else max(1, -(-(ctx - index * page_size) // block))
                for j in range(held):
                    blk = block_order[next_slot]
                    next_slot += 1
                    block_map[page, j] = blk
                    sub = slice(index * page_size + j * block, index * page_size + (j + 1) * block)
                    staging_keys[blk] = keys[sub]
                    staging_values[blk] = values[sub]
    total = sum(query_lens)
    query = make_data((total, num_kv_heads * group, head_dim), dtype, "normal", gen)
    key = make_data((total, num_kv_heads, head_dim), dtype, key_kind, gen)
    value = make_data((total, num_kv_heads, head_dim), dtype, kind, gen)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, page_size, "cpu")
    case = LowBitCase(query, key, value, key_pages, value_pages, key_spec, value_spec, staging_keys,
                      staging_values, block_map, meta)
    return to_device(case, device) if device != "cpu" else case


def to_device(case: LowBitCase, device) -> LowBitCase:
    def move(p: PackedPages) -> PackedPages:
        return PackedPages(**{name: t.to(device) for name, t in p.tensors().items()},
                           **({"scale_base": None} if p.scale_base is None else {}))

    m = case.meta
    meta = AttentionMetadata.build(m.query_lens_host, m.context_lens_host, m.block_tables_host,
                                   case.key_spec.page_size, device)
    return LowBitCase(case.query.to(device), case.key.to(device), case.value.to(device), move(case.key_pages),
                      move(case.value_pages), case.key_spec, case.value_spec, case.staging_keys.to(device),
                      case.staging_values.to(device), case.block_map.to(device), meta)

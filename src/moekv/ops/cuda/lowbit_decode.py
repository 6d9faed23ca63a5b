"""Low-bit paged decode attention in CUDA C++ (v9, one warp per page; "v7" names the CUDA kernel family):
the decode-step kernel over the low-bit KV pages.

Same contract as ops.reference.lowbit.paged_attention_lowbit (its pure-PyTorch twin and the CI oracle) for a
decode step (one new token per sequence). Design, measurements and the history of the earlier Triton kernels:
docs/attention-kernels.md; byte layout: docs/kv-format.md. The CUDA source lives in csrc/ beside this file and is
built at first use with torch.utils.cpp_extension (nvcc of the machine's CUDA toolkit; the build is cached by
torch in its extensions folder).

Takes: head_dim 128, 128-token pages, equal key / value code widths (2, 3 or 4 bits), keys on the channel axis,
values on the token axis with one group, fp16 / bf16 queries with staging pages of the same dtype, GQA groups up
to 8, a compute capability of 8.0 or more. `supports` says so; other formats use the general Triton kernel.
"""

from __future__ import annotations

import functools
import math
import pathlib

import torch

PAGE_SIZE = 128
HEAD_DIM = 128
MAX_GROUP = 8
TABLE_MAX = 512                  # block-table entries one split holds in shared memory (lowbit_decode.cuh)
MAX_SPLITS = 512                 # splits per (sequence, kv head) the in-kernel combine takes (lowbit_decode.cuh)
CTAS_PER_SM = 4                  # resident CTAs per SM of the int3 / int2 builds (__launch_bounds__)
INT4_CTAS_PER_SM = 3             # the int4 build's (larger code stages)
INT4_WAVES = 2                   # int4 plans this many full waves (measured best in session 16)
MIN_PAGES_PER_SPLIT = 8          # below this the split's fixed costs (ring fill, merge, combine) dominate
# warps per CTA when every CTA has an SM to itself (plan_warps): 8 measured faster there (session 21, B=1 16k:
# int3 -7.6%, int4 -10.5%; benchmarks/results/attention-sweep-warps-splits.md); `warps=4|8` forces either
SMALL_BATCH_WARPS = 8
# few (sequence, kv head) pairs (B=1, 2 with 8 kv heads): plan about 3 CTAs per SM rather than a full wave (session 21
# sweep at B=1 64k / 128k: 48 splits beat 64 by 7-13% for int3 and int4's two waves by 20-26%)
SMALL_PAIRS = 16
SMALL_PAIRS_CTAS_PER_SM = 3
# chunk-split CTAs (plan_chunk_split) where a split holds at most this many pages (4 warps x 1-2 chunks each)
CHUNK_SPLIT_MAX_PAGES = 0
# v15 work split (docs/attention-kernels.md item 7; chunk-split CTAs, `work_split`): the splits of a sequence cover
# equal work, W = CHUNKS x (full low-bit pages) + S, where S = WORK_SPLIT_TAIL_UNITS counts the staged partly filled
# last page in 32-token chunk units (a full page: CHUNKS = 4 units, which the CTA's 4 warps share: one chunk-time
# each). The tail's tensor-core pass runs after the page loop on the whole CTA, and the session 27/28 traces put it
# at ~3-4 chunk-times of a warp's chain (+8.7 us at B=8 32k, up to +11.8 us at B=32 16k, ~2.5-3 us a chunk), so
# S = 4 warps x 3 chunk-times = 12 units. Split s takes units [s W / n, (s + 1) W / n) (sized on the device from
# each sequence's length: graph-safe); `work_split=<int>` launches with another S (the GPU A/B's sweep).
CHUNKS = 4
WORK_SPLIT_TAIL_UNITS = 12
# the planner switch (plan_work_split): launches with work_split=None take the work split for batches of more than
# SMALL_PAIRS (sequence, kv head) pairs (B=8 32k, B=32: the shapes it is for) where chunk-split CTAs can run. Off
# until a GPU A/B says otherwise.
WORK_SPLIT = False
_CSRC = pathlib.Path(__file__).with_name("csrc")


def supports(key_spec, value_spec, head_dim: int) -> bool:
    """Whether this kernel takes the format (see the module docstring); `runs_on` checks dtypes and device."""
    return (key_spec.page_size == value_spec.page_size == PAGE_SIZE
            and key_spec.head_dim == value_spec.head_dim == head_dim == HEAD_DIM
            and key_spec.bits == value_spec.bits and key_spec.bits in (2, 3, 4)
            and key_spec.axis == "channel" and value_spec.axis == "token" and value_spec.num_groups == 1)


def runs_on(query: torch.Tensor, staging: torch.Tensor) -> bool:
    """fp16 / bf16 queries with staging blocks of the same dtype (of 32, 64 or 128 rows: [blocks, rows, Hkv, D])
    on a CUDA device of compute capability >= 8.0."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and staging.dtype == query.dtype
            and staging.shape[-3] in (32, 64, 128) and torch.cuda.get_device_capability(query.device)[0] >= 8)


@functools.lru_cache(maxsize=None)
def _module(major: int, minor: int):
    from torch.utils.cpp_extension import load

    arch = f"{major}{minor}"
    return load(name=f"moekv_lowbit_decode_v7_sm{arch}",
                sources=[str(_CSRC / name) for name in ("lowbit_decode.cu", "lowbit_decode_b2.cu", "lowbit_decode_b3.cu",
                                                         "lowbit_decode_b4.cu", "lowbit_decode_b3s.cu",
                                                         "lowbit_decode_b4s.cu", "lowbit_decode_b2s.cu", "lowbit_decode_b2w8.cu", "lowbit_decode_b2sw8.cu",
                                                         "lowbit_decode_b3w8.cu", "lowbit_decode_b3sw8.cu",
                                                         "lowbit_decode_b4w8.cu", "lowbit_decode_b4sw8.cu",
                                                         "lowbit_decode_b2sc.cu", "lowbit_decode_b3sc.cu",
                                                         "lowbit_decode_b4sc.cu")],
                extra_include_paths=[str(_CSRC)], verbose=False,
                extra_cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}"])


def module(device: torch.device):
    """The built extension for this device's compute capability."""
    return _module(*torch.cuda.get_device_capability(device))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_splits(batch: int, num_kv_heads: int, max_pages: int, num_sms: int, bits: int = 3) -> int:
    """Split-K count, each split at least MIN_PAGES_PER_SPLIT pages and at most TABLE_MAX, 1 when the batch fills
    the GPU. int3 / int2 (4 CTAs per SM): the most splits whose CTAs still fit one wave (measured faster than two
    waves, session 17's sweep in docs/attention-kernels.md); int4 (3 CTAs per SM): enough for two full waves; at
    most SMALL_PAIRS (sequence, kv head) pairs, any width: about SMALL_PAIRS_CTAS_PER_SM CTAs per SM (session 21)."""
    pairs = max(batch * num_kv_heads, 1)
    need = math.ceil(max(max_pages, 1) / TABLE_MAX)
    if pairs <= SMALL_PAIRS:
        want = max(1, num_sms * SMALL_PAIRS_CTAS_PER_SM // pairs)
    elif bits == 4:
        want = math.ceil(INT4_WAVES * num_sms * INT4_CTAS_PER_SM / pairs)
    else:
        want = max(1, num_sms * CTAS_PER_SM // pairs)
    return min(MAX_SPLITS, max(need, min(want, max(1, max_pages // MIN_PAGES_PER_SPLIT))))


def plan_chunk_split(batch: int, num_kv_heads: int, group: int, max_pages: int, num_sms: int,
                     bits: int = 3) -> tuple[int, int] | None:
    """(splits, pages per split) of a chunk-split launch (CTAs of 4 warps whose warps share each page's four
    32-token chunks: csrc/lowbit_decode_page.cuh WarpRange), or None where it does not apply: GQA groups above 4,
    more than SMALL_PAIRS (sequence, kv head) pairs, or splits of more than CHUNK_SPLIT_MAX_PAGES pages (a warp's
    run would be a whole page or more, as in the page-per-warp plan). One wave of CTAS_PER_SM (int4: 3) CTAs per SM.
    CUDA-graph buckets plan theirs with graph_split_count; docs/attention-kernels.md v14 item 6c."""
    pairs = max(batch * num_kv_heads, 1)
    if group > MAX_GROUP // 2 or pairs > SMALL_PAIRS or max_pages < 1:
        return None
    want = max(1, num_sms * (INT4_CTAS_PER_SM if bits == 4 else CTAS_PER_SM) // pairs)
    per_split = math.ceil(max_pages / min(want, MAX_SPLITS))
    if per_split > CHUNK_SPLIT_MAX_PAGES:
        return None
    return math.ceil(max_pages / per_split), per_split


def plan_work_split(batch: int, num_kv_heads: int, group: int, chunk_split: bool | None = None,
                    warps: int | None = None, switch: bool | None = None) -> bool:
    """Whether a launch with work_split=None takes the work split: the planner switch (`switch`, default
    WORK_SPLIT) on, more than SMALL_PAIRS (sequence, kv head) pairs (small batches keep their own plans), GQA
    groups <= 4, chunk-split CTAs not turned off, 4 warps (or unset)."""
    on = WORK_SPLIT if switch is None else switch
    return bool(on and batch * num_kv_heads > SMALL_PAIRS and group <= MAX_GROUP // 2 and chunk_split is not False
                and warps in (None, 4))


def work_tail_units(work_split: bool | int | None) -> int:
    """The staged tail's weight in chunk units of a `work_split` launch argument (the kernel's Params::work_tail):
    False / None / 0 -> 0 (off), True -> WORK_SPLIT_TAIL_UNITS, an int -> that many (1 .. 4 x TABLE_MAX)."""
    if work_split is None or work_split is False:
        return 0
    if work_split is True:
        return WORK_SPLIT_TAIL_UNITS
    units = int(work_split)
    if units != work_split or not 0 <= units <= CHUNKS * TABLE_MAX:
        raise ValueError(f"paged_attention_lowbit_decode: work_split must be a bool or 0 .. {CHUNKS * TABLE_MAX} "
                         f"tail units, got {work_split!r}")
    return units


def work_split_table_pages(max_pages: int, splits: int, tail_units: int) -> int:
    """The most pages one split's table holds under the work split: ceil(W / splits) chunk units span at most
    ceil(units / CHUNKS) + 1 full pages (a run may start mid-page), plus the partly filled last page."""
    units = -(-(CHUNKS * max(max_pages, 1) + tail_units) // max(splits, 1))
    return -(-units // CHUNKS) + 2


def work_split_ranges(context_len: int, splits: int, tail_units: int,
                      warps: int = 4) -> list[tuple[int, int, bool, list[tuple[int, int, int, int]]]]:
    """The work-split plan of one sequence as the device computes it (a host mirror of split_range and warp_range in
    csrc/lowbit_decode_page.cuh with Params::work_tail = tail_units: keep the two in step), for tests and docs. Per
    split: (first page, pages in its table, whether the table's last page is the partly filled last page, per warp
    (first table index, first chunk, the chunk after the last page's last, pages visited))."""
    num_pages = -(-context_len // PAGE_SIZE)
    partial = 1 if context_len % PAGE_SIZE else 0
    full = num_pages - partial
    fu = full * CHUNKS
    units = fu + partial * tail_units
    plan = []
    for split in range(splits):
        a, b = split * units // splits, (split + 1) * units // splits
        ca, cb = min(a, fu), min(b, fu)
        tail = bool(partial) and a <= fu < b
        first = ca // CHUNKS if cb > ca else full
        n = ((cb - 1) // CHUNKS - first + 1 if cb > ca else 0) + int(tail)
        u_lo, u_hi = (ca - CHUNKS * first, cb - CHUNKS * first) if cb > ca else (0, 0)
        runs = []
        for warp in range(warps):
            span = u_hi - u_lo
            u0, u1 = u_lo + warp * span // warps, u_lo + (warp + 1) * span // warps
            last = int(tail and warp == warps - 1)
            jp0 = u0 // CHUNKS if u1 > u0 else 0
            my_n = ((u1 - 1) // CHUNKS - jp0 + 1 if u1 > u0 else 0) + last
            k0 = u0 % CHUNKS if u1 > u0 else 0
            k1 = (u1 - 1) % CHUNKS + 1 if u1 > u0 and not last else CHUNKS
            runs.append((jp0, k0, k1, my_n))
        plan.append((first, n, tail, runs))
    return plan


def plan_warps(batch: int, num_kv_heads: int, splits: int, num_sms: int,
               small_batch_warps: int = SMALL_BATCH_WARPS) -> int:
    """Warps per CTA: `small_batch_warps` when every CTA has an SM to itself (batch x kv heads x splits <= SMs:
    small batches, where 4 warps leave the SM mostly idle and each warp's page chain is the critical path), else 4
    (the occupancy the 128-register build is made for)."""
    return small_batch_warps if batch * num_kv_heads * splits <= num_sms else 4


def graph_chunk_split(batch: int, num_kv_heads: int) -> bool:
    """Whether a CUDA-graph bucket of `batch` sequences plans chunk-split CTAs (GQA groups above 4 then launch the
    page-per-warp CTAs with the same split count): at most SMALL_PAIRS pairs, with chunk splitting enabled."""
    return CHUNK_SPLIT_MAX_PAGES > 0 and batch * num_kv_heads <= SMALL_PAIRS


def graph_split_count(batch: int, num_kv_heads: int, max_pages: int, num_sms: int, bits: int = 3) -> int:
    """The split count of a bucket whose tables hold max_pages pages: with chunk-split CTAs, one wave of them (the
    pages per split are sized per sequence on the device, so a 16k context under a 32k max_model_len gets 2 pages a
    split); else plan_splits."""
    if graph_chunk_split(batch, num_kv_heads):
        want = num_sms * (INT4_CTAS_PER_SM if bits == 4 else CTAS_PER_SM) // max(batch * num_kv_heads, 1)
        need = math.ceil(max(max_pages, 1) / TABLE_MAX)
        return min(MAX_SPLITS, max(need, min(max(want, 1), max(max_pages, 1))))
    return plan_splits(batch, num_kv_heads, max_pages, num_sms, bits)


def graph_splits(batch: int, num_kv_heads: int, max_model_len: int, device: torch.device, bits: int = 3) -> int:
    """The split count a CUDA-graph bucket of `batch` sequences launches (pages per split sized on the device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return graph_split_count(batch, num_kv_heads, math.ceil(max_model_len / PAGE_SIZE), _num_sms(index), bits)


def workspace_bytes(batch: int, num_kv_heads: int, splits: int, head_dim: int = HEAD_DIM) -> int:
    """Device bytes of one launch's split-K buffers (fp32 partial outputs and log-sum-exp; none for 1 split)."""
    return 0 if splits <= 1 else batch * num_kv_heads * splits * MAX_GROUP * (head_dim + 1) * 4


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, needed: int) -> torch.Tensor:
    """Per-(sequence, kv head) arrival counters of the split combine; zero between launches (the last CTA resets
    its own), allocated once per device."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < needed:
        counters = torch.zeros(max(needed, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def paged_attention_lowbit_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pages,
                                  value_pages, key_spec, value_spec, staging_keys: torch.Tensor,
                                  staging_values: torch.Tensor, staging_block_map: torch.Tensor, meta,
                                  scale: float, num_splits: int | None = None,
                                  warps: int | None = None, chunk_split: bool | None = None,
                                  work_split: bool | int | None = None) -> torch.Tensor:
    """Decode attention (one new token per sequence) over low-bit pages; query [B, Hq, D] -> [B, Hq, D].

    `meta.fixed_num_splits` (CUDA graphs) launches exactly that many splits, sized on the device from each
    sequence's length; otherwise the count is planned from the host lengths (`num_splits` overrides it).
    `warps` (4 or 8) overrides `plan_warps`. `chunk_split` None: `plan_chunk_split` decides for host-planned
    launches without `num_splits` / `warps`; True forces it (4 warps, GQA groups <= 4), False turns it off.
    `work_split` (v15, chunk-split CTAs): True (or S, the staged tail's weight in chunk units; True takes
    WORK_SPLIT_TAIL_UNITS) sizes the splits in work units on the device, the partly filled last page counted as S
    against a full page's 4; None follows the planner switch (plan_work_split); False / 0 turns it off. It launches
    chunk-split CTAs (at the split count that chunk_split=True would plan)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    batch = meta.context_lens.shape[0]
    if num_tokens != batch:
        raise ValueError("paged_attention_lowbit_decode: decode only (one new token per sequence)")
    if group > MAX_GROUP or num_heads % num_kv_heads:
        raise ValueError(f"paged_attention_lowbit_decode: GQA group {num_heads}/{num_kv_heads} not supported")
    if warps is not None and warps not in (4, 8):
        raise ValueError(f"paged_attention_lowbit_decode: warps per CTA must be 4 or 8, got {warps}")
    if work_split is None:         # the planner switch
        work_split = plan_work_split(batch, num_kv_heads, group, chunk_split, warps)
    work_tail = work_tail_units(work_split)
    if work_tail:
        if chunk_split is False or warps not in (None, 4):
            raise ValueError("paged_attention_lowbit_decode: the work split runs on chunk-split CTAs (4 warps)")
        if group > MAX_GROUP // 2:
            raise ValueError(f"paged_attention_lowbit_decode: chunk-split CTAs take GQA groups <= 4, got {group}")
        chunk_split = True
    out = torch.empty_like(query)
    if batch == 0:
        return out
    fixed = getattr(meta, "fixed_num_splits", None)
    table_width = meta.block_tables.shape[1]
    if fixed is not None:
        splits, pages_per_split = max(int(fixed), 1), 0
        if math.ceil(table_width / splits) > TABLE_MAX or (
                work_tail and work_split_table_pages(table_width, splits, work_tail) > TABLE_MAX):
            raise ValueError(f"paged_attention_lowbit_decode: {splits} splits of a {table_width}-page table exceed "
                             f"{TABLE_MAX} pages per split")
    else:
        max_pages = math.ceil(max(meta.context_lens_host, default=0) / PAGE_SIZE)
        index = query.device.index if query.device.index is not None else torch.cuda.current_device()
        cs_plan = None
        if chunk_split is not False and (chunk_split or (num_splits is None and warps is None)):
            cs_plan = plan_chunk_split(batch, num_kv_heads, group, max_pages, _num_sms(index), key_spec.bits)
        if chunk_split and group > MAX_GROUP // 2:
            raise ValueError(f"paged_attention_lowbit_decode: chunk-split CTAs take GQA groups <= 4, got {group}")
        if cs_plan is not None and num_splits is None:
            splits = cs_plan[0]
        else:
            splits = num_splits or plan_splits(batch, num_kv_heads, max_pages, _num_sms(index), key_spec.bits)
        pages_per_split = max(math.ceil(max_pages / splits), 1)
        splits = max(math.ceil(max_pages / pages_per_split), 1)
        if pages_per_split > TABLE_MAX:
            raise ValueError(f"paged_attention_lowbit_decode: {pages_per_split} pages per split exceed {TABLE_MAX}")
        if work_tail and work_split_table_pages(max_pages, splits, work_tail) > TABLE_MAX:
            raise ValueError(f"paged_attention_lowbit_decode: the work split's {splits} splits of {max_pages} pages "
                             f"exceed {TABLE_MAX} pages per split")
    if splits > MAX_SPLITS:
        raise ValueError(f"paged_attention_lowbit_decode: {splits} splits exceed {MAX_SPLITS}")
    if fixed is not None:          # a graph bucket: graph_split_count planned its splits for this mode
        split_chunks = chunk_split if chunk_split is not None else (graph_chunk_split(batch, num_kv_heads)
                                                                    and group <= MAX_GROUP // 2 and warps in (None, 4))
    else:
        split_chunks = bool(chunk_split) or (chunk_split is None and cs_plan is not None)
    if split_chunks:
        if warps not in (None, 4):
            raise ValueError("paged_attention_lowbit_decode: chunk-split CTAs have 4 warps")
        warps = 4
    if warps is None:
        index = query.device.index if query.device.index is not None else torch.cuda.current_device()
        warps = plan_warps(batch, num_kv_heads, splits, _num_sms(index))
    if splits > 1:
        partial = torch.empty((batch, num_kv_heads, splits, MAX_GROUP, head_dim), dtype=torch.float32,
                              device=query.device)
        lse = torch.empty((batch, num_kv_heads, splits, MAX_GROUP), dtype=torch.float32, device=query.device)
    else:
        partial = lse = torch.empty(0, dtype=torch.float32, device=query.device)
    counters = _counters(query.device, batch * num_kv_heads)
    for name, t in (("key", key), ("value", value), ("query", query)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_attention_lowbit_decode: {name} rows must be contiguous")
    kp, vp = key_pages, value_pages
    from moekv.ops.triton import pdl              # KernelConfig.pdl: launched with programmatic dependent launch
    module(query.device).decode(
        query, key, value, out, partial, lse, counters,
        kp.codes, kp.scale, kp.zero, kp.outlier_vals, kp.outlier_idx, kp.outlier_count,
        vp.codes, vp.scale, vp.zero, vp.scale_base, vp.outlier_vals, vp.outlier_idx, vp.outlier_count,
        staging_keys, staging_values, staging_block_map, meta.block_tables, meta.query_start_loc,
        meta.context_lens, float(scale) * math.log2(math.e), group, splits, pages_per_split, key_spec.bits, warps,
        split_chunks, work_tail, pdl.active_on(query))
    return out

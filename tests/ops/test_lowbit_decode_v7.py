"""The v7 CUDA decode kernel (ops/cuda/lowbit_decode.py) against its pure-PyTorch twin
(ops.reference.lowbit.paged_attention_lowbit).

On the GPU: every code width, GQA 1/4/8, ragged lengths (1, P-1, P, P+1, several pages), staged tail and sink
pages, outliers on both sides / values only / none, adversarial data (heavy channels, sparse huge spikes,
heavy-tailed values, all-equal pages, values near the fp16 maximum), fp16 and bf16, planned and forced splits,
device-sized splits (CUDA graphs) inside a graph replay. On the CPU (CI): the host-side contract (format
support, split planning, the decode-only check); the kernel itself is CUDA C++ and needs a GPU.
"""

from __future__ import annotations

import pytest
import torch

from moekv.core.lowbit_layout import QuantSpec
from moekv.ops.cuda import lowbit_decode
from moekv.ops.reference import lowbit as reference
from moekv.testing.attention_cases import build_case, to_device

SCALE = 0.088
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the kernel is CUDA C++)")


def _check(case, dtype, **kwargs):
    ref = reference.paged_attention_lowbit(*case.args(), SCALE).float()
    out = torch.full_like(case.query, float("nan"))                  # poisoned: every element must be written
    out.copy_(lowbit_decode.paged_attention_lowbit_decode(*case.args(), SCALE, **kwargs))
    _assert_close(out.float(), ref, dtype)


def _assert_close(out, ref, dtype):
    """Max error / max |ref| and mean error / mean |ref|. The kernel's MMA operands are fp16 (q * S and p * S
    rounded once, 2^-11 relative): fp16 gets twice the fp16 tolerance of the Triton kernels' tests."""
    assert torch.isfinite(out).all()
    err = (out - ref).abs()
    max_tol, mean_tol = (2e-2, 1e-2) if dtype == torch.bfloat16 else (4e-3, 2e-3)
    assert err.max() <= max_tol * ref.abs().max(), (err.max().item(), ref.abs().max().item())
    assert err.mean() <= mean_tol * ref.abs().mean(), (err.mean().item(), ref.abs().mean().item())


def _case(context, group=4, bits=3, dtype=torch.bfloat16, kind="normal", fraction=0.0025, sinks=0, seed=0,
          num_kv_heads=2, key_fraction=None):
    """key_fraction 0.0: keys without outlier slots (the cache's default format; with GQA groups <= 4 the kernel
    then adds value outliers as fp32 corrections, else by one-hot MMAs)."""
    return to_device(build_case(context, [1] * len(context), num_kv_heads, group, 128, bits, 128, dtype=dtype,
                                kind=kind, outlier_fraction=fraction, sink_pages=sinks, seed=seed,
                                key_outlier_fraction=key_fraction), "cuda")


@needs_cuda
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("key_fraction", [0.0, None])
@pytest.mark.parametrize("warps", [4, 8])
def test_widths_and_groups(bits, group, key_fraction, warps):
    _check(_case([1, 127, 128, 129, 300, 1000], group=group, bits=bits, seed=bits * 10 + group,
                 key_fraction=key_fraction), torch.bfloat16, warps=warps)


@needs_cuda
@pytest.mark.parametrize("kind", ["outlier_channels", "spikes", "heavy_tail", "constant", "near_max", "large"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key_fraction", [0.0, None])
@pytest.mark.parametrize("warps", [4, 8])
def test_adversarial_data(kind, dtype, key_fraction, warps):
    _check(_case([255, 129, 640], kind=kind, dtype=dtype, fraction=0.01, seed=len(kind), key_fraction=key_fraction),
           dtype, warps=warps)


@needs_cuda
@pytest.mark.parametrize("fraction", [0.0, 0.0025, 0.02])
@pytest.mark.parametrize("key_fraction", [0.0, None])
def test_outlier_budgets(fraction, key_fraction):
    _check(_case([1000, 384, 129], bits=3, fraction=fraction, kind="spikes", key_fraction=key_fraction),
           torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("group", [4, 8])
def test_value_outliers_crowding_one_channel(group):
    """Every value outlier of a page in one channel (and tokens of a chunk sharing it): the corrections of one
    channel land in successive rounds (stacked scores) or one-hot MMAs (group 8), none lost."""
    case = _case([640, 300], group=group, bits=3, fraction=0.02, kind="normal", seed=5, key_fraction=0.0)
    vp = case.value_pages
    assert vp.outlier_idx.shape[-1] >= 128
    idx = torch.zeros_like(vp.outlier_idx[0, 0])
    idx[:128] = torch.arange(128, device=idx.device) * 128 + 37             # channel 37 of every token, ascending
    vals = torch.zeros_like(vp.outlier_vals[0, 0])
    vals[:128] = torch.linspace(-30.0, 30.0, 128)
    vp.outlier_idx.copy_(idx.expand_as(vp.outlier_idx))
    vp.outlier_vals.copy_(vals.expand_as(vp.outlier_vals))
    vp.outlier_count.fill_(128)
    _check(case, torch.bfloat16)


@needs_cuda
def test_key_outliers_only_and_values_only():
    for spec_side in ("key", "value"):
        case = _case([700, 129], bits=3, fraction=0.02, kind="spikes", seed=3)
        pages = case.value_pages if spec_side == "key" else case.key_pages
        pages.outlier_count.zero_()                                    # the other side keeps none
        pages.outlier_vals.zero_()
        _check(case, torch.bfloat16)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values in storage that starts 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)[1:1 + t.numel()]
    return flat.view(t.shape).copy_(t)


@needs_cuda
def test_the_pools_last_pages_and_misaligned_page_tensors():
    """The covering 16-byte chunks of the pool's last page-heads would pass the outlier arrays' end (their copies
    are clamped): a table that holds the pool's last pages reads them right. Page tensors that are not 16-byte
    aligned (the kernel's copies need it; the cache allocates aligned ones) are refused with a clear error."""
    case = _case([900, 129, 384], bits=3, fraction=0.02, kind="spikes", seed=21)
    last = case.key_pages.codes.shape[0] - 1
    for tables in (case.meta.block_tables, case.meta.block_tables_host):   # the kernel's and the reference's
        tables[0][0], tables[1][0] = last, last - 1      # the first page of two sequences: the pool's last pages
    _check(case, torch.bfloat16)
    for pages in (case.key_pages, case.value_pages):
        pages.outlier_idx = _misaligned(pages.outlier_idx)
        pages.outlier_vals = _misaligned(pages.outlier_vals)
        assert pages.outlier_idx.data_ptr() % 16 != 0
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        lowbit_decode.paged_attention_lowbit_decode(*case.args(), SCALE)


@needs_cuda
def test_staged_sink_pages():
    _check(_case([600, 129, 1], sinks=1, seed=5), torch.bfloat16)
    _check(_case([900, 260], sinks=3, seed=6), torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("splits", [None, 1, 3, 7])
@pytest.mark.parametrize("key_fraction", [0.0, None])
def test_chunk_split(bits, splits, key_fraction):
    """Chunk-split CTAs: the four warps share each page's chunks in contiguous runs that start and end mid-page;
    staged tails and sink pages are listed once (by the run holding their chunk 0)."""
    case = _case([1, 127, 129, 300, 1000, 2049], bits=bits, sinks=1, seed=40 + bits, key_fraction=key_fraction)
    _check(case, torch.bfloat16, num_splits=splits, chunk_split=True)


@needs_cuda
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk_split_planned(group, dtype):
    """The planned chunk-split launch of a single sequence (plan_chunk_split: 1 or 2 pages per split)."""
    for context in ([2047], [16383], [130]):
        _check(_case(context, group=group, dtype=dtype, seed=50 + group, num_kv_heads=8), dtype)


@needs_cuda
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("warps", [4, 8])
def test_forced_splits(splits, warps):
    _check(_case([1000, 2000, 129, 1], seed=splits), torch.bfloat16, num_splits=splits, warps=warps)


@needs_cuda
@pytest.mark.parametrize("warps", [4, 8])
def test_many_splits(warps):
    # 157 pages, 2 per split: 79 splits combined in one CTA (shared-memory weights, both thread phases of 8 warps)
    _check(_case([20000, 300, 1], seed=21), torch.bfloat16, num_splits=150, warps=warps)


@needs_cuda
@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("splits", [4, 16])
def test_tail_pages_across_split_boundaries(fixed, splits):
    # 2049 tokens = 16 full pages + a 1-token staged tail, 2048 = no tail, 2177 = 17 full pages + a tail; splits
    # sized on the host (num_splits) or on the device (fixed_num_splits, as a CUDA-graph bucket launches)
    case = _case([2049, 2048, 2177, 127], seed=30 + splits)
    if fixed:
        case.meta.fixed_num_splits = splits
    _check(case, torch.bfloat16, **({} if fixed else {"num_splits": splits}))


@needs_cuda
def test_split_count_cap():
    case = _case([70000], seed=22)                  # 547 pages: one page per split would be 547 splits
    with pytest.raises(ValueError, match="splits exceed 512"):
        lowbit_decode.paged_attention_lowbit_decode(*case.args(), SCALE, num_splits=547)


@needs_cuda
@pytest.mark.parametrize("splits", [1, 4, 9])
@pytest.mark.parametrize("launch", [{"warps": 4}, {"warps": 8}, {"work_split": True}], ids=["w4", "w8", "work"])
def test_graph_replay_with_device_splits(splits, launch):
    case = _case([1000, 300, 129, 1], seed=11 + splits)
    ref = reference.paged_attention_lowbit(*case.args(), SCALE).float()
    case.meta.fixed_num_splits = splits
    fn = lambda: lowbit_decode.paged_attention_lowbit_decode(*case.args(), SCALE, **launch)   # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(2):                  # the split counters reset themselves: replays agree
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out.float(), ref, torch.bfloat16)


def test_supports_the_engine_formats_only():
    key = QuantSpec(bits=3, axis="channel", head_dim=128, page_size=128)
    value = QuantSpec(bits=3, axis="token", head_dim=128, page_size=128, outlier_capacity=41)
    assert lowbit_decode.supports(key, value, 128)
    assert not lowbit_decode.supports(key, value, 64)
    assert not lowbit_decode.supports(QuantSpec(bits=3, axis="channel", head_dim=64, page_size=128),
                                      QuantSpec(bits=3, axis="token", head_dim=64, page_size=128), 64)
    assert not lowbit_decode.supports(QuantSpec(bits=4, axis="channel", head_dim=128, page_size=128), value, 128)
    assert not lowbit_decode.supports(QuantSpec(bits=3, axis="token", head_dim=128, page_size=128), value, 128)
    assert not lowbit_decode.supports(QuantSpec(bits=3, axis="channel", head_dim=128, page_size=64),
                                      QuantSpec(bits=3, axis="token", head_dim=128, page_size=64), 128)
    assert not lowbit_decode.supports(key, QuantSpec(bits=3, axis="token", head_dim=128, page_size=128,
                                                     group_size=64), 128)


def test_runs_on():
    cpu, staging = torch.zeros(1, 4, 128), torch.zeros(2, 32, 4, 128)      # staging: [blocks, 32 | 64 | 128 rows, Hkv, D]
    assert not lowbit_decode.runs_on(cpu, staging)
    if torch.cuda.is_available():
        q, blocks = cpu.to("cuda", torch.bfloat16), staging.to("cuda", torch.bfloat16)
        assert lowbit_decode.runs_on(q, blocks) == (torch.cuda.get_device_capability()[0] >= 8)
        assert not lowbit_decode.runs_on(q, blocks[:, :16])                # 16-row blocks: not a staging size
        assert not lowbit_decode.runs_on(q, blocks.half())                 # another dtype than the query
        assert not lowbit_decode.runs_on(q, q.half())


@pytest.mark.parametrize("batch,heads,pages,sms,expect", [
    (32, 8, 128, 132, 2),       # 256 (sequence, kv head) pairs: two splits fill one wave of 4 CTAs per SM
    (8, 8, 256, 132, 8),        # 64 pairs: eight splits
    (128, 8, 128, 132, 1),      # the batch fills the GPU
    (1, 8, 128, 132, 16),       # B=1: at least MIN_PAGES_PER_SPLIT pages per split
    (1, 8, 1, 132, 1),          # never more splits than pages allow
    (1, 8, 1024, 132, 49),      # B=1 128k: few pairs, about 3 CTAs per SM (not a full wave of 66 splits)
    (1, 1, 4000, 132, 396),
    (2, 1, 9000, 4, 18),        # long contexts: at most TABLE_MAX pages per split
    (1, 1, 100000, 200, 512),   # at most MAX_SPLITS (the in-kernel combine's shared memory)
])
def test_plan_splits(batch, heads, pages, sms, expect):
    splits = lowbit_decode.plan_splits(batch, heads, pages, sms)
    assert splits == expect
    assert -(-pages // splits) <= lowbit_decode.TABLE_MAX


@pytest.mark.parametrize("batch,heads,splits,warps", [(1, 8, 16, 8), (1, 8, 17, 4), (32, 8, 2, 4), (2, 8, 8, 8),
                                                      (16, 1, 8, 8), (17, 1, 8, 4)])
def test_plan_warps(batch, heads, splits, warps):
    # 8 warps per CTA (when the small-batch build is chosen) exactly when every CTA has one of the 132 SMs to itself
    assert lowbit_decode.plan_warps(batch, heads, splits, 132, small_batch_warps=8) == warps
    assert lowbit_decode.plan_warps(batch, heads, splits, 132, small_batch_warps=4) == 4


def test_plan_chunk_split(monkeypatch):
    """One wave of 4 CTAs per SM (int4: 3) over the (sequence, kv head) pairs, at most 2 pages per split; none for GQA
    groups above 4, more than SMALL_PAIRS pairs or longer splits (CHUNK_SPLIT_MAX_PAGES 2: off, 0, by default since
    its B=1 16k loss, docs/attention-kernels.md item 6)."""
    assert lowbit_decode.plan_chunk_split(1, 8, 4, 16, 132) is None                # off by default
    monkeypatch.setattr(lowbit_decode, "CHUNK_SPLIT_MAX_PAGES", 2)
    assert lowbit_decode.plan_chunk_split(1, 8, 4, 128, 132) == (64, 2)           # B=1 16k: 66 CTAs a pair wanted
    assert lowbit_decode.plan_chunk_split(1, 8, 4, 16, 132) == (16, 1)            # B=1 2k: a page per split
    assert lowbit_decode.plan_chunk_split(1, 4, 4, 128, 132) == (128, 1)          # 4 kv heads: 132 CTAs a pair
    assert lowbit_decode.plan_chunk_split(2, 8, 4, 16, 132) == (16, 1)            # B=2 2k
    assert lowbit_decode.plan_chunk_split(2, 8, 4, 128, 132) is None               # B=2 16k: 4 pages a split
    assert lowbit_decode.plan_chunk_split(1, 8, 8, 16, 132) is None                # GQA group above 4
    assert lowbit_decode.plan_chunk_split(4, 8, 4, 16, 132) is None                # 32 pairs
    assert lowbit_decode.plan_chunk_split(1, 8, 4, 1024, 132) is None              # 16 pages per split
    assert lowbit_decode.plan_chunk_split(1, 8, 4, 128, 132, bits=4) is None       # int4: 49 CTAs, 3 pages a split


def test_warps_other_than_4_or_8_are_refused():
    case = build_case([300], [1], 1, 4, 128, 3, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="warps per CTA"):
        lowbit_decode.paged_attention_lowbit_decode(*case.args(), SCALE, warps=6)


@pytest.mark.parametrize("batch,pages,expect", [(32, 128, 4), (128, 128, 1), (1, 128, 16)])
def test_plan_splits_int4(batch, pages, expect):
    # int4 (3 CTAs per SM): two full waves (four splits at B=32 L=16k, 8 kv heads, 132 SMs)
    assert lowbit_decode.plan_splits(batch, 8, pages, 132, bits=4) == expect


def test_rejects_prefill_and_large_groups():
    from moekv.core.attention_metadata import AttentionMetadata

    case = build_case([300], [2], 1, 4, 128, 3, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="decode only"):
        lowbit_decode.paged_attention_lowbit_decode(*case.args(), SCALE)
    meta = AttentionMetadata.build([1], [300], case.meta.block_tables_host, 128, "cpu")
    q = torch.zeros(1, 16, 128, dtype=torch.bfloat16)
    kv = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    args = list(case.args())
    args[0], args[1], args[2], args[-1] = q, kv, kv, meta
    with pytest.raises(ValueError, match="GQA group"):
        lowbit_decode.paged_attention_lowbit_decode(*args, SCALE)


@needs_cuda
@pytest.mark.parametrize("staging_block", [32, 64])
@pytest.mark.parametrize("staging_only", [False, True])
@pytest.mark.parametrize("launch", [{"warps": 4}, {"warps": 8}, {"chunk_split": True}, {"work_split": True}],
                         ids=["w4", "w8", "chunk", "work"])
def test_staging_blocks_and_staging_only_ids(staging_block, staging_only, launch):
    # staging in shuffled blocks (a partial page holds only the blocks its rows need), the partial page as an id
    # beyond the low-bit pages (its low-bit prefetches read the last page's storage), sinks, lengths at block
    # boundaries; page-per-warp CTAs of 4 and 8 warps, chunk-split CTAs plain and with the work split
    for context, sinks in (([1, 31, 32, 33, 127, 128, 129, 300, 1000], 0), ([600, 129, 65], 1)):
        case = to_device(build_case(context, [1] * len(context), 2, 4, 128, 3, 128, dtype=torch.bfloat16,
                                    kind="spikes", outlier_fraction=0.0025, sink_pages=sinks, seed=staging_block,
                                    key_outlier_fraction=0.0, staging_block=staging_block,
                                    staging_only=staging_only), "cuda")
        _check(case, torch.bfloat16, **launch)


# ---- v15 work split (chunk-split CTAs whose splits cover equal work: docs/attention-kernels.md item 7)

def _visits(context, splits, tail_units, warps=4):
    """Every (page, chunk) the device plan's runs visit, and the splits' work (chunk units + the tail's S)."""
    P, C = lowbit_decode.PAGE_SIZE, lowbit_decode.CHUNKS
    full = context // P
    partial = context % P != 0
    chunks, tails, work = [], [], []
    for first, n, tail, runs in lowbit_decode.work_split_ranges(context, splits, tail_units, warps):
        assert n <= lowbit_decode.work_split_table_pages(-(-context // P), splits, tail_units)
        counts = []
        for jp0, k0, k1, my_n in runs:
            own = 0
            for jj in range(my_n):
                index = jp0 + jj
                assert 0 <= index < n
                page = first + index
                kbeg, kend = (k0 if jj == 0 else 0), (k1 if jj == my_n - 1 else C)
                assert 0 <= kbeg < kend <= C
                if partial and page == full:          # the partly filled page: visited whole, once, last of its run
                    assert (kbeg, kend, jj) == (0, C, my_n - 1) and tail and index == n - 1
                    tails.append(page)
                else:
                    assert page < full
                    chunks += [(page, k) for k in range(kbeg, kend)]
                    own += kend - kbeg
            counts.append(own)
        assert max(counts) - min(counts) <= 1           # the split's chunks evenly over its warps
        work.append(sum(counts) + (tail_units if tail else 0))
    return chunks, tails, work


@pytest.mark.parametrize("tail_units", [1, 3, 4, 12, 100])
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 7, 8, 16, 64])
def test_work_split_ranges_cover_every_chunk_once(tail_units, splits):
    """The device plan (mirrored on the host): every chunk of every full page in exactly one warp's run, the partly
    filled page visited once (whole, by the last warp of the split holding its first unit), each split's work within
    S - 1 units of an even share, tables within work_split_table_pages."""
    P, C = lowbit_decode.PAGE_SIZE, lowbit_decode.CHUNKS
    for context in [0, 1, 31, 127, 128, 129, 255, 256, 257, 383, 1000, 2047, 2048, 2049, 4095, 16383, 16384, 32767]:
        chunks, tails, work = _visits(context, splits, tail_units)
        full = context // P
        assert sorted(chunks) == [(page, k) for page in range(full) for k in range(C)]
        assert tails == ([full] if context % P else [])
        units = C * full + (tail_units if context % P else 0)
        assert sum(work) == units
        assert max(work, default=0) <= -(-units // splits) + tail_units - 1


def test_work_split_moves_chunks_off_the_tail_split():
    """B=32 16k (2 splits of 16383 tokens: 127 full pages + a staged tail): plain splits give the tail's split 63
    full pages + the tail; the work split (S = 12) gives it 4 x 127 + 12 = 520 / 2 units: 248 chunks (62 a warp) + the
    tail, the other 260 (65 a warp)."""
    plan = lowbit_decode.work_split_ranges(16383, 2, 12)
    (first0, n0, tail0, runs0), (first1, n1, tail1, runs1) = plan
    assert (first0, n0, tail0) == (0, 65, False) and (first1, n1, tail1) == (65, 63, True)
    assert [r[3] for r in runs0] == [17, 17, 17, 17]          # 65 chunks a warp, runs start and end mid-page
    assert runs1[-1] == (46, 2, 4, 17)           # the last warp: 62 chunks (from page 46, chunk 2) + the tail
    assert lowbit_decode.work_split_ranges(16384, 2, 12)[1][2] is False   # no partly filled page: plain halves


def test_work_tail_units():
    assert lowbit_decode.work_tail_units(None) == lowbit_decode.work_tail_units(False) == 0
    assert lowbit_decode.work_tail_units(0) == 0
    assert lowbit_decode.work_tail_units(True) == lowbit_decode.WORK_SPLIT_TAIL_UNITS == 12
    assert lowbit_decode.work_tail_units(3) == 3
    for bad in (-1, 2.5, 4 * lowbit_decode.TABLE_MAX + 1):
        with pytest.raises(ValueError, match="work_split"):
            lowbit_decode.work_tail_units(bad)
    assert lowbit_decode.WORK_SPLIT is False                   # the planner switch: off until a GPU A/B


def test_plan_work_split():
    """The planner switch (WORK_SPLIT, off): on, it takes batches of more than SMALL_PAIRS pairs that chunk-split
    CTAs can run (B=8 and B=32 with 8 kv heads), not B=1 / B=2, GQA groups above 4, chunk_split=False or 8 warps."""
    plan = lowbit_decode.plan_work_split
    assert not plan(32, 8, 4)                                   # the switch is off
    assert plan(32, 8, 4, switch=True) and plan(8, 8, 4, switch=True) and plan(8, 8, 1, None, 4, switch=True)
    assert not plan(2, 8, 4, switch=True) and not plan(1, 8, 4, switch=True)
    assert not plan(32, 8, 8, switch=True)
    assert not plan(32, 8, 4, chunk_split=False, switch=True) and not plan(32, 8, 4, warps=8, switch=True)


def test_work_split_table_pages():
    # 128 pages (the tail counted whole) in 2 splits with S = 12: 262 units span at most 67 pages, + the tail
    assert lowbit_decode.work_split_table_pages(128, 2, 12) == 68
    assert lowbit_decode.work_split_table_pages(1, 7, 12) == 3


def test_work_split_refusals():
    """The work split runs on chunk-split CTAs: refused with chunk_split=False, 8 warps or GQA groups above 4."""
    case = build_case([300], [1], 1, 4, 128, 3, 128, dtype=torch.bfloat16)
    for kwargs in ({"chunk_split": False}, {"warps": 8}):
        with pytest.raises(ValueError, match="chunk-split CTAs"):
            lowbit_decode.paged_attention_lowbit_decode(*case.args(), SCALE, work_split=True, **kwargs)
    wide = build_case([300], [1], 1, 8, 128, 3, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="GQA groups <= 4"):
        lowbit_decode.paged_attention_lowbit_decode(*wide.args(), SCALE, work_split=3)
    with pytest.raises(ValueError, match="work_split"):
        lowbit_decode.paged_attention_lowbit_decode(*case.args(), SCALE, work_split=-2)


@needs_cuda
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("splits", [None, 1, 3, 7, 16])
@pytest.mark.parametrize("key_fraction", [0.0, None])
def test_work_split(bits, splits, key_fraction):
    """Work-split chunk-split CTAs: ragged lengths with tails at page boundaries (P - 1, P, P + 1, 2P, 2P + 1, 16P
    + 1), a staged sink page, planned and forced splits; the partly filled page visited (last) by one warp of the
    split holding its first work unit, splits past the work empty."""
    case = _case([1, 127, 128, 129, 255, 256, 257, 300, 1000, 2048, 2049], bits=bits, sinks=1, seed=60 + bits,
                 key_fraction=key_fraction)
    _check(case, torch.bfloat16, num_splits=splits, work_split=True)


@needs_cuda
@pytest.mark.parametrize("tail_units", [1, 3, 4, 12, 40, 2048])
@pytest.mark.parametrize("fixed", [False, True])
def test_work_split_tail_units(tail_units, fixed):
    """Any S: a large one leaves the partly filled page's split without full pages (a table of one staged page) and
    the later splits empty; splits sized on the host (bf16) or on the device (fp16; as a CUDA-graph bucket launches
    them)."""
    dtype = torch.float16 if fixed else torch.bfloat16
    case = _case([2049, 2048, 2177, 127, 1, 640], seed=70 + tail_units, sinks=0, dtype=dtype)
    if fixed:
        case.meta.fixed_num_splits = 5
    _check(case, dtype, work_split=tail_units, chunk_split=True, **({} if fixed else {"num_splits": 5}))


@needs_cuda
@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("sinks", [0, 1])
def test_work_split_batches(batch, sinks):
    """B=8 and B=32 with 8 kv heads (the target table's pair counts) over ragged lengths around page boundaries:
    planned, forced and device-sized (graph bucket) splits."""
    lengths = [1, 127, 128, 129, 255, 256, 257, 1025] if batch == 8 else [1, 127, 128, 129, 255, 256, 257, 600]
    case = _case((lengths * 4)[:batch], seed=80 + batch + sinks, sinks=sinks, num_kv_heads=8, key_fraction=0.0)
    for kwargs in ({}, {"num_splits": 2}, {"num_splits": 8}):
        _check(case, torch.bfloat16, work_split=True, **kwargs)
    case.meta.fixed_num_splits = lowbit_decode.graph_split_count(batch, 8, 9, 132)
    _check(case, torch.bfloat16, work_split=True)


@needs_cuda
@pytest.mark.parametrize("batch,length", [(8, 32768), (32, 16384)])
def test_work_split_target_shapes(batch, length):
    """The target table's B=8 32k and B=32 16k as bench_attention builds them (length - 1 tokens: 255 / 127 full
    pages and a 127-token staged tail): plain and work-split chunk-split CTAs at the planned splits and a graph
    bucket's, against the reference."""
    from benchmarks import attention_setup as setup

    args, _ = setup.build_lowbit(batch, length, 3, torch.Generator().manual_seed(0))
    ref = reference.paged_attention_lowbit(*args, SCALE).float()
    for kwargs in ({"chunk_split": True}, {"work_split": True}, {"work_split": 3}):
        _assert_close(lowbit_decode.paged_attention_lowbit_decode(*args, SCALE, **kwargs).float(), ref,
                      torch.bfloat16)
    args[-1].fixed_num_splits = lowbit_decode.graph_splits(batch, setup.HKV, length, args[0].device)
    _assert_close(lowbit_decode.paged_attention_lowbit_decode(*args, SCALE, work_split=True).float(), ref,
                  torch.bfloat16)

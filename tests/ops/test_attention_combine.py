"""Full-precision decode attention with the split combine inside the decode launch (`combine=True`,
KernelConfig.fused_attention_combine): the last program of each (sequence, kv head) to arrive merges the splits.

Checked against the reference (ragged lengths, length 1, page boundaries, many splits, GQA groups 1 / 4 / 8,
fp16 / bf16), against the two-launch path, over repeated calls (bit-identical), with the arrival counters zero
after every call, and through ops.dispatch's switch. Under Triton's CPU interpreter the atomic path runs for
real (counting, the last program's combine, the reset), but one program at a time in grid order; the race
between concurrent arrivals and the memory ordering exist only on a GPU, where the tests marked `needs_cuda`
run them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekv.ops import dispatch
from moekv.ops.reference.attention import paged_attention_full_precision as reference
from moekv.ops.triton.attention import decode, split_k
from moekv.testing.attention_cases import build_fp_case
from tests.ops.helpers import assert_close

SCALE = 0.125
# context lengths (+1 new token each): 1 token, a page exactly, one past a page, two pages, ragged long ones
CONTEXTS = [0, 15, 16, 31, 150, 61]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="concurrent split arrivals and their memory ordering need a GPU: the CPU "
                                       "interpreter runs programs one at a time in grid order (split S-1 always "
                                       "arrives last and nothing overlaps)")


def _case(device, dtype=torch.float32, group=4, contexts=CONTEXTS, num_kv_heads=2, head_dim=64, seed=0):
    return build_fp_case(contexts, [1] * len(contexts), num_kv_heads, group, head_dim, 16, dtype, device, seed=seed)


def _decode(case, num_splits, combine, device_splits=False, config=None):
    query, key_pages, value_pages, meta = case
    return decode.paged_decode_full_precision(query, key_pages, value_pages, meta.block_tables, meta.seq_lens,
                                              0 if device_splits else meta.max_seq_len, SCALE,
                                              num_splits=num_splits, config=config, device_splits=device_splits,
                                              combine=combine)


def _counters(device) -> torch.Tensor:
    return split_k.arrival_counters(torch.device(device), 0)


@pytest.fixture
def no_second_launch(monkeypatch):
    """Fail the test if the two-launch combine runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("combine_splits launched although the decode kernel combines")
    monkeypatch.setattr(decode, "combine_splits", refuse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits,device_splits", [(3, False), (12, True)])
def test_matches_reference(device, no_second_launch, dtype, group, num_splits, device_splits):
    case = _case(device, dtype, group, seed=group)
    out = _decode(case, num_splits, combine=True, device_splits=device_splits)
    assert_close(out, reference(*case, SCALE), dtype)
    assert _counters(device).count_nonzero().item() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_many_nonempty_splits_head_dim_128(device, no_second_launch, dtype):
    # 16-token blocks: the 151-token sequence fills 10 splits, the 1-token one leaves 9 of them empty
    case = _case(device, dtype, group=8, contexts=[150, 0, 47], head_dim=128, seed=3)
    out = _decode(case, 10, combine=True, config={"BLOCK_N": 16})
    assert_close(out, reference(*case, SCALE), dtype)
    assert _counters(device).count_nonzero().item() == 0


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("device_splits", [False, True])
def test_one_and_two_launch_agree(device, dtype, rtol, device_splits):
    # same partials, same weights; only the order of the fp32 sum over splits differs (a loop here, a tree
    # reduction in combine_splits): fp32 agrees to ~1 ulp, 16-bit outputs to at most one ulp of their dtype
    case = _case(device, dtype, group=4, seed=5)
    one = _decode(case, 6, combine=True, device_splits=device_splits)
    two = _decode(case, 6, combine=False, device_splits=device_splits)
    torch.testing.assert_close(one.float(), two.float(), rtol=rtol, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the two kernels' fp32 sums may reduce in different "
                    "orders (their register layouts differ); test_one_and_two_launch_agree bounds that to one ulp")
def test_one_chunk_is_combine_splits_arithmetic():
    # up to BLOCK_SC splits the in-kernel combine does combine_splits' operations in the same order
    case = _case("cpu", torch.float32, group=4, seed=13)
    assert torch.equal(_decode(case, 7, combine=True), _decode(case, 7, combine=False))


@pytest.mark.parametrize("num_splits", [7, 12])
def test_combine_in_chunks(device, monkeypatch, no_second_launch, num_splits):
    # 2 splits per round trip (COMBINE_TILE 128 at head dim 64): the running maximum rescales across chunks,
    # the last chunk is partly masked (7), chunks past a short sequence's end hold only empty splits (12)
    monkeypatch.setattr(split_k, "COMBINE_TILE", 128)
    assert split_k.combine_chunk(64, num_splits) == 2
    case = _case(device, torch.float32, group=4, seed=14)
    out = _decode(case, num_splits, combine=True, device_splits=True)
    assert_close(out, reference(*case, SCALE), torch.float32)
    monkeypatch.undo()
    two = _decode(case, num_splits, combine=False, device_splits=True)
    torch.testing.assert_close(out, two, rtol=1e-6, atol=1e-6)


def test_combine_chunk_sizes():
    assert split_k.combine_chunk(128, 64) == 32 and split_k.combine_chunk(64, 64) == 64
    assert split_k.combine_chunk(128, 5) == 8 and split_k.combine_chunk(128, 1) == 2
    assert split_k.combine_chunk(80, 100) == 32                     # head dims pad to a power of two


def test_repeated_calls_are_bit_identical_and_leave_the_counters_zero(device):
    case = _case(device, torch.bfloat16, group=4, seed=6)
    first = _decode(case, 8, combine=True, device_splits=True)
    for _ in range(3):
        assert torch.equal(_decode(case, 8, combine=True, device_splits=True), first)
        assert _counters(device).count_nonzero().item() == 0


def test_one_split_stores_directly(device, no_second_launch):
    # a batch that fills the GPU gets one split: no partials, no counters, no combine of either kind
    case = _case(device, torch.float16, seed=7)
    out = _decode(case, 1, combine=True)
    assert_close(out, reference(*case, SCALE), torch.float16)
    assert torch.equal(out, _decode(case, 1, combine=False))


def test_a_stale_counter_moves_the_combine(device):
    # the counters decide who combines: one left at 1 makes split S-2 combine (early) and the launch leaves it
    # at 1 again -- why every launch must end with them zero
    case = _case(device, torch.float32, seed=8)
    good = _decode(case, 4, combine=True)
    counters = _counters(device)
    try:
        counters[0] = 1                                   # (sequence 0, kv head 0)
        _decode(case, 4, combine=True)
        assert counters[0].item() == 1 and counters[1:].count_nonzero().item() == 0
    finally:
        counters.zero_()
    assert torch.equal(_decode(case, 4, combine=True), good)


@pytest.mark.parametrize("fused", [True, False])
def test_dispatch_follows_the_switch(device, monkeypatch, fused):
    launches = []
    two_launch = decode.combine_splits
    monkeypatch.setattr(decode, "combine_splits", lambda *a: launches.append(1) or two_launch(*a))
    query, key_pages, value_pages, meta = _case(device, torch.float32, seed=9)
    meta = dataclasses.replace(meta, fixed_num_splits=5)
    with dispatch.override(backend="triton", fused_attention_combine=fused):
        out = dispatch.paged_attention_full_precision(query, key_pages, value_pages, meta, SCALE)
    assert_close(out, reference(query, key_pages, value_pages, meta, SCALE), torch.float32)
    assert len(launches) == (0 if fused else 1)


def test_arrival_counters_are_allocated_once_and_grow():
    device = torch.device("cpu")
    first = split_k.arrival_counters(device, 4)
    assert first.dtype == torch.int32 and first.numel() >= split_k.MIN_COUNTERS
    assert split_k.arrival_counters(device, 100) is first
    with torch.inference_mode():                         # an engine step asks first: still a plain tensor
        grown = split_k.arrival_counters(device, first.numel() + 1)
    assert grown.numel() == first.numel() + 1 and grown.count_nonzero().item() == 0
    assert not grown.is_inference()
    grown.zero_()
    assert any(t is first for t in split_k._RETIRED)      # graphs captured with the old buffer keep it
    assert split_k.arrival_counters(device, 4) is grown


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bounds checker patches Triton's CPU interpreter")
def test_no_access_outside_the_buffers():
    from tests.ops.interp_bounds import bounds_checked

    case = _case("cpu", torch.bfloat16, group=8, seed=10)
    with bounds_checked() as checker:
        _decode(case, 12, combine=True, device_splits=True)
        _decode(case, 3, combine=True)
    assert checker.launches == 2 and checker.checked_ops > 0 and not checker.violations


# -- GPU only: real concurrency -------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("num_splits", [16, 64])
def test_concurrent_arrivals_under_load(num_splits):
    # 3 x 8 (sequence, kv head) pairs x up to 64 splits in flight at once, lengths from 1 to 16k: every call
    # agrees bit for bit with the first, with the reference, and leaves the counters zero
    case = build_fp_case([16383, 4999, 0], [1, 1, 1], 8, 4, 128, 16, torch.bfloat16, "cuda", seed=11)
    expected = reference(*case, SCALE)
    first = _decode(case, num_splits, combine=True, device_splits=True)
    assert_close(first, expected, torch.bfloat16)
    for _ in range(50):
        assert torch.equal(_decode(case, num_splits, combine=True, device_splits=True), first)
    torch.cuda.synchronize()
    assert _counters("cuda").count_nonzero().item() == 0
    two = _decode(case, num_splits, combine=False, device_splits=True)
    torch.testing.assert_close(first.float(), two.float(), rtol=2 ** -7, atol=1e-6)


@needs_cuda
def test_graph_replays_reuse_the_counters():
    case = build_fp_case([3000, 700, 0, 129], [1, 1, 1, 1], 8, 4, 128, 16, torch.bfloat16, "cuda", seed=12)
    eager = _decode(case, 24, combine=True, device_splits=True)
    split_k.arrival_counters(torch.device("cuda"), 4 * 8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _decode(case, 24, combine=True, device_splits=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode(case, 24, combine=True, device_splits=True)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert _counters("cuda").count_nonzero().item() == 0


@needs_cuda
def test_growing_the_counters_inside_a_capture_is_an_error():
    needed = _counters("cuda").numel() + 1
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        with pytest.raises(RuntimeError, match="before capturing"):
            split_k.arrival_counters(torch.device("cuda"), needed)


def _ptxas_bundled() -> bool:
    import importlib.util
    import os

    spec = importlib.util.find_spec("triton.backends.nvidia")
    return spec is not None and os.path.exists(os.path.join(os.path.dirname(spec.origin), "bin", "ptxas"))


@pytest.mark.skipif(not _ptxas_bundled(), reason="Triton's NVIDIA backend (bundled ptxas) is not installed")
def test_sm90_lowering_orders_the_arrival():
    # what the interpreter cannot show: compiled for sm_90 (no GPU needed), the partial stores are fenced off by
    # a CTA barrier before the one-thread gpu-scope acq_rel add, a barrier follows it, the last program's reads
    # go to L2 (.cg) after that, and only then is the counter stored back to zero
    from tests.ops.ptx_compile import assert_last_arrival_order, ptx_in_child

    # both variants in one process (tests.ops.ptx_compile's compile_decode, as its --combine 1 / 0 would)
    fused, two_launch = ptx_in_child("[compile_decode(combine).asm['ptx'] for combine in (True, False)]")
    assert_last_arrival_order(fused)
    assert ".entry" in two_launch and "atom." not in two_launch   # the two-launch variant counts nothing

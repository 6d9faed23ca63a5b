"""The masked staged-page quantizer (decode step of the low-bit cache): Triton vs the reference, bit-exact
on the CPU interpreter, with skipped (-1) entries, outlier-heavy data and pages that must stay untouched.

Entry i quantizes staging slot slots[i] into page pages[i] of a layer's PackedPages, in place; page -1
skips the entry (qualifying 0, nothing written, its slot never read).
"""

from __future__ import annotations

import pytest
import torch

from moekv.core.lowbit_layout import PackedPages, QuantSpec
from moekv.ops import dispatch
from moekv.ops.reference import lowbit as reference
from moekv.ops.triton.lowbit import quantize as lowbit_quantize
from moekv.testing.attention_cases import make_data

NUM_PAGES, SLOTS, HEADS = 7, 5, 2


def junk_pages(spec: QuantSpec, device: str, seed: int) -> PackedPages:
    """PackedPages of NUM_PAGES pages filled with random bits (so a stray or missing write shows)."""
    gen = torch.Generator().manual_seed(seed)
    packed = PackedPages.empty(spec, NUM_PAGES, HEADS, "cpu")
    for t in packed.tensors().values():
        if t.dtype == torch.float16:
            t.copy_(torch.randn(t.shape, generator=gen))
        else:
            high = 256 if t.dtype == torch.uint8 else 1 << 15
            t.copy_(torch.randint(0, high, t.shape, generator=gen))
    return PackedPages(**{name: t.to(device) for name, t in packed.tensors().items()},
                       **({"scale_base": None} if packed.scale_base is None else {}))


def spiky(shape, dtype, seed: int) -> torch.Tensor:
    """Outlier-heavy rows: a few 50x channels plus ~4% scattered spikes (more than the budget holds)."""
    gen = torch.Generator().manual_seed(seed)
    x = make_data(shape, torch.float32, "outlier_channels", gen)
    spikes = torch.rand(shape, generator=gen) < 0.04
    return torch.where(spikes, x + 40.0 * torch.randn(shape, generator=gen), x).to(dtype)


def clone(packed: PackedPages) -> PackedPages:
    return PackedPages(**{name: t.clone() for name, t in packed.tensors().items()},
                       **({"scale_base": None} if packed.scale_base is None else {}))


def run_both(staging, slots, pages, spec, device, seed=0):
    """(reference out, reference qualifying, triton out, triton qualifying); the reference runs on the CPU."""
    start = junk_pages(spec, device, seed)
    want = PackedPages(**{name: t.cpu().clone() for name, t in start.tensors().items()},
                       **({"scale_base": None} if start.scale_base is None else {}))
    want_q = reference.quantize_staged_pages(staging.cpu(), slots.cpu(), pages.cpu(), spec, want)
    got = clone(start)
    got_q = lowbit_quantize.quantize_staged_pages(staging, slots.to(device), pages.to(device), spec, got)
    return start, want, want_q, got, got_q


@pytest.mark.parametrize("bits,axis,group_size", [(4, "channel", None), (3, "channel", None), (2, "token", None),
                                                  (3, "token", 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_matches_reference_with_skipped_entries(device, bits, axis, group_size, dtype):
    spec = QuantSpec(bits=bits, axis=axis, head_dim=64, page_size=16, group_size=group_size,
                     outlier_capacity=QuantSpec.capacity_for(0.02, 16, 64))          # 21 slots: budget binds
    staging = spiky((SLOTS, 16, HEADS, 64), dtype, bits).to(device)                # [S, P, H, D]
    pages = torch.tensor([3, -1, 0, -1, 6, -1])
    slots = torch.tensor([4, 2, 0, -1, 2, 3])            # a skipped entry's slot may be anything, even -1
    start, want, want_q, got, got_q = run_both(staging, slots, pages, spec, device, seed=bits)
    assert got_q.dtype == torch.int32 and got_q.shape == (6, HEADS)
    assert torch.equal(got_q.cpu(), want_q)
    assert (want_q[pages < 0] == 0).all() and (want_q[pages >= 0] > 0).all()       # outliers qualified
    exact = device == "cpu" or axis == "channel"      # token axis on a GPU: exp2/log2 may differ in the last ulp
    untouched = [p for p in range(NUM_PAGES) if p not in (3, 0, 6)]
    for name, want_t in want.tensors().items():
        got_t = got.tensors()[name].cpu()
        assert got_t.dtype == want_t.dtype and got_t.shape == want_t.shape, name
        if exact:
            assert torch.equal(got_t, want_t), name
        assert torch.equal(got_t[untouched], start.tensors()[name].cpu()[untouched]), name
    if not exact:   # decodes within a quantization step of the reference (as tests/ops/test_lowbit_quantize.py)
        stored = [3, 0, 6]
        mine = PackedPages(**{n: t.cpu()[stored] for n, t in got.tensors().items()})
        theirs = PackedPages(**{n: t[stored] for n, t in want.tensors().items()})
        step = reference.token_scale_zero(theirs.scale, theirs.zero, theirs.scale_base, spec)[0]
        error = (reference.dequantize_pages(mine, spec) - reference.dequantize_pages(theirs, spec)).abs()
        assert (error <= 1.01 * step.repeat_interleave(spec.group_size, -1) + 1e-3).all()
    # the stored pages are exactly what quantize_pages makes of the slots' rows
    expected, _ = reference.quantize_pages(staging.cpu()[[4, 0, 2]].transpose(1, 2), spec)
    for name, t in expected.tensors().items():
        assert torch.equal(want.tensors()[name][[3, 0, 6]], t), name
    assert (want_q[pages >= 0] > spec.outlier_capacity).any()                        # outlier-heavy: the budget binds


def test_staged_all_skipped_writes_nothing(device):
    spec = QuantSpec(bits=3, axis="channel", head_dim=32, page_size=16, outlier_capacity=4)
    staging = make_data((SLOTS, 16, HEADS, 32), torch.float32, "normal", torch.Generator().manual_seed(1)).to(device)
    pages = torch.full((4,), -1, dtype=torch.long)
    start, want, want_q, got, got_q = run_both(staging, torch.zeros(4, dtype=torch.long), pages, spec, device)
    assert not got_q.any() and not want_q.any()
    for name, t in got.tensors().items():
        assert torch.equal(t, start.tensors()[name]), name


def test_staged_int32_indices_and_dispatch(device, triton_backend):
    spec = QuantSpec(bits=2, axis="token", head_dim=32, page_size=16, outlier_capacity=10)
    staging = spiky((SLOTS, 16, HEADS, 32), torch.float32, 5).to(device)
    pages = torch.tensor([-1, 5, 1], dtype=torch.int32, device=device)
    slots = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    got = junk_pages(spec, device, 2)
    got_q = dispatch.quantize_staged_pages(staging, slots, pages, spec, got)
    with dispatch.override(backend="reference"):
        want = junk_pages(spec, device, 2)
        want_q = dispatch.quantize_staged_pages(staging, slots, pages, spec, want)
        assert torch.equal(got_q, want_q)
        if device == "cpu":
            for name, t in want.tensors().items():
                assert torch.equal(got.tensors()[name], t), name


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_staged_blocks_match_whole_page_staging(device, block, axis):
    # the same pages staged in shuffled blocks of `block` rows ([B, P / block] block ids per entry): the same
    # codes as from whole staging pages, the reference and the kernel alike
    spec = QuantSpec(bits=3, axis=axis, head_dim=64, page_size=16, outlier_capacity=QuantSpec.capacity_for(0.02, 16, 64))
    staging = spiky((SLOTS, 16, HEADS, 64), torch.float32, 11)                     # [S, P, H, D]
    per_page = 16 // block
    order = torch.randperm(SLOTS * per_page, generator=torch.Generator().manual_seed(block))
    blocks = torch.empty((SLOTS * per_page, block, HEADS, 64))
    blocks[order] = staging.reshape(SLOTS * per_page, block, HEADS, 64)          # block j of slot s -> order[s*nb+j]
    pages = torch.tensor([3, -1, 0, 6])
    slots = torch.tensor([4, 2, 0, 1])
    entry_blocks = order.view(SLOTS, per_page)[slots]
    entry_blocks[1] = -1                                                            # skipped: never read
    _, want, want_q, _, _ = run_both(staging.to(device), slots, pages, spec, device, seed=3)
    _, got_ref, got_ref_q, got, got_q = run_both(blocks.to(device), entry_blocks, pages, spec, device, seed=3)
    assert torch.equal(got_ref_q, want_q) and torch.equal(got_q.cpu(), want_q)
    exact = device == "cpu" or axis == "channel"
    for name, want_t in want.tensors().items():
        assert torch.equal(got_ref.tensors()[name], want_t), name
        if exact:
            assert torch.equal(got.tensors()[name].cpu(), want_t), name

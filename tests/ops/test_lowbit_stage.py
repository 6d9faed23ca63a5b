"""The decode step's staging write (ops.triton.lowbit.stage) against the reference: finiteness flags,
zeroed rows, staging rows and the returned copies; plus the counted staged quantizer (statistics added
to int64 counters by the kernel) against the reference's counts."""

from __future__ import annotations

import pytest
import torch

from moekv.core.lowbit_layout import QuantSpec
from moekv.ops import dispatch
from moekv.ops.reference import lowbit as reference
from moekv.ops.triton.lowbit import quantize as lowbit_quantize
from moekv.ops.triton.lowbit import stage as lowbit_stage
from tests.ops.test_quantize_staged import HEADS, SLOTS, clone, junk_pages, spiky

PAGE = 16


def state(batch, heads, dim, dtype, device, seed, staging_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    value = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    staging_dtype = staging_dtype or dtype
    staging_keys = torch.randn(SLOTS, PAGE, heads, dim, generator=gen).to(staging_dtype)
    staging_values = torch.randn(SLOTS, PAGE, heads, dim, generator=gen).to(staging_dtype)
    flags = torch.zeros(batch, dtype=torch.bool)
    return [t.to(device) for t in (key, value, staging_keys, staging_values, flags)]


def run(fn, key, value, staging_keys, staging_values, rows, flags):
    staging_keys, staging_values, flags = staging_keys.clone(), staging_values.clone(), flags.clone()
    key_out = torch.full_like(key, 7.0)
    value_out = torch.full_like(value, 7.0)
    k, v = fn(key, value, staging_keys, staging_values, rows, flags, key_out, value_out)
    assert k.data_ptr() == key_out.data_ptr() and v.data_ptr() == value_out.data_ptr()
    return k, v, staging_keys, staging_values, flags


def check_same(key, value, staging_keys, staging_values, rows, flags):
    want = run(reference.stage_decode_tokens, key, value, staging_keys, staging_values, rows, flags)
    got = run(lowbit_stage.stage_decode_tokens, key, value, staging_keys, staging_values, rows, flags)
    for name, w, g in zip(("key", "value", "staging_keys", "staging_values", "flags"), want, got):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stage_matches_reference_with_non_finite_tokens(device, dtype):
    batch, heads, dim = 5, 3, 32                          # 3 heads: a masked (non power of two) head block
    key, value, staging_keys, staging_values, flags = state(batch, heads, dim, dtype, device, 0)
    key[1, 2, 5] = float("nan")                           # one element of one head
    value[3, 0, 31] = float("inf")
    value[4, 1, 0] = float("-inf")
    flags[0] = True                                       # set flags stay set (OR)
    rows = torch.tensor([0 * PAGE + 3, 2 * PAGE + 15, 1 * PAGE, 4 * PAGE + 7, 3 * PAGE + 1], device=device)
    k, v, sk, sv, f = check_same(key, value, staging_keys, staging_values, rows, flags)
    assert f.tolist() == [True, True, False, True, True]
    assert not k[[1, 3, 4]].any() and not v[[1, 3, 4]].any()       # both rows zeroed when either is bad
    assert torch.equal(k[[0, 2]], key[[0, 2]]) and torch.equal(v[[0, 2]], value[[0, 2]])
    flat_k, flat_v = sk.view(-1, heads, dim), sv.view(-1, heads, dim)
    assert torch.equal(flat_k[rows], k) and torch.equal(flat_v[rows], v)
    untouched = torch.ones(SLOTS * PAGE, dtype=torch.bool)
    untouched[rows.cpu()] = False
    untouched = untouched.to(device)
    assert torch.equal(flat_k[untouched], staging_keys.view(-1, heads, dim)[untouched])
    assert torch.equal(flat_v[untouched], staging_values.view(-1, heads, dim)[untouched])


def test_stage_padded_rows_share_a_staging_row(device):
    batch, heads, dim = 4, 2, 64
    key, value, staging_keys, staging_values, flags = state(batch, heads, dim, torch.float32, device, 1)
    value[3, 1, 9] = float("nan")                         # a padding row that shares the scratch row
    rows = torch.tensor([5, 2 * PAGE, 2 * PAGE, 2 * PAGE], device=device)
    got = run(lowbit_stage.stage_decode_tokens, key, value, staging_keys, staging_values, rows, flags)
    want = run(reference.stage_decode_tokens, key, value, staging_keys, staging_values, rows, flags)
    for i in (0, 1):                                      # the returned rows are exact
        assert torch.equal(got[i], want[i])
    assert torch.equal(got[4], want[4]) and got[4].tolist() == [False, False, False, True]
    shared_k = got[2].view(-1, heads, dim)[2 * PAGE]
    shared_v = got[3].view(-1, heads, dim)[2 * PAGE]
    assert any(torch.equal(shared_k, got[0][i]) and torch.equal(shared_v, got[1][i]) for i in (1, 2, 3))
    assert torch.equal(got[2].view(-1, heads, dim)[5], got[0][0])


def test_stage_single_token_mixed_dtypes_and_strided_input(device):
    heads, dim = 2, 32
    key, value, staging_keys, staging_values, flags = state(1, heads, dim, torch.bfloat16, device, 2,
                                                            staging_dtype=torch.float32)
    check_same(key, value, staging_keys, staging_values, torch.tensor([SLOTS * PAGE - 1], device=device), flags)
    qkv = torch.randn(3, 1, heads * 2, dim, device=device)                   # key/value: strided views
    key, value = qkv[1, :, :heads], qkv[2, :, heads:]
    key[0, 1, 0] = float("inf")
    _, _, staging_keys, staging_values, flags = state(1, heads, dim, torch.float32, device, 3)
    k, v, _, _, f = check_same(key, value, staging_keys, staging_values, torch.tensor([17], device=device), flags)
    assert f.tolist() == [True] and not k.any() and not v.any()


def test_stage_dispatch(device, triton_backend):
    key, value, staging_keys, staging_values, flags = state(2, HEADS, 32, torch.float32, device, 4)
    key[0, 0, 0] = float("nan")
    rows = torch.tensor([1, PAGE], dtype=torch.int32, device=device)
    got = run(dispatch.stage_decode_tokens, key, value, staging_keys, staging_values, rows, flags)
    with dispatch.override(backend="reference"):
        want = run(dispatch.stage_decode_tokens, key, value, staging_keys, staging_values, rows, flags)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@pytest.mark.parametrize("bits,axis,capacity", [(3, "channel", 21), (2, "token", 10), (4, "channel", 0)])
def test_counted_staged_quantizer_matches_reference(device, bits, axis, capacity):
    spec = QuantSpec(bits=bits, axis=axis, head_dim=32, page_size=PAGE, outlier_capacity=capacity)
    staging = spiky((SLOTS, PAGE, HEADS, 32), torch.float32, bits).to(device)
    pages = torch.tensor([3, -1, 0, 3, -1])               # page 3 twice (same slot): counted twice
    slots = torch.tensor([4, -1, 0, 4, 2])
    want = junk_pages(spec, "cpu", 1)
    got = clone(junk_pages(spec, device, 1))
    want_counters = torch.arange(7, dtype=torch.int64)
    got_counters = want_counters.clone().to(device)
    reference.quantize_staged_pages_counted(staging.cpu(), slots, pages, spec, want, want_counters, 1, 3, 5, 0)
    lowbit_quantize.quantize_staged_pages_counted(staging, slots.to(device), pages.to(device), spec, got,
                                                  got_counters, 1, 3, 5, 0)
    assert torch.equal(got_counters.cpu(), want_counters)
    assert want_counters[0] == 0 + 3 * HEADS and want_counters[[2, 4, 6]].tolist() == [2, 4, 6]
    if device == "cpu" or axis == "channel":
        for name, t in want.tensors().items():
            if name == "outlier_count" and capacity == 0:
                continue        # no outlier slots: the kernel leaves the (never read) counts alone
            assert torch.equal(got.tensors()[name].cpu(), t), name
    # without a page counter (the value pass), and everything skipped: nothing moves
    counters = torch.zeros(7, dtype=torch.int64, device=device)
    lowbit_quantize.quantize_staged_pages_counted(staging, slots.to(device), pages.to(device), spec, got,
                                                  counters, 2, 4, 6)
    assert counters[[0, 1, 3, 5]].tolist() == [0, 0, 0, 0] and counters[6] == want_counters[5] - 5
    lowbit_quantize.quantize_staged_pages_counted(staging, slots.to(device), torch.full_like(pages, -1).to(device),
                                                  spec, got, counters, 2, 4, 6)
    assert counters[6] == want_counters[5] - 5


@pytest.mark.parametrize("key_axis", ["channel", "token"])
def test_one_launch_key_value_quantizer_matches_reference(device, key_axis):
    key_spec = QuantSpec(bits=3, axis=key_axis, head_dim=32, page_size=PAGE, outlier_capacity=8)
    value_spec = QuantSpec(bits=3, axis="token", head_dim=32, page_size=PAGE, outlier_capacity=10)
    staging_keys = spiky((SLOTS, PAGE, HEADS, 32), torch.float32, 7).to(device)
    staging_values = spiky((SLOTS, PAGE, HEADS, 32), torch.float32, 8).to(device)
    pages = torch.tensor([-1, 5, -1, 1, 5])
    slots = torch.tensor([0, 3, -1, 2, 3])
    want = [junk_pages(spec, "cpu", seed) for seed, spec in ((3, key_spec), (4, value_spec))]
    got = [clone(junk_pages(spec, device, seed)) for seed, spec in ((3, key_spec), (4, value_spec))]
    want_counters = torch.zeros(7, dtype=torch.int64)
    got_counters = want_counters.clone().to(device)
    indices = ((1, 3, 5, 0), (2, 4, 6, -1))
    reference.quantize_staged_kv_counted(staging_keys.cpu(), staging_values.cpu(), slots, pages, key_spec, value_spec,
                                         *want, want_counters, *indices)
    lowbit_quantize.quantize_staged_kv_counted(staging_keys, staging_values, slots.to(device), pages.to(device),
                                               key_spec, value_spec, *got, got_counters, *indices)
    assert torch.equal(got_counters.cpu(), want_counters) and want_counters[0] == 3 * HEADS
    assert want_counters[1] > 0 and want_counters[3] > 0 and want_counters[4] > 0
    if device == "cpu" or (key_axis == "channel"):
        for mine, theirs in zip(got[:1] if device != "cpu" else got, want):
            for name, t in theirs.tensors().items():
                assert torch.equal(mine.tensors()[name].cpu(), t), name
    # the dispatch (reference backend: two counted calls) agrees too
    again = [clone(junk_pages(spec, device, seed)) for seed, spec in ((3, key_spec), (4, value_spec))]
    counters = torch.zeros(7, dtype=torch.int64, device=device)
    with dispatch.override(backend="reference"):
        dispatch.quantize_staged_kv_counted(staging_keys, staging_values, slots.to(device), pages.to(device), key_spec,
                                            value_spec, *again, counters, *indices)
    assert torch.equal(counters.cpu(), want_counters)

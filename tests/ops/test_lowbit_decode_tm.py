"""Token-major low-bit decode kernel (ops.triton.lowbit.decode_tm, v6) vs the PyTorch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from moekv.core.lowbit_pack import pack_codes, words_per_row
from moekv.ops.reference.lowbit import paged_attention_lowbit as reference
from moekv.ops.triton.lowbit.decode_tm import paged_attention_lowbit_decode_tm as kernel
from moekv.ops.triton.lowbit.decode_tm import supports
from moekv.ops.triton.lowbit.decode_tm_parts import channels, columns, load_words, row_tokens, unpack
from moekv.testing.attention_cases import build_case, to_device
from tests.ops.helpers import assert_close
from tests.ops.interp_bounds import bounds_checked

SCALE = 0.125
DECODE = dict(context_lens=[0, 1, 40, 100], query_lens=[1, 1, 1, 1])   # empty, tiny, ragged, several pages


@pytest.fixture(params=["dot", "scatter", "passes"])
def outliers(request):
    """The three outlier paths: exact 0/1 dots, fp32 atomics through the per-program scratch, and passes of
    their own before and after the attention (lowbit_decode_fix.py)."""
    return request.param


def check(case, dtype, **overrides):
    assert_close(kernel(*case.args(), SCALE, **overrides), reference(*case.args(), SCALE), dtype)


def plant_outliers(pages, spec, seed: int, value_scale: float, max_count: int | None = None) -> None:
    """Overwrite the outlier slots of every (page, head) with hard patterns, sorted by index as the format
    requires: one token with an outlier in every channel, one channel with an outlier at every token (the same
    correction row many times), then random slots; counts 0, the full capacity and odd counts in between.
    Residuals: normal times value_scale (the format allows any fp16)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages, heads, capacity = pages.outlier_idx.shape
    size, dim = spec.page_size, spec.head_dim
    for page in range(num_pages):
        for head in range(heads):
            token = int(torch.randint(size, (1,), generator=gen))
            channel = int(torch.randint(dim, (1,), generator=gen))
            ordered = torch.cat([token * dim + torch.arange(dim), torch.arange(size) * dim + channel,
                                 torch.randperm(size * dim, generator=gen)]).tolist()
            chosen = list(dict.fromkeys(ordered))                                    # distinct, first kept
            count = [0, capacity, max(capacity // 2 - 3, 1), min(capacity, 2 * dim + 1)][(page * heads + head) % 4]
            count = min(count, capacity if max_count is None else max_count)
            idx = torch.zeros(capacity, dtype=torch.int64)
            idx[:count] = torch.tensor(sorted(chosen[:count]), dtype=torch.int64)
            vals = torch.zeros(capacity)
            vals[:count] = torch.randn(count, generator=gen) * value_scale
            pages.outlier_idx[page, head] = torch.where(idx >= 1 << 15, idx - (1 << 16), idx).to(torch.int16)
            pages.outlier_vals[page, head] = vals.clamp(-65504, 65504).to(torch.float16)
            pages.outlier_count[page, head] = count


@triton.jit
def _unpack_kernel(codes, out, BITS: tl.constexpr, WORDS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, WARPS: tl.constexpr, CODES: tl.constexpr):
    lo, hi = load_words(codes, 0, 0, BITS, WORDS, BLOCK_N, HEAD_DIM, BLOCK_N)
    tile = unpack(lo, hi, BITS, CODES, HEAD_DIM, BLOCK_N, WARPS).to(tl.float32)
    rows = row_tokens(tl.arange(0, BLOCK_N), BLOCK_N, WARPS)
    cols = channels(tl.arange(0, HEAD_DIM), BITS, HEAD_DIM)
    tl.store(out + rows[:, None] * HEAD_DIM + cols[None, :], tile)
    tl.store(out + BLOCK_N * HEAD_DIM + tl.arange(0, HEAD_DIM), columns(cols, BITS, HEAD_DIM).to(tl.float32))


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_n,warps", [(16, 4), (128, 4), (128, 8)])
def test_unpack_orders(device, bits, head_dim, block_n, warps):
    # the permuted tile holds every code exactly once, at (row_tokens(r), channels(c)); columns inverts channels
    codes = torch.randint(0, 2 ** bits, (1, 1, block_n, head_dim), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(bits * head_dim + block_n))
    packed = pack_codes(codes, bits).to(device)
    for mode in (0, 1, 2):
        out = torch.zeros(block_n + 1, head_dim, device=device)
        _unpack_kernel[(1,)](packed, out, bits, words_per_row(bits, head_dim), head_dim, block_n, warps, mode)
        tile = out[:block_n] * (2.0 ** 24 if mode == 2 else 1.0)
        assert torch.equal(tile.cpu(), codes[0, 0].float())
        assert torch.equal(out[block_n].cpu(), torch.arange(head_dim, dtype=torch.float32))


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "outlier_channels"), (torch.bfloat16, "outlier_channels"),
                                        (torch.float16, "normal"), (torch.float16, "large")])
def test_formats(device, bits, dtype, kind, outliers):
    # empty, length 1, ragged and several-page contexts; planted 50x channels / 1e4 values
    check(build_case(**DECODE, num_kv_heads=2, group=4, head_dim=64, bits=bits, page_size=16, dtype=dtype,
                     kind=kind, device=device), dtype, outliers=outliers)


@pytest.mark.parametrize("bits,dtype", [(3, torch.bfloat16), (4, torch.float32), (2, torch.float16)])
def test_head_dim_128(device, bits, dtype, outliers):
    check(build_case([5, 33], [1, 1], 2, 4, 128, bits, 16, dtype=dtype, kind="outlier_channels", seed=1,
                     device=device), dtype, outliers=outliers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_values(device, dtype, outliers):
    check(build_case([50, 17], [1, 1], 2, 4, 64, 3, 16, dtype=dtype, kind="large", seed=2, device=device), dtype,
          outliers=outliers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_axis_keys(device, dtype, outliers):
    check(build_case([45, 64], [1, 1], 2, 4, 64, 4, 16, dtype=dtype, key_axis="token", kind="outlier_channels",
                     seed=3, device=device), dtype, outliers=outliers)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sink_pages_and_splits(device, num_splits, outliers):
    # the first two pages of each sequence stay in fp staging pages, before low-bit ones
    case = build_case([90, 20, 70], [1, 1, 1], 2, 4, 64, 3, 16, sink_pages=2, seed=4, device=device)
    check(case, torch.float32, num_splits=num_splits, SCAN=4, outliers=outliers)


def test_no_outlier_capacity_group_1(device, outliers):
    check(build_case([40, 3], [1, 1], 1, 1, 64, 2, 16, outlier_fraction=0.0, seed=5, device=device), torch.float32,
          outliers=outliers)


def test_page_size_32_slot_chunks(device, outliers):
    case = build_case([70, 31], [1, 1], 2, 4, 64, 4, 32, kind="outlier_channels", seed=6, device=device)
    check(case, torch.float32, BLOCK_C=32, outliers=outliers)
    check(case, torch.float32, BLOCK_N=16, BLOCK_C=16, outliers=outliers)


@pytest.mark.parametrize("overrides", [{"codes": "subnormal"}, {"BLOCK_H": 8, "STAGE_N": 16},
                                       {"codes": "subnormal", "BLOCK_N": 16, "BLOCK_C": 32, "num_splits": 2}])
def test_launch_variants(device, overrides, outliers):
    case = build_case([0, 1, 40, 100], [1, 1, 1, 1], 2, 4, 64, 3, 16, dtype=torch.float16, kind="normal",
                      sink_pages=1, seed=9, device=device)
    check(case, torch.float16, outliers=outliers, **overrides)


@pytest.mark.parametrize("block_n,warps", [(128, 4), (64, 4), (128, 8)])
def test_mma_row_orders(device, block_n, warps, outliers):
    # blocks large enough for the permuted row order (the wgmma layouts): pages of 128, a sub-page block,
    # 8 warps; a full page, a partial staged page, and outliers in both
    case = build_case([128 + 77, 128], [1, 1], 1, 4, 64, 3, 128, dtype=torch.bfloat16, kind="outlier_channels",
                      seed=12, device=device)
    check(case, torch.bfloat16, BLOCK_N=block_n, num_warps=warps, outliers=outliers)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_fixed_num_splits(device, splits, outliers):
    # device-side split ranges; short sequences leave some splits empty (and context 0 leaves all empty); the
    # host lengths describe another batch (as in a graph replay)
    case = build_case([0, 17, 100, 48], [1, 1, 1, 1], 2, 4, 64, 3, 16, dtype=torch.bfloat16, sink_pages=1, seed=7,
                      device=device)
    want = reference(*case.args(), SCALE)
    case.meta = dataclasses.replace(case.meta, fixed_num_splits=splits, context_lens_host=[0] * 4)
    assert_close(kernel(*case.args(), SCALE, outliers=outliers), want, torch.bfloat16)


def test_rejects_prefill_and_unsupported(device):
    case = build_case([16], [2], 1, 4, 64, 3, 16, seed=8, device=device)
    with pytest.raises(ValueError):
        kernel(*case.args(), SCALE)
    grouped = build_case([16], [1], 1, 4, 64, 4, 16, key_axis="token", group_size=16, seed=8, device=device)
    assert not supports(grouped.key_spec, grouped.value_spec, 64)
    with pytest.raises(NotImplementedError):
        kernel(*grouped.args(), SCALE)
    with pytest.raises(TypeError):
        kernel(*build_case([16], [1], 1, 4, 64, 3, 16, seed=8, device=device).args(), SCALE, bogus=1)


def test_real_page_shape(device, outliers):
    # the target shape's page (P = 128, D = 128, GQA 4), one low-bit page + a staged tail, two splits
    case = build_case([300], [1], 1, 4, 128, 3, 128, dtype=torch.bfloat16, kind="outlier_channels", seed=10,
                      device=device)
    check(case, torch.bfloat16, num_splits=2, outliers=outliers)
    case.meta.fixed_num_splits = 3
    check(case, torch.bfloat16, codes="subnormal", outliers=outliers)


def _planted(context_lens, group, head_dim, bits, page_size, dtype, seed, device, key_scale, value_scale,
             fraction=0.25, max_count=None, **kw):
    case = build_case(context_lens, [1] * len(context_lens), 2, group, head_dim, bits, page_size, dtype=dtype,
                      outlier_fraction=fraction, seed=seed, **kw)                     # 25%: several slot chunks
    plant_outliers(case.key_pages, case.key_spec, seed, key_scale, max_count)
    plant_outliers(case.value_pages, case.value_spec, seed + 1, value_scale, max_count)
    return to_device(case, device) if device != "cpu" else case


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_planted_outlier_slots(device, bits, dtype, outliers):
    # every outlier of a token, every outlier of a channel, counts 0 / capacity / odd, huge value residuals;
    # empty, length-1, ragged contexts, a staged sink page (its stale slots must be ignored), host splits
    case = _planted(DECODE["context_lens"], group=4, head_dim=64, bits=bits, page_size=16, dtype=dtype, seed=20 + bits,
                    device=device, key_scale=4.0, value_scale=3e4, sink_pages=1)
    check(case, dtype, outliers=outliers, num_splits=2)


@pytest.mark.parametrize("overrides", [{}, {"BLOCK_C": 16}, {"BLOCK_N": 16, "BLOCK_C": 32, "codes": "subnormal"},
                                       {"BLOCK_H": 8, "num_warps": 8}])
def test_planted_outlier_slots_variants(device, overrides, outliers):
    # slot chunk sizes (one chunk, several), sub-page blocks, 8 warps; token-axis keys; device-side splits
    case = _planted([33, 100, 64], group=2, head_dim=64, bits=3, page_size=32, dtype=torch.float16, seed=30,
                    device=device, key_scale=2.0, value_scale=100.0, key_axis="token")
    want = reference(*case.args(), SCALE)
    case.meta = dataclasses.replace(case.meta, fixed_num_splits=3, context_lens_host=[0] * 3)
    assert_close(kernel(*case.args(), SCALE, outliers=outliers, **overrides), want, torch.float16)


def test_outlier_index_above_32767(device, outliers):
    # pages of 512 x 128: flat indices use all 16 bits (stored negative in int16), 128-token blocks
    case = _planted([700], group=4, head_dim=128, bits=3, page_size=512, dtype=torch.bfloat16, seed=40,
                    device=device, key_scale=4.0, value_scale=1e3, fraction=0.01)
    assert (case.key_pages.outlier_idx < 0).any()
    check(case, torch.bfloat16, outliers=outliers)


def test_scatter_repeatable_single_slots(device):
    # the scratch is zeroed by the kernel, nothing carries over between calls: with at most one outlier per
    # (page, head) (one atomic per scratch element, no order to vary) two calls agree exactly
    case = _planted([100, 40], group=4, head_dim=64, bits=3, page_size=16, dtype=torch.float32, seed=50,
                    device=device, key_scale=1.0, value_scale=10.0, max_count=1)
    first = kernel(*case.args(), SCALE, outliers="scatter")
    assert torch.equal(first, kernel(*case.args(), SCALE, outliers="scatter"))
    assert_close(first, reference(*case.args(), SCALE), torch.float32)
    with pytest.raises(ValueError):
        kernel(*case.args(), SCALE, outliers="bogus")


# ------------------------------------------------------------------ memory bounds under the interpreter
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="the bounds checker patches the CPU interpreter")


@triton.jit
def _strays(src, dst, n, SHIFT: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(src + offs, mask=offs < n, other=0.0)
    tl.store(dst + offs + SHIFT, x)
    tl.atomic_add(dst + offs * SHIFT + SHIFT, x, mask=offs < n)


@interpreter_only
def test_bounds_checker_sees_strays():
    # lanes issued outside every argument are reported (pointer, element offsets, source line) and not performed;
    # masked-off lanes are not issued on a GPU and are not reported
    src = torch.arange(1, 15, dtype=torch.float32)                                     # 14 elements
    with bounds_checked():
        _strays[(1,)](src, torch.zeros(16), 14, 0, 16)                                 # masked tail: clean
    dst = torch.zeros(16)
    with bounds_checked(raise_on_exit=False) as checker:
        _strays[(1,)](src, dst, 16, 1, 16)
    load, store, atomic = checker.distinct()
    assert (load.op, load.lanes, load.total) == ("load", 2, 16) and "`src` [14]" in load.nearest
    assert "offsets [14, 15]" in load.nearest and "tl.load(src + offs" in load.where[0]
    assert (store.op, store.lanes) == ("store", 1) and "`dst` [16]" in store.nearest and "offsets [16]" in store.nearest
    assert "tl.store(dst + offs + SHIFT, x)" in store.where[0] and "_strays" in store.where[0]
    assert (atomic.op, atomic.lanes) == ("atomic_rmw", 1) and "offsets [16]" in atomic.nearest
    x = torch.cat([src, torch.zeros(2)])                                               # the dropped lanes read 0
    assert torch.equal(dst, torch.cat([torch.zeros(1), 2 * x[:15]]))                   # dropped lanes not written
    with pytest.raises(AssertionError, match="out-of-bounds"):
        with bounds_checked():
            _strays[(1,)](src, torch.zeros(16), 16, 1, 16)


BOUNDS_CASES = {
    # the H200 fault's case (D 64, int3, pages of 128; BLOCK_N 128 / 64, 4 and 8 warps), then the other layouts
    "d64-p128-n128-w4": (dict(context_lens=[128 + 77, 128], query_lens=[1, 1], num_kv_heads=1, group=4, head_dim=64,
                              bits=3, page_size=128, dtype=torch.bfloat16, kind="outlier_channels", seed=12),
                         dict(BLOCK_N=128, num_warps=4)),
    "d64-p128-n64-w4": (None, dict(BLOCK_N=64, num_warps=4)),
    "d64-p128-n128-w8": (None, dict(BLOCK_N=128, num_warps=8)),
    "d64-p128-int2": (dict(context_lens=[128 + 77, 128], query_lens=[1, 1], num_kv_heads=1, group=4, head_dim=64,
                           bits=2, page_size=128, dtype=torch.float16, kind="outlier_channels", seed=13), {}),
    "d128-p128-splits": (dict(context_lens=[300], query_lens=[1], num_kv_heads=1, group=4, head_dim=128, bits=3,
                              page_size=128, dtype=torch.bfloat16, kind="outlier_channels", seed=10),
                         dict(num_splits=2)),
    "d64-p16-sinks": (dict(context_lens=[90, 20, 70], query_lens=[1, 1, 1], num_kv_heads=2, group=4, head_dim=64,
                           bits=3, page_size=16, sink_pages=2, seed=4), dict(num_splits=3, SCAN=4)),
    "d64-p32-n16": (dict(context_lens=[70, 31], query_lens=[1, 1], num_kv_heads=2, group=4, head_dim=64, bits=4,
                         page_size=32, kind="outlier_channels", seed=6), dict(BLOCK_N=16, BLOCK_C=16)),
}


@interpreter_only
@pytest.mark.parametrize("name", list(BOUNDS_CASES))
def test_memory_in_bounds(name, outliers):
    # every lane the kernel issues (loads, stores, atomics, including addresses made from page ids, outlier
    # indices and the scratch) lies inside one of its tensor arguments
    spec, overrides = BOUNDS_CASES[name]
    spec = spec or BOUNDS_CASES["d64-p128-n128-w4"][0]
    case = build_case(**spec)
    with bounds_checked() as checker:
        got = kernel(*case.args(), SCALE, outliers=outliers, **overrides)
    assert checker.launches >= 1 and checker.checked_ops > 0
    assert_close(got, reference(*case.args(), SCALE), spec.get("dtype", torch.float32))


# ------------------------------------------------------------------ the register-operand layout, compiled for sm_90
_SM90_SCRIPT = r'''
import json, os, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import moekv.ops.triton.lowbit.decode_tm as m
from moekv.testing.attention_cases import build_case

ptxas = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "ptxas")
if not os.path.exists(ptxas):
    print(json.dumps({"skip": "no ptxas in this triton"})); sys.exit(0)
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32", torch.int16: "i16",
         torch.uint8: "u8", torch.int64: "i64"}
kernel, names, results = m._decode_tm_kernel, m._decode_tm_kernel.arg_names, []

class Capture:                      # the launch's arguments, compiled for sm_90 instead of launched
    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages, **const):
            sig = {n: ("*" + TYPES[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float)
                       else "i32") for n, a in zip(names, args)}
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
            sig.update({n: "constexpr" for n in const})
            compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": num_warps, "num_stages": num_stages})
            ir, n, d = compiled.asm["ttgir"], const["BLOCK_N"], const["HEAD_DIM"]
            layouts = dict(re.findall(r"^(#\w+) = (.*)$", ir, re.M))
            word_load = r"tt\.load %\S+ : tensor<" + str(4 * n) + r"x\d+x!tt\.ptr<i32>, (#\w+)>"
            words = [layouts[l] for l in re.findall(word_load, ir)]
            a_dot = r"ttng\.warp_group_dot (%[^\s,]+), [^{]*\{[^}]*\} : tensor<" + f"{n}x{d}" + r"xf16, #ttg\.dot_op"
            a_ops = re.findall(a_dot, ir)
            # the key dot is the first [BLOCK_N, HEAD_DIM] dot of the page loop (the value dot, [HEAD_DIM, BLOCK_N],
            # comes after it and takes the shared-memory path by design)
            from_smem = bool(a_ops) and re.search(r"^\s*" + re.escape(a_ops[0]) + r" = ttg\.local_load", ir, re.M)
            results.append({"word_loads": words, "key_dots": len(a_ops), "key_a_from_smem": bool(from_smem)})
        return launch

m._decode_tm_kernel, m.check_launchable = Capture(), lambda *a: None
for head_dim, bits, outliers, block_n, warps in json.loads(sys.argv[1]):
    case = build_case([128 + 77, 128], [1, 1], 1, 4, head_dim, bits, 128, dtype=torch.float16,
                      kind="outlier_channels", seed=12)
    m.paged_attention_lowbit_decode_tm(*case.args(), 0.125, outliers=outliers, BLOCK_N=block_n, num_warps=warps)
print(json.dumps(results))
'''


def test_sm90_code_tile_is_the_register_operand():
    # compiled for Hopper (no GPU needed): each thread loads one lane's words of one token, so the unpacked key tile
    # is the wgmma register A operand as laid out in lowbit_decode_tm_parts.py. At head_dim 64 (one word per lane)
    # the load hint used to be folded away: Triton 3.6 loaded 2 lanes per thread and sent the tile through shared
    # memory (the layout of the H200 illegal-address fault at D 64, pages of 128)
    import json
    import os
    import subprocess
    import sys

    # (head_dim, bits, outliers, BLOCK_N, warps)
    configs = [(64, 3, "dot", 128, 4), (64, 3, "scatter", 128, 8), (64, 2, "scatter", 128, 4), (128, 3, "dot", 128, 4)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, json.dumps(configs)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    if isinstance(results, dict):
        pytest.skip(results["skip"])
    for config, result in zip(configs, results):
        assert result["word_loads"] and result["key_dots"] >= 1, (config, result)
        for layout in result["word_loads"]:
            assert "sizePerThread = [1, " in layout and "threadsPerWarp = [32, 1]" in layout, (config, layout)
        assert not result["key_a_from_smem"], (config, result)


@pytest.mark.parametrize("group", [1, 3])
def test_passes_groups_not_a_power_of_two(device, group):
    """outliers="passes" with GQA groups 1 and 3 (fix-tile rows of HG = 2 / 4 columns, of which 1 / 3 are
    heads), planted outliers on both sides (counts 0 to the full capacity), host-planned and fixed splits."""
    case = to_device(build_case([0, 1, 40, 100], [1] * 4, 2, group, 64, 3, 16, dtype=torch.float32,
                                kind="outlier_channels", seed=21), device)
    plant_outliers(case.key_pages, case.key_spec, 23, 50.0)
    plant_outliers(case.value_pages, case.value_spec, 24, 50.0)
    check(case, torch.float32, outliers="passes", num_splits=3)
    check(case, torch.float32, outliers="passes", BLOCK_N=16, num_splits=1)


def test_auto_takes_passes_on_large_grids(device, monkeypatch):
    """outliers="auto": "scatter" below PASSES_MIN_PROGRAMS (sequence, kv head) pairs, "passes" from there on
    (seen by whether the key pass runs); both match the reference."""
    import moekv.ops.triton.lowbit.decode_tm as tm

    runs = []
    key_fixes = tm.key_fixes
    monkeypatch.setattr(tm, "key_fixes", lambda *args, **kwargs: runs.append(1) or key_fixes(*args, **kwargs))
    case = to_device(build_case(**DECODE, num_kv_heads=2, group=4, head_dim=64, bits=3, page_size=16,
                                dtype=torch.float32, kind="outlier_channels", seed=25), device)
    check(case, torch.float32)                                   # 4 x 2 = 8 pairs < 64
    assert runs == []
    monkeypatch.setattr(tm, "PASSES_MIN_PROGRAMS", 8)
    check(case, torch.float32)
    assert runs == [1]
    monkeypatch.setattr(tm, "PASSES_MAX_BYTES", 0)              # tiles over the limit: scatter again
    check(case, torch.float32)
    assert runs == [1]

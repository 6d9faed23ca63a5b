"""The fused MoE kernels (decode path, align step, grouped path) against the pure-PyTorch references.

Runs the Triton kernels on CUDA, else under Triton's CPU interpreter (tests/ops/conftest.py sets
TRITON_INTERPRET before moekv.ops.triton is imported), so the shapes are tiny. The oracle is
moe_experts_reference on fp32 copies of the inputs; outputs are checked with the dtype's tolerance
(tests/ops/helpers.assert_close), the align step bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

from moekv.ops import dispatch
from moekv.ops.reference.moe import (moe_activation_reference, moe_align_reference, moe_experts_reference,
                                     padded_capacity)
from moekv.ops.triton.moe import configs as moe_configs
from moekv.ops.triton.moe import decode as moe_decode
from moekv.ops.triton.moe import grouped as moe_grouped
from moekv.ops.triton.moe import align as moe_align_module
from moekv.ops.triton.moe.align import moe_align
from tests.ops.helpers import assert_close

# the interpreter's numpy warns when silu's exp overflows for very negative inputs (the result, 0, is right)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def routing(num_tokens: int, top_k: int, num_experts: int, gen: torch.Generator, pattern: str = "random"
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int64, topk_weights [T, k] fp32) for a routing pattern:
    random (distinct per token), hot (expert 0 in every token's first choice: one expert gets all
    tokens), sparse (only experts 0 and 1 used: the others get none), repeat (one expert twice per token)."""
    if num_tokens == 0:
        ids = torch.empty(0, top_k, dtype=torch.int64)
    elif pattern == "random":
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    elif pattern == "hot":
        rest = [torch.randperm(num_experts - 1, generator=gen)[:top_k - 1] + 1 for _ in range(num_tokens)]
        ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), r]) for r in rest])
    elif pattern == "sparse":
        ids = torch.stack([torch.randperm(2, generator=gen)[:top_k] for _ in range(num_tokens)])
    elif pattern == "repeat":
        ids = torch.randint(0, num_experts, (num_tokens, 1), generator=gen).repeat(1, top_k)
    else:
        raise ValueError(pattern)
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.05
    return ids, weights / weights.sum(-1, keepdim=True)


def moe_case(num_tokens, top_k, num_experts, hidden, inter, dtype, device, seed=0, pattern="random", scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen) * scale
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    ids, weights = routing(num_tokens, top_k, num_experts, gen, pattern)
    inputs = [t.to(dtype).to(device) for t in (x, w_gate_up, w_down)] + [ids.to(device), weights.to(device)]
    expected = moe_experts_reference(*[t.float() for t in inputs[:3]], ids.to(device), weights.to(device))
    return inputs, expected


# (T, k, E, H, I, pattern, scale): random routing, ragged sizes (masks), adversarial routing, big values
CASES = [
    (1, 2, 8, 64, 32, "random", 1.0),
    (1, 1, 4, 32, 16, "random", 1.0),
    (5, 2, 4, 48, 40, "random", 1.0),        # H, I not multiples of the blocks
    (16, 4, 6, 32, 48, "random", 1.0),
    (7, 2, 8, 32, 48, "hot", 1.0),           # one expert receives every token
    (9, 2, 8, 48, 32, "sparse", 1.0),        # six experts receive none
    (3, 2, 5, 32, 24, "repeat", 1.0),        # the same expert twice in a token
    (4, 2, 4, 32, 32, "random", 64.0),       # large activations
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}k{c[1]}E{c[2]}H{c[3]}I{c[4]}-{c[5]}-x{c[6]:g}")
def test_decode_matches_reference(case, dtype, device):
    num_tokens, top_k, num_experts, hidden, inter, pattern, scale = case
    inputs, expected = moe_case(num_tokens, top_k, num_experts, hidden, inter, dtype, device, pattern=pattern,
                                scale=scale)
    config = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 32}, "down": {"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 2}}
    assert_close(moe_decode.moe_experts_decode(*inputs, config=config), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES + [(40, 2, 4, 48, 40, "random", 1.0), (33, 4, 8, 32, 32, "hot", 1.0),
                                          (24, 1, 3, 32, 16, "sparse", 1.0)],
                         ids=lambda c: f"T{c[0]}k{c[1]}E{c[2]}H{c[3]}I{c[4]}-{c[5]}-x{c[6]:g}")
def test_grouped_matches_reference(case, dtype, device):
    num_tokens, top_k, num_experts, hidden, inter, pattern, scale = case
    inputs, expected = moe_case(num_tokens, top_k, num_experts, hidden, inter, dtype, device, pattern=pattern,
                                scale=scale)
    config = {"BLOCK_M": 16, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2},
              "down": {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}}
    assert_close(moe_grouped.moe_experts_grouped(*inputs, config=config), expected, dtype)


@pytest.mark.parametrize("path", ["decode", "grouped"])
def test_default_configs_and_activation_stage(path, device):
    """Untuned default blocks (larger than these shapes: masks everywhere), and the first launch alone
    against its twin moe_activation_reference."""
    inputs, expected = moe_case(6, 2, 4, 48, 40, torch.bfloat16, device, seed=3)
    hidden, w_gate_up, _, ids, _ = inputs
    run, activation = {"decode": (moe_decode.moe_experts_decode, moe_decode.decode_activation),
                       "grouped": (moe_grouped.moe_experts_grouped, moe_grouped.grouped_activation)}[path]
    assert_close(run(*inputs), expected, torch.bfloat16)
    act_expected = moe_activation_reference(hidden.float(), w_gate_up.float(), ids)
    assert_close(activation(hidden, w_gate_up, ids), act_expected, torch.bfloat16)


@pytest.mark.parametrize("split_k", [1, 3])
def test_decode_split_k_and_deterministic(split_k, device):
    inputs, expected = moe_case(3, 2, 4, 32, 80, torch.float32, device, seed=5)
    config = {"down": {"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": split_k}}
    first = moe_decode.moe_experts_decode(*inputs, config=config)
    assert_close(first, expected, torch.float32)
    assert torch.equal(first, moe_decode.moe_experts_decode(*inputs, config=config))


def check_alignment(topk_ids, num_experts, block_m, sorted_slots, block_experts, num_padded):
    """Properties of an aligned layout, independent of any implementation."""
    flat = topk_ids.reshape(-1).cpu()
    num_slots = flat.numel()
    sorted_slots, block_experts = sorted_slots.cpu().long(), block_experts.cpu().long()
    total = int(num_padded.item())
    assert sorted_slots.numel() == padded_capacity(num_slots, num_experts, block_m)
    assert total % block_m == 0 and total <= sorted_slots.numel()
    real = sorted_slots[sorted_slots < num_slots]
    assert torch.equal(torch.sort(real).values, torch.arange(num_slots))           # every slot exactly once
    assert (sorted_slots[total:] == num_slots).all() and (block_experts[total // block_m:] == -1).all()
    row_expert = block_experts[:total // block_m].repeat_interleave(block_m)       # [total]
    used = sorted_slots[:total] < num_slots
    assert torch.equal(flat[sorted_slots[:total][used]], row_expert[used])         # rows hold their block's expert
    for expert in range(num_experts):                                              # ascending, minimal padding
        rows = sorted_slots[:total][used & (row_expert == expert)]
        assert torch.equal(rows, torch.sort(rows).values)
        assert (row_expert == expert).sum() == -(-int((flat == expert).sum()) // block_m) * block_m


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,pattern", [
    (1, 2, 8, 16, "random"), (5, 1, 3, 16, "random"), (37, 4, 6, 16, "random"), (64, 2, 8, 64, "hot"),
    (50, 2, 16, 16, "sparse"), (13, 2, 5, 32, "repeat"), (300, 8, 128, 32, "random"), (1500, 2, 8, 16, "random"),
    (512, 2, 8, 64, "hot"), (128, 8, 128, 16, "random"), (129, 8, 128, 16, "sparse"),   # one program's limit, 1 past
])
def test_align_exact(num_tokens, top_k, num_experts, block_m, pattern, device):
    gen = torch.Generator().manual_seed(num_tokens)
    ids, _ = routing(num_tokens, top_k, num_experts, gen, pattern)
    ids = ids.to(device)
    expected = moe_align_reference(ids, num_experts, block_m)
    check_alignment(ids, num_experts, block_m, *expected)
    actual = moe_align(ids, num_experts, block_m)
    for got, want in zip(actual, expected):
        assert got.dtype == want.dtype == torch.int32
        assert torch.equal(got, want)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,pattern", [
    (1, 2, 8, 16, "random"), (64, 2, 8, 64, "hot"), (33, 8, 128, 16, "sparse"), (200, 2, 8, 16, "repeat"),
])
def test_align_one_program_and_three_launches_agree(num_tokens, top_k, num_experts, block_m, pattern, device,
                                                    monkeypatch):
    """The one-program align (up to ONE_PROGRAM_SLOTS slots) and the three launches: the same outputs, bit for bit,
    on the same input (several chunks of the one program's loop too: ONE_PROGRAM_SLOTS raised)."""
    ids, _ = routing(num_tokens, top_k, num_experts, torch.Generator().manual_seed(7), pattern)
    ids = ids.to(device)
    expected = moe_align_reference(ids, num_experts, block_m)
    for limit in (0, 1 << 20):
        monkeypatch.setattr(moe_align_module, "ONE_PROGRAM_SLOTS", limit)
        for got, want in zip(moe_align(ids, num_experts, block_m), expected):
            assert torch.equal(got, want)


def test_dispatch_picks_decode_then_grouped(device, monkeypatch, triton_backend):
    calls = []
    for module, name in ((moe_decode, "moe_experts_decode"), (moe_grouped, "moe_experts_grouped")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    limit = moe_configs.DEFAULT_DECODE_MAX_TOKENS
    for num_tokens in (1, limit, limit + 1):
        inputs, expected = moe_case(num_tokens, 2, 4, 32, 16, torch.float32, device, seed=num_tokens)
        assert_close(dispatch.moe_experts(*inputs), expected, torch.float32)
    assert calls == ["moe_experts_decode", "moe_experts_decode", "moe_experts_grouped"]


def test_dispatch_reference_backend(device, monkeypatch):
    inputs, expected = moe_case(3, 2, 4, 32, 16, torch.float32, device)
    with dispatch.override(backend="reference"):
        assert_close(dispatch.moe_experts(*inputs), expected, torch.float32)
        ids = inputs[3]
        for got, want in zip(dispatch.moe_align(ids, 4, 16), moe_align_reference(ids, 4, 16)):
            assert torch.equal(got, want)


def test_tuned_config_lookup(tmp_path, monkeypatch):
    table = {"decode_max_tokens": 8,
             "decode": {"1": {"gate_up": {"BLOCK_N": 64}, "down": {"BLOCK_N": 32}},
                        "8": {"gate_up": {"BLOCK_N": 16}, "down": {"BLOCK_N": 16}}},
             "grouped": {"64": {"BLOCK_M": 32, "gate_up": {}, "down": {}}}}
    name = moe_configs.config_filename(4, 32, 16, torch.bfloat16, "cpu")
    (tmp_path / name).write_text(json.dumps(table))
    monkeypatch.setattr(moe_configs, "CONFIG_DIR", tmp_path)
    moe_configs.load_tuned.cache_clear()
    moe_configs._cached_config.cache_clear()
    try:
        assert moe_configs.decode_max_tokens(4, 32, 16, torch.bfloat16, "cpu") == 8
        assert moe_configs.get_config("decode", 4, 32, 16, 2, torch.bfloat16, "cpu")["gate_up"]["BLOCK_N"] == 64
        assert moe_configs.get_config("decode", 4, 32, 16, 6, torch.bfloat16, "cpu")["gate_up"]["BLOCK_N"] == 16
        assert moe_configs.get_config("grouped", 4, 32, 16, 200, torch.bfloat16, "cpu")["BLOCK_M"] == 32
        far = moe_configs.get_config("grouped", 4, 32, 16, 999, torch.bfloat16, "cpu")   # beyond GROUPED_REACH
        assert far == moe_configs.default_config("grouped", 4, 32, 16, 999) and far["BLOCK_M"] == 64
        assert moe_configs.get_config("grouped", 4, 32, 16, 15, torch.bfloat16, "cpu") == moe_configs.default_config("grouped", 4, 32, 16, 15)
        assert moe_configs.decode_max_tokens(4, 32, 16, torch.float16, "cpu") == moe_configs.DEFAULT_DECODE_MAX_TOKENS
    finally:
        moe_configs.load_tuned.cache_clear()
        moe_configs._cached_config.cache_clear()


def test_stored_config_files_are_well_formed():
    """Every tuned table in the repo parses and names the keys the kernels read (a file may leave out a path's
    section: that path then takes default_config)."""
    paths = list(moe_configs.CONFIG_DIR.glob("*.json"))
    for path in paths:
        table = json.loads(path.read_text())
        assert isinstance(table["decode_max_tokens"], int)
        assert "decode" in table or "grouped" in table, path.name
        for entry in table.get("decode", {}).values():
            assert {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"} <= set(entry["gate_up"]) and "SPLIT_K" in entry["down"]
        for entry in table.get("grouped", {}).values():
            assert entry["BLOCK_M"] in (16, 32, 64, 128)
            assert {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"} <= set(entry["down"])


def test_empty_batch_and_strided_input(device):
    inputs, _ = moe_case(0, 2, 4, 32, 16, torch.float32, device)
    assert moe_decode.moe_experts_decode(*inputs).shape == (0, 32)
    assert moe_grouped.moe_experts_grouped(*inputs).shape == (0, 32)
    sorted_slots, block_experts, num_padded = moe_align(inputs[3], 4, 16)
    assert sorted_slots.numel() == 0 and block_experts.numel() == 0 and int(num_padded.item()) == 0
    inputs, expected = moe_case(3, 2, 4, 32, 16, torch.float32, device)
    wide = torch.zeros(3, 64, device=device)
    wide[:, ::2] = inputs[0]                                    # a view with stride(-1) == 2
    for run in (moe_decode.moe_experts_decode, moe_grouped.moe_experts_grouped):
        assert_close(run(wide[:, ::2], *inputs[1:]), expected, torch.float32)

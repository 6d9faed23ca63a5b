"""The routing fold of the add + norm + route kernel (ops.triton.layer.norm_route, issue #19): a router read by
several programs per token (Qwen3-30B-A3B's E = 128) is routed by the token's last program to arrive (an acq_rel
count on the MoE block's int32 counters) instead of by a second launch.

Both read the stored, rounded logits back and run the same epilogue with the same warps, so the fold must give the
two-launch path's bits: ids, weights (compared as bit patterns: NaN included), the expert-load count, logits,
normed, residual; and leave the counters zero. On CPU under Triton's interpreter, on CUDA compiled; the memory
ordering is checked in the sm_90 PTX (compiled without a GPU), the reduction layouts in the TTGIR.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton

from moekv.config import KernelConfig
from moekv.ops import dispatch
from moekv.ops.reference import layers as ref
from moekv.ops.triton.layer import norm_route
from tests.helpers import check_kernel_switch
from tests.ops.test_layer_kernels import _assert_routing_close, _rand

MAX_T = KernelConfig.FUSED_ROUTER_MAX_TOKENS


def _inputs(num_tokens, hidden, num_experts, dtype, device, seed, scale=0.5):
    x = _rand((num_tokens, hidden), dtype, device, seed)
    residual = _rand((num_tokens, hidden), dtype, device, seed + 1, scale=4.0)
    w = _rand((hidden,), dtype, device, seed + 2)
    router = _rand((num_experts, hidden), dtype, device, seed + 3, scale=scale)
    return x, residual, w, router


def _run(inputs, top_k, renormalize, valid=None, counters=None, block_e=None, load=None):
    """-> (normed, new residual, weights, ids, expert load, logits) of one launch (two without counters)."""
    x, residual, w, router = inputs
    num_tokens, num_experts = x.shape[0], router.shape[0]
    load = torch.full((num_experts,), 3, dtype=torch.int64, device=x.device) if load is None else load
    logits = torch.full((num_tokens, num_experts), 7.0, dtype=x.dtype, device=x.device)
    config = None if block_e is None else dict(BLOCK_E=block_e, SUB_E=block_e)
    out = norm_route.add_rms_norm_route(x, residual, w, 1e-6, router, top_k, renormalize, load, valid,
                                        logits_out=logits, route_counters=counters, config=config)
    return (*out, load, logits)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


def _assert_same_bits(got, expected):
    names = ("normed", "residual", "weights", "ids", "expert load", "logits")
    for name, a, b in zip(names, got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(_bits(a), _bits(b)), f"{name} differs at {int((_bits(a) != _bits(b)).sum())} elements"


def _zeros(device):
    return torch.zeros(MAX_T, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden,num_experts,top_k,block_e", [
    (1, 256, 128, 8, 16),             # Qwen3-30B-A3B's router shape, hidden cut to 256: 8 programs per token
    (3, 256, 128, 8, 16),
    (5, 37, 6, 2, 1),                 # odd hidden, one expert per program
    (4, 96, 40, 3, 8),                # the last block part empty
    (2, 64, 256, 8, 64),              # MAX_EXPERTS
])
@pytest.mark.parametrize("renormalize", [False, True])
def test_fold_matches_two_launches(device, dtype, num_tokens, hidden, num_experts, top_k, block_e, renormalize):
    inputs = _inputs(num_tokens, hidden, num_experts, dtype, device, 30 + num_tokens)
    valid = torch.tensor([1, 0, 1, 1, 0][:num_tokens], dtype=torch.int64, device=device)
    counters = _zeros(device)
    two = _run(inputs, top_k, renormalize, valid, block_e=block_e)
    fold = _run(inputs, top_k, renormalize, valid, counters, block_e=block_e)
    _assert_same_bits(fold, two)
    assert not counters.any()
    one_block = _run(inputs, top_k, renormalize, valid, _zeros(device), block_e=triton.next_power_of_2(num_experts))
    _assert_same_bits(fold, one_block)
    # and the routing is the reference's on those logits (the routing kernel's criteria)
    expect_weights, expect_ids = ref.route_topk(fold[5], top_k, renormalize)
    _assert_routing_close(fold[2], fold[3], expect_weights, expect_ids, fold[5], top_k)
    counted = torch.full((num_experts,), 3, dtype=torch.int64, device=device)
    ref.count_expert_load(fold[3], counted, valid)
    assert torch.equal(fold[4], counted)


@pytest.mark.parametrize("block_e", [1, 2, 8, 32, 64, 128])
def test_fold_at_every_block_count(device, block_e):
    """128 down to 1 programs per token: the same bits as the two-launch path and as one program."""
    inputs = _inputs(2, 48, 128, torch.bfloat16, device, 40)
    expected = _run(inputs, 8, True)                           # default: one block (48 x 128 fits one program)
    counters = _zeros(device)
    _assert_same_bits(_run(inputs, 8, True, counters=counters, block_e=block_e), expected)
    _assert_same_bits(_run(inputs, 8, True, block_e=block_e), expected)
    assert not counters.any()


def test_fold_up_to_the_token_limit(device):
    """T = FUSED_ROUTER_MAX_TOKENS (the whole counter buffer), half of the rows padding (token_valid 0)."""
    inputs = _inputs(MAX_T, 64, 128, torch.bfloat16, device, 50)
    valid = (torch.arange(MAX_T, device=device) % 2).to(torch.int64)
    counters = _zeros(device)
    _assert_same_bits(_run(inputs, 8, True, valid, counters, block_e=32), _run(inputs, 8, True, valid, block_e=32))
    assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fold_adversarial(device, dtype):
    """Ties (an all-zero row: every logit 0; duplicated router rows: equal logits, ties to the lowest index; one
    dominant expert: every other probability 0), logits overflowing to -inf, huge activations."""
    big = {torch.float32: 1e15, torch.float16: 1e3, torch.bfloat16: 3e4}[dtype]     # no overflow in x + residual
    x, residual, w, router = _inputs(6, 40, 24, dtype, device, 60, scale=0.3)
    x[1], residual[1] = 0, 0                                   # all logits 0: uniform, ids 0..k-1
    x[2], residual[2] = x[2] * big, residual[2] * big          # the fp32 statistics must not overflow
    router[7] = router[3]                                      # equal logits for experts 3, 7 and 12, every row
    router[12] = router[3]
    for case in ("ties", "extremes"):
        if case == "extremes":                                 # every normed value >= 0: the logits' signs known
            x, residual, w = x.abs(), residual.abs(), w.abs()
            router = router.clone()
            router[21] = -6e4 if dtype == torch.float16 else -3e38     # -inf after the rounding (or the fp32 sum)
            router[20] = 30.0                                  # ~750: every other probability underflows to 0
        inputs = (x, residual, w, router)
        for renormalize in (False, True):
            counters = _zeros(device)
            fold = _run(inputs, 5, renormalize, counters=counters, block_e=4)
            _assert_same_bits(fold, _run(inputs, 5, renormalize, block_e=4))
            _assert_same_bits(fold, _run(inputs, 5, renormalize))
            assert not counters.any()
            ids = fold[3].tolist()
            assert ids[1] == [0, 1, 2, 3, 4]
            if case == "extremes":
                assert (fold[5][[0, 2, 3, 4, 5], 21] == float("-inf")).all()
                assert all(row == [20, 0, 1, 2, 3] for i, row in enumerate(ids) if i != 1), ids
            for row in ids:
                assert (7 not in row or 3 in row) and (12 not in row or 7 in row), ids


def test_counters_stay_zero_and_repeated_launches_agree(device):
    inputs = _inputs(3, 256, 128, torch.bfloat16, device, 70)
    counters = _zeros(device)
    load = torch.zeros(128, dtype=torch.int64, device=device)
    first = _run(inputs, 8, True, counters=counters, block_e=16, load=load)
    first_load = load.clone()
    assert not counters.any() and int(first_load.sum()) == 3 * 8
    for launch in range(2, 4):
        again = _run(inputs, 8, True, counters=counters, block_e=16, load=load)
        assert not counters.any()
        for a, b in zip(again[:4] + again[5:], first[:4] + first[5:]):
            assert torch.equal(_bits(a), _bits(b))
        assert torch.equal(load, first_load * launch)                  # counted once per token and launch


def test_the_fold_is_one_launch(device, monkeypatch):
    """With counters: no routing kernel after; without: the routing kernel, once."""
    launches = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launches.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(norm_route, "_route_topk_kernel", Spy(norm_route._route_topk_kernel))
    inputs = _inputs(2, 256, 128, torch.bfloat16, device, 80)
    _run(inputs, 8, True, counters=_zeros(device), block_e=16)
    assert launches == []
    _run(inputs, 8, True, block_e=16)
    assert launches == [(2,)]
    _run(inputs, 8, True, counters=_zeros(device))              # one block (256 x 128 bf16 fits one program)
    assert launches == [(2,)]


def test_bad_counters_are_refused(device):
    inputs = _inputs(3, 32, 16, torch.bfloat16, device, 90)
    for bad in (torch.zeros(MAX_T, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int32, device=device),
                torch.zeros((2, MAX_T), dtype=torch.int32, device=device)[:, 0]):
        with pytest.raises(ValueError, match="route_counters"):
            _run(inputs, 2, True, counters=bad, block_e=4)


def test_dispatch_passes_the_counters_and_the_switch(device, triton_backend, monkeypatch):
    seen = []
    kernel = norm_route.add_rms_norm_route
    monkeypatch.setattr(norm_route, "add_rms_norm_route",
                        lambda *a, **k: seen.append(a[10] if len(a) > 10 else k.get("route_counters")) or kernel(*a, **k))
    inputs = _inputs(2, 16, 8, torch.bfloat16, device, 100)
    counters = _zeros(device)
    dispatch.add_rms_norm_route(*inputs[:2], inputs[2], 1e-6, inputs[3], 2, True, None, None, None, counters)
    with dispatch.override(fused_route_fold=False):
        dispatch.add_rms_norm_route(*inputs[:2], inputs[2], 1e-6, inputs[3], 2, True, route_counters=counters)
    assert seen[0] is counters and seen[1] is None
    assert not counters.any()


def test_reference_ignores_the_counters():
    x, r, w, router = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.randn(4, 8)
    counters = torch.zeros(MAX_T, dtype=torch.int32)
    got = ref.add_rms_norm_route(x, r, w, 1e-6, router, 2, True, route_counters=counters)
    for a, b in zip(got, ref.add_rms_norm_route(x, r, w, 1e-6, router, 2, True)):
        assert torch.equal(a, b)
    assert not counters.any()


def test_config_and_environment(monkeypatch):
    check_kernel_switch(monkeypatch, "fused_route_fold", "MOEKV_FUSED_ROUTE_FOLD", True)


# -- what the compiler makes of it (sm_90, Triton's own compiler, no GPU) ----------------------------------------

def test_fold_ordering_in_ptx():
    """Qwen3's launch: the last logit store, bar.sync, one gpu-scope acq_rel add on the counter, bar.sync, then the
    read-back through L2 (.cg) and, after it, the counter's reset; the two-launch variant counts nothing."""
    from tests.ops.ptx_compile import assert_last_arrival_order, ptx_in_child

    fold, plain = ptx_in_child("[compile_norm_route(fold) for fold in (True, False)]")
    assert "atom.global.gpu.acq_rel.add.u32" in fold
    assert_last_arrival_order(fold)
    assert ".entry" in plain and "atom." not in plain and "acq_rel" not in plain


def _reduce_layouts(ttgir: str) -> list[str]:
    """The operand type of every tt.reduce of a 1-D tensor (the routing epilogue's), layout aliases resolved."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    types = re.findall(r"\(tensor<(\d+x\w+), (#\w+)>\) -> [fi]\d+", ttgir)
    return [f"{shape} {aliases[alias]}" for shape, alias in types]


def test_fold_and_second_launch_reduce_alike():
    """The epilogue's reductions (max, the softmax sum, the top-k rounds, the renormalising sum) get the same layouts
    -- the same fp32 summation order -- in the fold as in the second launch at the fused kernel's warps; at the
    routing kernel's own 2 warps they would not (why the second launch takes the fused kernel's warps)."""
    from tests.ops.ptx_compile import ptx_in_child

    warps = norm_route.launch_config(2048, 128, 2)["num_warps"]
    fold, second, own = ptx_in_child(f"[compile_norm_route(True, ir='ttgir'), compile_route_topk({warps}), "
                                     "compile_route_topk(2)]")
    epilogue = [t for t in _reduce_layouts(fold) if t.startswith(("128x", "8x"))]
    assert len(epilogue) == 19 and epilogue == _reduce_layouts(second)           # 1 + 1 + 8 x 2 + 1 reductions
    assert _reduce_layouts(own) != epilogue


# -- the model ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_moe_model_same_with_and_without_the_fold(device, tmp_path, monkeypatch, dtype):
    """A tiny Qwen3-MoE of 128 experts (top 8), its router split over several programs per token (the per-program
    share cut so that hidden 64 takes 8 of them, as Qwen3-30B-A3B's hidden 2048 does): the fused decode layer with
    the fold and without it (two
    launches) give the same logits, tokens and expert load bit for bit; the MoE blocks' counters end at zero."""
    from moekv.models import load_model
    from tests.hf_fixtures import make_checkpoint, moekv_greedy

    monkeypatch.setattr(norm_route, "ROUTER_BYTES_PER_PROGRAM", 2048)
    monkeypatch.setattr(norm_route, "SUB_TILE", 1024)
    path, _ = make_checkpoint(tmp_path, "qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=16, num_experts=128,
                              top_k=8, norm_topk_prob=True)
    model = load_model(path, dtype=dtype, device=device)
    blocks = [layer.mlp for layer in model.layers]
    assert all(b.route_counters.shape == (MAX_T,) and b.route_counters.dtype == torch.int32 for b in blocks)
    assert all(b.route_counters.device == model.device for b in blocks)
    assert not any("route_counters" in name for name in model.state_dict())
    assert norm_route.launch_config(64, 128, model.embed_tokens.weight.element_size())["BLOCK_E"] == 16
    launches = {"route_topk": 0}
    kernel = norm_route._route_topk_kernel

    class Spy:
        def __getitem__(self, grid):
            launches["route_topk"] += 1
            return kernel[grid]

    monkeypatch.setattr(norm_route, "_route_topk_kernel", Spy())
    monkeypatch.setattr(dispatch, "_layer_op_triton", lambda op, tensor: op == "add_rms_norm_route")
    prompts = [[5, 6, 7], [11], [3, 9, 4, 8, 2]]
    runs = {}
    for fold in (False, True):
        with dispatch.override(backend="reference", fused_decode_layer=True, fused_route_fold=fold):
            model.reset_expert_load()
            before = launches["route_topk"]
            tokens, logits = moekv_greedy(model, prompts, 3)
            runs[fold] = (tokens, logits, model.expert_load.clone(), launches["route_topk"] - before)
    assert runs[False][3] == 3 * model.arch.num_layers and runs[True][3] == 0     # prefill + 2 decode steps
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    assert torch.equal(runs[True][2], runs[False][2]) and int(runs[True][2].sum()) > 0
    assert not any(b.route_counters.any() for b in blocks)

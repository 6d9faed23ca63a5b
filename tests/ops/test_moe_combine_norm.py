"""The MoE combine summed by the next residual add + RMSNorm (ops.triton.layer.combine_norm) against its twin
(ops.reference.moe_combine) and against the two unfused kernels it replaces (ops.triton.moe.decode's combine, then
ops.triton.layer.norm's add + norm); the decode kernels' per-slot outputs; the dispatch and its switch; then whole
tiny models with KernelConfig.fused_moe_combine on against off.

What each comparison can demand: the combine's sum has one order and no multiply-add (kernel and twin alike), so the
combined row and the new residual are bit-equal everywhere; the normed row is bit-equal to the unfused norm kernel's
under the interpreter (on a GPU up to the fp32 sum of squares' order) and within the RMSNorm bounds of
test_layer_kernels of the twin's (torch's rsqrt).
"""

from __future__ import annotations

import pytest
import torch

from moekv.ops import dispatch
from moekv.ops.reference import moe as ref_moe
from moekv.ops.reference import moe_combine as ref
from moekv.ops.triton.layer import combine_norm, norm
from moekv.ops.triton.moe import decode
from tests.ops.test_layer_kernels import _SIGNIFICAND_BITS, DTYPES, MODEL_FAMILIES, _assert_norm_close, _rand

INTERPRETED = not torch.cuda.is_available()


def _inputs(num_tokens, top_k, splits, hidden, dtype, device, seed, scale=1.0):
    partial = _rand((splits, num_tokens * top_k, hidden), torch.float32, device, seed, scale=scale)
    weights = _rand((num_tokens, top_k), torch.float32, device, seed + 1).abs() + 0.05
    weights = weights / weights.sum(1, keepdim=True)                                  # renormalised routing
    residual = _rand((num_tokens, hidden), dtype, device, seed + 2, scale=2.0 * scale)
    norm_weight = _rand((hidden,), dtype, device, seed + 3)
    return partial, weights, residual, norm_weight


def _check(partial, weights, residual, norm_weight, eps=1e-6):
    dtype = residual.dtype
    normed, new_residual = combine_norm.moe_combine_add_rms_norm(partial, weights, residual, norm_weight, eps)
    twin_normed, twin_residual = ref.moe_combine_add_rms_norm(partial, weights, residual, norm_weight, eps)
    assert normed.is_contiguous() and new_residual.is_contiguous() and normed.dtype == dtype
    assert torch.equal(new_residual, twin_residual)
    _assert_norm_close(normed, twin_normed, dtype)
    # the two launches it replaces: the decode combine kernel, then the add + norm kernel
    combined = decode.combine_partials(partial, weights, dtype)
    assert torch.equal(combined, ref.moe_combine(partial, weights, dtype))
    unfused_normed, unfused_residual = norm.fused_add_rms_norm(combined, residual, norm_weight, eps)
    assert torch.equal(new_residual, unfused_residual)
    if INTERPRETED:
        assert torch.equal(normed, unfused_normed)
    else:
        _assert_norm_close(normed, unfused_normed, dtype)
    return normed, new_residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k,splits,hidden", [(1, 1, 1, 64), (1, 2, 4, 37), (3, 8, 2, 129),
                                                            (16, 2, 3, 1), (64, 1, 1, 48), (5, 8, 1, 200)])
def test_combine_norm_matches_twin_and_unfused_kernels(device, dtype, num_tokens, top_k, splits, hidden):
    _check(*_inputs(num_tokens, top_k, splits, hidden, dtype, device, 10 * top_k + splits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_norm_large_activations_and_zero_rows(device, dtype):
    big = {torch.float32: 1e15, torch.bfloat16: 1e4, torch.float16: 30.0}[dtype]    # fp16: sums stay finite
    partial, weights, residual, norm_weight = _inputs(4, 2, 3, 77, dtype, device, 40, scale=big)
    partial[:, 2:4] = 0                                  # token 1: its experts gave zeros, its residual is zero
    residual[1] = 0
    weights[3] = torch.tensor([1.0, 0.0])                # token 3: all weight on one slot
    normed, new_residual = _check(partial, weights, residual, norm_weight)
    assert torch.isfinite(normed).all() and (normed[1] == 0).all() and (new_residual[1] == 0).all()


def test_combine_norm_odd_strides_and_empty(device):
    partial, weights, residual, norm_weight = _inputs(3, 2, 2, 40, torch.bfloat16, device, 50)
    wide = torch.zeros((3, 60), dtype=torch.bfloat16, device=device)
    wide[:, 5:45] = residual
    _check(partial, weights.t().contiguous().t(), wide[:, 5:45], norm_weight)          # strided residual, weights
    empty = combine_norm.moe_combine_add_rms_norm(partial[:, :0], weights[:0], residual[:0], norm_weight, 1e-6)
    assert [tuple(t.shape) for t in empty] == [(0, 40), (0, 40)]


def test_combine_norm_bad_input_is_a_clear_error(device):
    partial, weights, residual, norm_weight = _inputs(2, 2, 1, 16, torch.float32, device, 60)
    for args, match in (((partial[:, :3], weights, residual), "slot rows"),
                        ((partial, weights, residual[:, :8]), "residual must be"),
                        ((partial[0], weights, residual), "partial must be"),
                        ((partial, weights.long(), residual), "floats")):
        for fn in (combine_norm.moe_combine_add_rms_norm, ref.moe_combine_add_rms_norm):
            with pytest.raises(ValueError, match=match):
                fn(*args, norm_weight, 1e-6)
    assert combine_norm.supports(partial, weights, residual, norm_weight)
    assert not combine_norm.supports(partial, weights, residual, norm_weight.half())          # dtypes differ
    assert not combine_norm.supports(partial, weights, residual[:, :8], norm_weight[:8])
    big = torch.zeros((1, 2, norm.MAX_HIDDEN + 1), device=device)
    assert not combine_norm.supports(big, weights[:1], torch.zeros((1, norm.MAX_HIDDEN + 1), device=device),
                                     torch.ones(norm.MAX_HIDDEN + 1, device=device))
    many = torch.zeros((combine_norm.MAX_SLOT_ROWS // 2 + 1, 4, 16), device=device)             # k * S too large
    assert not combine_norm.supports(many, weights, residual, norm_weight)


# -- the decode kernels' per-slot outputs ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k,split_k", [(1, 1, 1), (3, 2, 3), (2, 8, 2)])
def test_expert_partials_against_twin(device, dtype, num_tokens, top_k, split_k):
    num_experts, hidden, inter = 8, 48, 40
    x = _rand((num_tokens, hidden), dtype, device, 70)
    w_gate_up = _rand((num_experts, 2 * inter, hidden), dtype, device, 71, scale=0.2)
    w_down = _rand((num_experts, hidden, inter), dtype, device, 72, scale=0.2)
    gen = torch.Generator().manual_seed(73)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(device)
    weights = torch.softmax(_rand((num_tokens, top_k), torch.float32, device, 74), -1)
    cfg = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 16}, "down": {"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": split_k}}
    partial = decode.moe_expert_partials(x, w_gate_up, w_down, ids, cfg)
    assert partial.dtype == torch.float32 and partial.shape == (split_k, num_tokens * top_k, hidden)
    twin = ref.moe_expert_partials(x, w_gate_up, w_down, ids)                                 # [1, T*k, H]
    # act rounded once to the dtype on both sides (to a neighbouring value at a few elements: the interpreter's
    # bf16 cast truncates), the down projection in fp32 in another order: within an ulp of each act term
    act = ref_moe.moe_activation_reference(x, w_gate_up, ids).double().abs()                 # [T*k, I]
    magnitude = torch.einsum("si,shi->sh", act, w_down.double().abs()[ids.reshape(-1)])      # [T*k, H]
    ulp = 2.0 ** -_SIGNIFICAND_BITS[dtype] if dtype != torch.float32 else 2.0 ** -20
    assert ((partial.sum(0).double() - twin[0].double()).abs() <= ulp * magnitude + 1e-30).all()
    # moe_experts_decode is exactly the combine of these partials
    full = decode.moe_experts_decode(x, w_gate_up, w_down, ids, weights, cfg)
    assert torch.equal(full, ref.moe_combine(partial, weights, dtype))
    # and the twin's combine is the routed output up to the reference's rounding of each expert's output
    expected = ref_moe.moe_experts_reference(x, w_gate_up, w_down, ids, weights, out_dtype=torch.float32)
    got = ref.moe_combine(twin, weights, torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    assert (got - expected).abs().max().item() <= tol * expected.abs().max().item()


# -- dispatch -------------------------------------------------------------------------------------------------

def test_switch_needs_the_fused_decode_layer():
    with dispatch.override(fused_moe_combine=True, fused_decode_layer=True, fused_layer_ops=True):
        assert dispatch.fused_moe_combine()
        with dispatch.override(fused_decode_layer=False):
            assert not dispatch.fused_moe_combine()
        with dispatch.override(fused_layer_ops=False):
            assert not dispatch.fused_moe_combine()
    with dispatch.override(fused_moe_combine=False):
        assert not dispatch.fused_moe_combine()


def test_dispatch_runs_the_twin_on_cpu_under_auto():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check: under auto a CUDA tensor takes the kernel")
    args = _inputs(2, 2, 2, 24, torch.bfloat16, "cpu", 80)
    with dispatch.override(backend="auto"):
        got = dispatch.moe_combine_add_rms_norm(*args, 1e-6)
        combined = dispatch.moe_combine(args[0], args[1], torch.bfloat16)
    for a, b in zip(got, ref.moe_combine_add_rms_norm(*args, 1e-6)):
        assert torch.equal(a, b)
    assert torch.equal(combined, ref.moe_combine(args[0], args[1], torch.bfloat16))


def test_dispatch_composes_the_unfused_kernels_where_the_fused_one_cannot(device, triton_backend, monkeypatch):
    calls = []
    monkeypatch.setattr(combine_norm, "moe_combine_add_rms_norm", lambda *a, **k: calls.append("fused"))
    partial, weights, residual, norm_weight = _inputs(3, 2, 2, 24, torch.bfloat16, device, 81)
    fp32_weight = norm_weight.float()                               # not the residual's dtype: no fused kernel
    got = dispatch.moe_combine_add_rms_norm(partial, weights, residual, fp32_weight, 1e-6)
    assert calls == []
    combined = decode.combine_partials(partial, weights, torch.bfloat16)
    expected = norm.fused_add_rms_norm(combined, residual, fp32_weight, 1e-6)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    dispatch.moe_combine_add_rms_norm(partial, weights, residual, norm_weight, 1e-6)
    assert calls == ["fused"]


# -- whole models -----------------------------------------------------------------------------------------------

MOE_KERNEL_OPS = {"moe_experts", "moe_expert_partials", "moe_combine", "moe_align"}
LAYER_OPS = {"rms_norm", "fused_add_rms_norm", "apply_rotary_qk", "route_topk", "add_rms_norm_route",
             "qk_norm_rotary_write", "moe_combine_add_rms_norm"}


def _greedy(model, prompts, fused_combine: bool, monkeypatch, hooked: bool = False):
    """moekv_greedy with the experts on the Triton decode kernels and the layer ops on Triton (attention on the
    reference), fused_moe_combine on or off; -> tokens, logits, expert load, calls of the combine kernels."""
    from tests.hf_fixtures import moekv_greedy

    calls = {"combine": 0, "combine_norm": 0}
    with monkeypatch.context() as patch:
        for module, name, key in ((decode, "combine", "combine"),
                                  (combine_norm, "moe_combine_add_rms_norm", "combine_norm")):
            def spy(*args, _kernel=getattr(module, name), _key=key, **kwargs):
                calls[_key] += 1
                return _kernel(*args, **kwargs)
            patch.setattr(module, name, spy)
        patch.setattr(dispatch, "use_triton", lambda op, tensor, has_triton=True: op in MOE_KERNEL_OPS)
        patch.setattr(dispatch, "_layer_op_triton", lambda op, tensor: op in LAYER_OPS)
        handles = [model.layers[1].register_forward_hook(lambda *a: None)] if hooked else []
        try:
            with dispatch.override(backend="reference", fused_decode_layer=True, fused_moe_combine=fused_combine):
                model.reset_expert_load()
                tokens, logits = moekv_greedy(model, prompts, 2)             # the prefill and one decode step
        finally:
            for handle in handles:
                handle.remove()
        return tokens, logits, model.expert_load.clone(), calls


FAMILIES = MODEL_FAMILIES + [pytest.param("qwen2_moe", dict(num_experts=8, top_k=4), id="qwen2-shared-expert")]


def _compare(device, tmp_path, monkeypatch, family, overrides, dtype, hooked=False):
    from moekv.models import load_model
    from tests.hf_fixtures import make_checkpoint

    if device == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    path, _ = make_checkpoint(tmp_path, family, **overrides)
    prompts = [[5, 6, 7], [11]]
    model = load_model(path, dtype=dtype, device=device)
    off_tokens, off_logits, off_load, off_calls = _greedy(model, prompts, False, monkeypatch)
    tokens, logits, load, calls = _greedy(model, prompts, True, monkeypatch, hooked)
    moe_layers = sum(layer.is_moe for layer in model.layers)
    forwards = 2                                                 # the prefill step and one decode step
    assert off_calls == {"combine": forwards * moe_layers, "combine_norm": 0}
    if model.arch.shared_expert_intermediate_size > 0:
        assert calls == off_calls
    elif hooked:                                 # layer 1 hooked: layers 0 and 1 combine, the rest fuse
        assert calls == {"combine": forwards * 2, "combine_norm": forwards * (moe_layers - 2)}
    else:
        assert calls == {"combine": 0, "combine_norm": forwards * moe_layers}
    assert torch.equal(load, off_load)
    if INTERPRETED:
        assert tokens == off_tokens
        assert all(torch.equal(a, b) for a, b in zip(logits, off_logits))
    else:
        scale = max(b.abs().max().item() for b in off_logits)
        err = max((a - b).abs().max().item() for a, b in zip(logits, off_logits))
        assert err <= (1e-5 if dtype == torch.float32 else 2e-2) * scale, (err, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,overrides", FAMILIES)
def test_model_with_fused_moe_combine_matches_unfused(device, tmp_path, monkeypatch, family, overrides, dtype):
    """The same kernels but for the combine: on, every MoE layer's combine runs inside the next layer's input norm
    (or the final norm), no combine launch left; off, a combine launch per MoE layer. Logits bit-identical under the
    interpreter (fp32 and bf16); on a GPU within 1e-5 of the logit scale (fp32) / 2e-2 (bf16: the norm's fp32 sum of
    squares may take another order). A shared expert (Qwen2-MoE) keeps the block's own combine."""
    _compare(device, tmp_path, monkeypatch, family, overrides, dtype)


def test_model_top8_with_a_hooked_layer(device, tmp_path, monkeypatch):
    """Top-8 of 16 experts over three layers, the middle one with a forward hook: layer 0's output is summed before
    the hooked layer runs (which then keeps its own combine), layer 2's goes into the final norm."""
    overrides = dict(num_heads=4, num_kv_heads=2, head_dim=32, num_experts=16, top_k=8, norm_topk_prob=True,
                     num_layers=3)
    _compare(device, tmp_path, monkeypatch, "qwen3_moe", overrides, torch.float32, hooked=True)   # fp32: the
    # interpreter's bf16 is slow, and the hooked layer's routing of the combine does not depend on the dtype

"""The fused per-layer kernels (ops.triton.layer.norm / rotary / routing) against ops.reference.layers:
RMSNorm with and without the residual add, rotary of q and k in one launch, and top-k routing with the
expert-load count. Then a whole tiny model with only these four ops on Triton against the reference.

On CPU the kernels run under Triton's interpreter (bf16 rounding emulated bit for bit, see
ops.triton.layer.norm.round_to); on CUDA they run compiled. What each comparison can demand there:
  rotary   bit-equal on both: elementwise, launched without FMA contraction (ops.triton.layer.rotary).
  RMSNorm  the residual sum bit-equal; the output within a few ulps of its dtype (the fp32 sum of
           squares and the rsqrt cannot take torch's order / approximation, ops.triton.layer.norm).
  routing  weights within a few fp32 ulps (the sum of the exponentials' order); ids equal except
           where the reference's probabilities tie within 1e-6 (ops.triton.layer.routing).
"""

from __future__ import annotations

import pytest
import torch

from moekv.ops import dispatch
from moekv.ops.reference import layers as ref
from moekv.ops.triton.layer import norm, rotary, routing

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_SIGNIFICAND_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_SMALLEST = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}


def _rand(shape, dtype, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def ulp_error(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|actual - expected| in units in the last place of `dtype` at each expected value (float64)."""
    e, a = expected.double(), actual.double()
    _, exponent = torch.frexp(e)                                      # |e| in [2^(exponent-1), 2^exponent)
    ulp = torch.exp2((exponent - 1 - _SIGNIFICAND_BITS[dtype]).double())
    ulp = torch.where(e == 0, _SMALLEST[dtype], ulp).clamp_min(_SMALLEST[dtype])
    return (a - e).abs() / ulp


# RMSNorm bounds. fp32 output: the two sums of N <= 8192 positive squares (no cancellation) each carry a
# relative error of about (reduction depth) fp32 ulps, halved by the square root; torch's CUDA rsqrt
# (rsqrtf) and the kernel's mean division (div.full) add up to 2 ulps each, the two multiplies half an
# ulp each: 32 ulps (3.8e-6 relative) bounds it with room. 16-bit output: `normed` is rounded to the
# 16-bit dtype from fp32 values that far apart, so it is equal or the neighbouring value; the exact
# fp32 product with the weight then moves by at most one ulp before its own rounding: <= 2 ulps, at
# a small fraction of the elements (<= 1%, the chance that an fp32 value sits within 32 fp32 ulps of
# a 16-bit rounding boundary; fp32 outputs differ at most elements). A wrong rounding point (e.g. not
# rounding `normed` to the input dtype) makes 1-ulp differences at a large fraction of the elements;
# a missing residual add or eps, or a wrong weight, far more than 2 ulps.
NORM_MAX_ULPS = {torch.float32: 32, torch.bfloat16: 2, torch.float16: 2}
NORM_MAX_DIFFERING = 0.01


def _assert_norm_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    ulps = ulp_error(actual, expected, dtype)
    differing = int((actual != expected).sum())
    assert ulps.max() <= NORM_MAX_ULPS[dtype], (
        f"{dtype}: max error {ulps.max():.1f} ulps > {NORM_MAX_ULPS[dtype]} ({differing} of {actual.numel()} "
        f"elements differ)")
    if dtype == torch.float32:                                 # fp32: most elements differ by an ulp or two
        return
    assert differing <= max(2, NORM_MAX_DIFFERING * actual.numel()), (
        f"{dtype}: {differing} of {actual.numel()} elements differ (max {ulps.max():.1f} ulps)")


# -- RMSNorm ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 128), (1, 8192)])
def test_rms_norm_matches_reference(device, dtype, shape):
    x = _rand(shape, dtype, device, 0)
    w = _rand(shape[-1:], dtype, device, 1)
    _assert_norm_close(norm.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 37), (2, 4096)])
def test_fused_add_rms_norm_matches_reference(device, dtype, shape):
    x = _rand(shape, dtype, device, 2)
    residual = _rand(shape, dtype, device, 3, scale=4.0)
    w = _rand(shape[-1:], dtype, device, 4)
    normed, new_residual = norm.fused_add_rms_norm(x, residual, w, 1e-5)
    ref_normed, ref_residual = ref.fused_add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(new_residual, ref_residual)             # one rounding of an exact fp32 sum
    _assert_norm_close(normed, ref_normed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_large_values_and_strided_heads(device, dtype):
    # large values: the fp32 statistics must not overflow where x^2 of a 16-bit value is huge
    x = _rand((3, 64), dtype, device, 5, scale=3e4 if dtype != torch.float32 else 1e15)
    w = _rand((64,), dtype, device, 6)
    _assert_norm_close(norm.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)
    # small values: mean(x^2) ~ eps, so a dropped or misplaced eps moves the output by far more than an ulp
    small = _rand((3, 64), dtype, device, 14, scale=1e-3)
    _assert_norm_close(norm.rms_norm(small, w, 1e-6), ref.rms_norm(small, w, 1e-6), dtype)
    # per-head q norm on a [T, H, D] view of a fused qkv projection (strided, no copy)
    qkv = _rand((4, (3 + 2 * 2) * 16), dtype, device, 7)
    query = qkv[:, :48].reshape(4, 3, 16)
    assert not query.is_contiguous()
    w16 = _rand((16,), dtype, device, 8)
    _assert_norm_close(norm.rms_norm(query, w16, 1e-6), ref.rms_norm(query, w16, 1e-6), dtype)


def test_rms_norm_bf16_is_bit_exact_against_the_reference_order(device):
    """Rounding points as the model had them: (r + x) rounded, normed rounded, then weight * normed."""
    x = _rand((8, 96), torch.bfloat16, device, 9)
    residual = _rand((8, 96), torch.bfloat16, device, 10)
    w = _rand((96,), torch.bfloat16, device, 11)
    normed, new_residual = norm.fused_add_rms_norm(x, residual, w, 1e-6)
    hidden = residual + x
    assert torch.equal(new_residual, hidden)
    _assert_norm_close(normed, ref.rms_norm(hidden, w, 1e-6), torch.bfloat16)


# -- rotary -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hq,hkv,head_dim", [(1, 1, 1, 2), (3, 4, 2, 16), (2, 5, 1, 80), (48, 8, 2, 128)])
def test_rotary_qk_matches_reference(device, dtype, num_tokens, hq, hkv, head_dim):
    from moekv.layers.rotary import RotaryEmbedding

    qkv = _rand((num_tokens, (hq + 2 * hkv) * head_dim), dtype, device, 12, scale=50.0)
    query = qkv[:, :hq * head_dim].reshape(num_tokens, hq, head_dim)                       # strided views
    key = qkv[:, hq * head_dim:(hq + hkv) * head_dim].reshape(num_tokens, hkv, head_dim)
    positions = torch.tensor([0, 7, 300][:num_tokens] if num_tokens <= 3 else range(0, 61 * num_tokens, 61),
                             device=device)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, device)(positions, dtype)
    q_out, k_out = rotary.apply_rotary_qk(query, key, cos, sin)
    q_ref, k_ref = ref.apply_rotary_qk(query, key, cos, sin)
    # every rounding point as the reference on both devices (compiled without FMA contraction)
    for out, expected in ((q_out, q_ref), (k_out, k_ref)):
        ulps = ulp_error(out, expected, dtype)
        assert torch.equal(out, expected), (f"{int((out != expected).sum())} of {out.numel()} values differ, "
                                            f"max {ulps.max():.1f} ulps of {dtype}")
    assert q_out.is_contiguous() and k_out.shape == key.shape


# -- routing ----------------------------------------------------------------------------------------

# Weights: softmax in fp32 with torch's exp and correctly rounded divisions (ops.triton.layer.routing); only
# the order of the sum of the E exponentials differs (a few ulps), and renormalisation's sum of k
# values: 4e-6 relative (~32 fp32 ulps) bounds it with room. A wrong softmax or renormalisation is off
# by orders of magnitude more.
ROUTE_RTOL, ROUTE_ATOL = 4e-6, 1e-9
ROUTE_TIE = 1e-6          # ids may differ only where the reference's probabilities tie this closely


def _assert_routing_close(weights, ids, ref_weights, ref_ids, logits, top_k):
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == ref_ids.shape
    assert all(len(set(row)) == top_k for row in ids.tolist()), ids
    probs = torch.softmax(logits.float(), dim=-1)                       # the reference's probabilities
    ours, theirs = probs.gather(1, ids), probs.gather(1, ref_ids)
    swapped = ids != ref_ids
    tie = (ours - theirs).abs() <= ROUTE_TIE * theirs
    assert bool(tie[swapped].all()), (
        f"ids differ without a tie: ours {ids[swapped.any(1)].tolist()} vs reference "
        f"{ref_ids[swapped.any(1)].tolist()}, "
        f"relative probability gap {((ours - theirs).abs() / theirs)[swapped].max():.2e}")
    rel = ((weights - ref_weights).abs() / ref_weights.abs().clamp_min(1e-30)).max()
    assert torch.allclose(weights, ref_weights, rtol=ROUTE_RTOL, atol=ROUTE_ATOL), (
        f"weights off by {(weights - ref_weights).abs().max():.3e} (max relative {rel:.3e})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (8, 2), (60, 4), (256, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_topk_matches_reference(device, dtype, num_experts, top_k, renormalize):
    logits = _rand((5, num_experts), dtype, device, num_experts + top_k, scale=3.0)
    weights, ids = routing.route_topk(logits, top_k, renormalize)
    ref_weights, ref_ids = ref.route_topk(logits, top_k, renormalize)
    assert ids.shape == (5, top_k)
    _assert_routing_close(weights, ids, ref_weights, ref_ids, logits, top_k)


def test_route_topk_large_logits(device):
    logits = torch.tensor([[1e4, -1e4, 3e3, 9999.0], [-5e4, -5e4 + 1, -5e4 + 2, -5e4 + 3]], device=device)
    weights, ids = routing.route_topk(logits, 2, False)
    ref_weights, ref_ids = ref.route_topk(logits, 2, False)
    assert torch.isfinite(weights).all()
    assert torch.equal(ids, ref_ids)
    _assert_routing_close(weights, ids, ref_weights, ref_ids, logits, 2)


def test_route_topk_ties_take_the_lowest_index_first(device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0],          # three-way tie for two slots
                           [2.0, 2.0, 2.0, 2.0, 2.0],          # all equal
                           [0.0, 5.0, 1.0, 5.0, 5.0]], device=device)
    weights, ids = routing.route_topk(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [0, 1], [1, 3]]
    assert torch.allclose(weights, torch.full((3, 2), 0.5, device=device))
    # the reference (torch.topk) picks some tied pair: same weights, ids among the tied
    ref_weights, ref_ids = ref.route_topk(logits, 2, renormalize=True)
    assert torch.allclose(weights, ref_weights)
    assert set(ref_ids[0].tolist()) <= {1, 2, 3} and set(ref_ids[2].tolist()) <= {1, 3, 4}


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_topk_non_finite_logits_keep_ids_in_range(device, renormalize):
    # a token whose logits hold NaN or are all -inf: its ids stay distinct experts of [0, E) (an id of E would count
    # past expert_load's end, corrupting memory next to it), its weights NaN (visible downstream, as torch's);
    # the other tokens route exactly as alone
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[0.5, 2.0, -1.0, 3.0, 1.0],
                           [nan, nan, nan, nan, nan],
                           [-inf, -inf, -inf, -inf, -inf],
                           [1.0, nan, 0.0, 2.0, -1.0],
                           [4.0, 1.0, 3.0, 0.0, 2.0]], device=device)
    load = torch.zeros(6, dtype=torch.int64, device=device)                    # one guard entry past E = 5
    weights, ids = routing.route_topk(logits, 3, renormalize, load[:5])
    assert ((ids >= 0) & (ids < 5)).all() and all(len(set(row)) == 3 for row in ids.tolist())
    assert load[5].item() == 0 and load.sum().item() == 15
    assert torch.isnan(weights[1:4]).all() and torch.isfinite(weights[[0, 4]]).all()
    alone, alone_ids = routing.route_topk(logits[[0, 4]], 3, renormalize)
    assert torch.equal(ids[[0, 4]], alone_ids) and torch.equal(weights[[0, 4]], alone)


@pytest.mark.parametrize("valid", [None, [1, 0, 1, 1, 0, 0, 1]])
def test_route_topk_counts_expert_load_masked_by_token_valid(device, valid):
    logits = _rand((7, 6), torch.bfloat16, device, 13)
    token_valid = None if valid is None else torch.tensor(valid, dtype=torch.int64, device=device)
    load = torch.full((6,), 3, dtype=torch.int64, device=device)            # accumulates onto what is there
    ref_load = load.clone()
    _, ids = routing.route_topk(logits, 2, True, load, token_valid)
    ref.route_topk(logits, 2, True, ref_load, token_valid)
    assert torch.equal(load, ref_load)
    mask = torch.ones(7, dtype=torch.bool) if valid is None else torch.tensor(valid, dtype=torch.bool)
    expected = torch.bincount(ids.cpu()[mask].reshape(-1), minlength=6) + 3
    assert torch.equal(load.cpu(), expected)
    assert load.sum().item() == 18 + 2 * int(mask.sum())


# -- dispatch and a whole model ---------------------------------------------------------------------

def test_dispatch_runs_the_reference_on_cpu_under_auto():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    x, w = torch.randn(2, 8), torch.randn(8)
    with dispatch.override(backend="auto"):
        assert not dispatch.use_triton("rms_norm", x)
        assert torch.equal(dispatch.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))


def test_dispatch_forced_triton_matches_reference(device, triton_backend):
    x, r, w = (_rand(s, torch.bfloat16, device, i) for i, s in enumerate([(3, 40), (3, 40), (40,)]))
    normed, residual = dispatch.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(residual, r + x)
    _assert_norm_close(normed, ref.rms_norm(r + x, w, 1e-6), torch.bfloat16)
    dispatch._warned.discard("route_topk:unsupported")
    with pytest.warns(RuntimeWarning, match="no Triton routing"):                    # E > 256: the reference
        weights, ids = dispatch.route_topk(_rand((2, 300), torch.float32, device, 5), 2, True)
    assert ids.shape == (2, 2)


LAYER_OPS = {"rms_norm", "fused_add_rms_norm", "apply_rotary_qk", "route_topk"}

# Whole model, fused vs unfused, random weights (2 layers, hidden 64). fp32: each fused op is within a
# few fp32 ulps (~1e-6 relative) of the torch op and two random layers amplify that by O(1), so the
# logits agree to ~1e-6 of their scale; 1e-5 leaves a 10x margin, while a real bug (no residual add, the
# wrong rotary halves, wrong experts) moves them by 1e-2 of the scale or more. bf16: the fused ops only
# move single roundings by an ulp, a small part of the model's own bf16 rounding error, so the
# fused-vs-unfused error must stay within the unfused bf16 model's error against the fp32 model.
MODEL_FP32_REL = 1e-5


def _greedy_with_ops(model, prompts, fused: bool, monkeypatch):
    """moekv_greedy with the four layer ops on Triton (fused) or the reference, everything else
    (attention, experts) on the reference; the model's expert_load counts this run only."""
    from tests.hf_fixtures import moekv_greedy

    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "_layer_op_triton", lambda op, tensor: fused and op in LAYER_OPS)
        with dispatch.override(backend="reference"):
            model.reset_expert_load()
            tokens, logits = moekv_greedy(model, prompts, 3)
            return tokens, logits, model.expert_load.clone()


def _logit_error(prompts, tokens_a, logits_a, tokens_b, logits_b):
    """(max |a - b| over the rows both runs fed the same tokens, max |b|, [(prompt, step, top-2 margin of
    b) where greedy picked differently])."""
    err, scale, diverged = 0.0, 0.0, []
    for i, (prompt, ta, la, tb, lb) in enumerate(zip(prompts, tokens_a, logits_a, tokens_b, logits_b)):
        same = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), len(tb))
        rows = min(len(prompt) + same, lb.shape[0])          # row len(prompt) - 1 + j picks token j
        err = max(err, (la[:rows].float() - lb[:rows].float()).abs().max().item())
        scale = max(scale, lb.float().abs().max().item())
        if same < len(tb):
            top2 = lb[len(prompt) - 1 + same].float().topk(2).values
            diverged.append((i, same, (top2[0] - top2[1]).item()))
    return err, scale, diverged


# the whole-model cases of this file and test_fused_layer_kernels.py: (family, make_checkpoint overrides)
MODEL_FAMILIES = [
    pytest.param("mixtral", dict(num_heads=4, num_kv_heads=2, top_k=2), id="mixtral"),
    pytest.param("qwen3_moe", dict(num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8, top_k=4,
                                   norm_topk_prob=True), id="qwen3-head-qknorm"),
    pytest.param("olmoe", dict(num_heads=2, num_kv_heads=2, num_experts=6, top_k=2, clip_qkv=0.5),
                 id="olmoe-full-qknorm-clip"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,overrides", MODEL_FAMILIES)
def test_model_with_fused_layer_ops_matches_reference(device, tmp_path, monkeypatch, family, overrides, dtype):
    """Only the four per-layer ops on Triton (attention and experts stay on the reference), on the test
    device (the model must live there: compiled Triton kernels take CUDA tensors only)."""
    from moekv.models import load_model
    from tests.hf_fixtures import make_checkpoint

    if device == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)   # TF32 would magnify ulps
    path, _ = make_checkpoint(tmp_path, family, **overrides)
    prompts = [[5, 6, 7], [11]]
    model = load_model(path, dtype=dtype, device=device)
    ref_tokens, ref_logits, ref_load = _greedy_with_ops(model, prompts, False, monkeypatch)
    tokens, logits, load = _greedy_with_ops(model, prompts, True, monkeypatch)
    err, scale, diverged = _logit_error(prompts, tokens, logits, ref_tokens, ref_logits)
    if dtype == torch.float32:
        tol, what = MODEL_FP32_REL * scale, f"{MODEL_FP32_REL:g} * logit scale"
    else:
        fp32 = load_model(path, dtype=torch.float32, device=device)
        fp32_tokens, fp32_logits, _ = _greedy_with_ops(fp32, prompts, False, monkeypatch)
        tol = _logit_error(prompts, ref_tokens, ref_logits, fp32_tokens, fp32_logits)[0]
        what = "the unfused bf16 model's error against fp32"
    report = (f"{family} {dtype}: fused vs unfused max |logit error| {err:.3g} = {err / scale:.3g} of the logit "
              f"scale {scale:.3g}; tolerance {tol:.3g} ({what}); greedy divergences (prompt, step, reference "
              f"top-2 margin): {diverged}; expert_load |diff| {int((load - ref_load).abs().sum())}")
    print(report)
    assert err <= tol, report
    for _, _, margin in diverged:                          # a different greedy token only at a near-tie
        assert margin <= 2 * tol, report
    if not diverged:
        if dtype == torch.float32:
            assert torch.equal(load, ref_load), report
        else:                                              # a bf16 ulp may tip a near-tied router choice
            assert torch.equal(load.sum(1), ref_load.sum(1)), report


def test_hooked_layers_and_norms_take_the_unfused_order_with_identical_results(tmp_path):
    """Forward hooks on a decoder layer or a norm (the expert predictor) make that spot run the old
    unfused `hidden = hidden + out; norm(hidden)`: same bf16 logits, bit for bit, and the hooks see
    whole hidden states."""
    from moekv.models import load_model
    from tests.hf_fixtures import make_checkpoint, moekv_greedy

    path, _ = make_checkpoint(tmp_path, "mixtral", num_layers=3, num_heads=4, num_kv_heads=2, top_k=2)
    model = load_model(path, dtype=torch.bfloat16)
    prompts = [[5, 6, 7, 8], [11]]
    tokens, logits = moekv_greedy(model, prompts, 3)
    seen = {}
    def keep(name):
        def hook(module, inputs, output):
            seen.setdefault(name, (inputs[0], output))          # returns None: the output is kept
        return hook

    handles = [model.layers[0].register_forward_hook(keep("layer0")),
               model.layers[1].post_attn_norm.register_forward_hook(keep("norm1"))]
    try:
        hooked_tokens, hooked_logits = moekv_greedy(model, prompts, 3)
    finally:
        for handle in handles:
            handle.remove()
    assert hooked_tokens == tokens
    for ours, theirs in zip(hooked_logits, logits):
        assert torch.equal(ours, theirs)
    assert isinstance(seen["layer0"][1], torch.Tensor) and seen["layer0"][1].shape[-1] == model.arch.hidden_size
    norm_in, norm_out = seen["norm1"]
    assert torch.equal(norm_out, model.layers[1].post_attn_norm(norm_in))

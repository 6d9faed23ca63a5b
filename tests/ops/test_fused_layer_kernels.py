"""The two cross-op kernels of a decode layer against their reference twins (ops.reference.layers):
add + RMSNorm + router GEMV + top-k (ops.triton.layer.norm_route) and q/k norm + clip + rotary + the KV
write (ops.triton.layer.rotary_write); their dispatch; then whole tiny models with them on Triton.

On CPU the kernels run under Triton's interpreter, on CUDA compiled. What each comparison can demand:
  norm_route   the residual sum bit-equal; normed within the RMSNorm bounds of test_layer_kernels; the
               router logits within one ulp of the model dtype of the exact (float64) product of the
               kernel's own normed row with the router weight (plus the fp32 sum's error); weights / ids /
               expert load as the routing kernel's bounds demand on those logits.
  rotary_write without a norm bit-equal (elementwise, rounded at the reference's points); with one, the
               norm's few-ulp differences carried through rotary: at most 3 ulps of each product's
               magnitude, at <= 1% of the elements in 16 bits. The cache rows hold exactly the returned
               key and the (clipped) value; rows not written keep their contents.
"""

from __future__ import annotations

import pytest
import torch

from moekv.ops import dispatch
from moekv.ops.reference import layers as ref
from moekv.ops.triton.layer import norm_route, rotary_write
from tests.ops.test_layer_kernels import (_SIGNIFICAND_BITS, DTYPES, MODEL_FAMILIES, _assert_norm_close,
                                          _assert_routing_close, _rand)


# -- add + RMSNorm + router + top-k ---------------------------------------------------------------------------

def _ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    _, exponent = torch.frexp(values.double().abs().clamp_min(1e-300))
    return torch.exp2((exponent - 1 - _SIGNIFICAND_BITS[dtype]).double())


def _check_norm_route(x, residual, w, router, top_k, renormalize, eps=1e-6, valid=None, config=None):
    device, dtype = x.device, x.dtype
    num_tokens, num_experts = x.shape[0], router.shape[0]
    load = torch.full((num_experts,), 5, dtype=torch.int64, device=device)
    logits = torch.empty((num_tokens, num_experts), dtype=dtype, device=device)
    normed, new_residual, weights, ids = norm_route.add_rms_norm_route(
        x, residual, w, eps, router, top_k, renormalize, load, valid, logits_out=logits, config=config)
    ref_normed, ref_residual, ref_weights, ref_ids = ref.add_rms_norm_route(x, residual, w, eps, router, top_k,
                                                                            renormalize)
    assert torch.equal(new_residual, ref_residual)
    _assert_norm_close(normed, ref_normed, dtype)
    # logits: the kernel's normed row times the router, exactly, then rounded once (+ the fp32 sum's error)
    terms = normed.double()[:, None, :] * router.double()[None, :, :]                      # [T, E, H]
    exact = terms.sum(-1)
    bound = _ulp(exact, dtype) + x.shape[1] * 2.0 ** -24 * terms.abs().sum(-1) + 1e-300
    assert ((logits.double() - exact).abs() <= bound).all(), (logits, exact)
    # routing on those logits: the routing kernel's criteria against the reference's routing of them
    expect_weights, expect_ids = ref.route_topk(logits, top_k, renormalize)
    _assert_routing_close(weights, ids, expect_weights, expect_ids, logits, top_k)
    counted = torch.full((num_experts,), 5, dtype=torch.int64, device=device)
    ref.count_expert_load(ids, counted, valid)
    assert torch.equal(load, counted)
    return ref_ids, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden,num_experts,top_k", [(1, 64, 8, 2), (5, 37, 6, 2), (3, 1, 1, 1),
                                                                 (2, 256, 60, 4), (4, 128, 256, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_norm_route_matches_reference(device, dtype, num_tokens, hidden, num_experts, top_k, renormalize):
    x = _rand((num_tokens, hidden), dtype, device, 1)
    residual = _rand((num_tokens, hidden), dtype, device, 2, scale=4.0)
    w = _rand((hidden,), dtype, device, 3)
    router = _rand((num_experts, hidden), dtype, device, 4, scale=0.5)
    valid = torch.tensor([1, 0, 1, 1, 0][:num_tokens], dtype=torch.int64, device=device)
    _check_norm_route(x, residual, w, router, top_k, renormalize, valid=valid)


@pytest.mark.parametrize("block_e", [1, 4, 16])
def test_norm_route_in_two_launches_matches_one(device, block_e):
    """Routers larger than one program's share: blocks of experts per program, then the routing kernel."""
    x, residual = _rand((3, 96), torch.bfloat16, device, 5), _rand((3, 96), torch.bfloat16, device, 6)
    w, router = _rand((96,), torch.bfloat16, device, 7), _rand((40, 96), torch.bfloat16, device, 8)
    cfg = norm_route.launch_config(96, 40, 2)
    assert cfg["BLOCK_E"] >= 64                                   # the default: one block, routing fused
    ref_ids, ids = _check_norm_route(x, residual, w, router, 3, True, config=dict(BLOCK_E=block_e, SUB_E=block_e))
    fused_ids = _check_norm_route(x, residual, w, router, 3, True)[1]
    assert torch.equal(ids, fused_ids)


def test_norm_route_launch_shapes():
    mixtral = norm_route.launch_config(4096, 8, 2)               # 64 KB of router rows: one program per token
    assert mixtral["BLOCK_E"] == 8 and mixtral["SUB_E"] * mixtral["BLOCK_H"] <= norm_route.SUB_TILE
    qwen3 = norm_route.launch_config(2048, 128, 2)                # 512 KB: 8 programs of 16 experts
    assert qwen3["BLOCK_E"] == 16 and 128 // qwen3["BLOCK_E"] == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_route_adversarial(device, dtype):
    big = 3e4 if dtype != torch.float32 else 1e15
    # large activations (the fp32 statistics must not overflow), an all-zero row (rsqrt(eps): normed 0, all
    # logits 0 -> uniform softmax, ties to the lowest index), an odd hidden size
    x = _rand((3, 37), dtype, device, 9, scale=big)
    residual = _rand((3, 37), dtype, device, 10, scale=big)
    x[1], residual[1] = 0, 0
    w = _rand((37,), dtype, device, 11)
    router = _rand((8, 37), dtype, device, 12, scale=0.3)
    _, ids = _check_norm_route(x, residual, w, router, 2, True)
    assert ids[1].tolist() == [0, 1]
    # extreme logits: a router row of large weights wins with probability ~1 (softmax stays finite)
    router[5] = 30.0
    x = _rand((2, 37), dtype, device, 13).abs()
    residual = torch.zeros_like(x)
    w = torch.ones(37, dtype=dtype, device=device)
    _, ids = _check_norm_route(x, residual, w, router, 2, False)
    assert (ids[:, 0] == 5).all()


def test_norm_route_empty_and_unsupported(device):
    x = torch.zeros((0, 16), dtype=torch.bfloat16, device=device)
    out = norm_route.add_rms_norm_route(x, x, torch.ones(16, dtype=torch.bfloat16, device=device), 1e-6,
                                        torch.ones((4, 16), dtype=torch.bfloat16, device=device), 2, True)
    assert [tuple(t.shape) for t in out] == [(0, 16), (0, 16), (0, 2), (0, 2)]
    w16 = torch.ones(16, device=device)
    assert not norm_route.supports(x.float()[:, :8], x.float()[:, :8], w16, torch.ones((4, 16), device=device), 2)
    assert not norm_route.supports(x.float(), x.float(), w16, torch.ones((300, 16), device=device), 2)   # E > 256
    assert not norm_route.supports(x.float(), x.float(), w16.half(), torch.ones((4, 16), device=device), 2)


# -- q/k norm + clip + rotary + KV write ----------------------------------------------------------------------

def _qkv(num_tokens, hq, hkv, head_dim, dtype, device, seed, scale):
    qkv = _rand((num_tokens, (hq + 2 * hkv) * head_dim), dtype, device, seed, scale=scale)
    q = qkv[:, :hq * head_dim].reshape(num_tokens, hq, head_dim)                          # strided views
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].reshape(num_tokens, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim:].reshape(num_tokens, hkv, head_dim)
    return q, k, v


def _assert_rotated_close(out, expected, normed, cos, sin, dtype, exact):
    """out / expected [T, H, D]; normed: the reference's pre-rotary values (the products' magnitudes)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape and out.is_contiguous()
    if exact:
        assert torch.equal(out, expected), f"{int((out != expected).sum())} of {out.numel()} values differ"
        return
    half = out.shape[-1] // 2
    rotated = torch.cat((normed[..., half:], normed[..., :half]), -1).double().abs()
    scale = normed.double().abs() * cos.double().abs()[:, None] + rotated * sin.double().abs()[:, None]
    tol = 3 * 2.0 ** -_SIGNIFICAND_BITS[dtype] * scale + 2.0 ** -120
    err = (out.double() - expected.double()).abs()
    assert (err <= tol).all(), f"max error {err.max():.3g} over the bound (at {int((err > tol).sum())} elements)"
    if dtype != torch.float32:
        assert int((out != expected).sum()) <= max(2, 0.01 * out.numel())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["none", "head", "full"])
@pytest.mark.parametrize("clip", [None, 0.7])
@pytest.mark.parametrize("num_tokens,hq,hkv,head_dim", [(1, 1, 1, 2), (3, 4, 2, 16), (2, 5, 1, 80), (4, 8, 2, 128)])
def test_qk_norm_rotary_write_matches_reference(device, dtype, norm, clip, num_tokens, hq, hkv, head_dim):
    from moekv.layers.rotary import RotaryEmbedding

    q, k, v = _qkv(num_tokens, hq, hkv, head_dim, dtype, device, 14, scale=3.0 if clip is None else 1.0)
    positions = torch.tensor([0, 7, 300, 4097][:num_tokens], device=device)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, device)(positions, dtype)
    sizes = {"none": None, "head": (head_dim, head_dim), "full": (hq * head_dim, hkv * head_dim)}[norm]
    qw, kw = (None, None) if sizes is None else (_rand((sizes[0],), dtype, device, 15),
                                                 _rand((sizes[1],), dtype, device, 16))
    caches = [torch.full((9, hkv, head_dim), 7.0, dtype=dtype, device=device) for _ in range(4)]
    slots = torch.tensor([6, 0, 3, 8][:num_tokens], device=device)
    q_out, k_out = rotary_write.qk_norm_rotary_write(q, k, v, cos, sin, caches[0], caches[1], slots, qw, kw, 1e-6,
                                                     clip)
    q_ref, k_ref = ref.qk_norm_rotary_write(q, k, v, cos, sin, caches[2], caches[3], slots, qw, kw, 1e-6, clip)
    no_rotary = lambda a, b, c, s: (a, b)                                              # noqa: E731
    q_pre, k_pre = ref.compose_qk_norm_rotary_write(ref.rms_norm, no_rotary, q, k, v, cos, sin, None, None, None,
                                                    qw, kw, 1e-6, clip)
    _assert_rotated_close(q_out, q_ref, q_pre, cos, sin, dtype, exact=norm == "none")
    _assert_rotated_close(k_out, k_ref, k_pre, cos, sin, dtype, exact=norm == "none")
    assert torch.equal(caches[0][slots], k_out)                       # the cache rows hold what came back
    assert torch.equal(caches[1], caches[3])                          # values: clipped or as they are
    untouched = torch.ones(9, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (caches[0][untouched] == 7.0).all() and (caches[1][untouched] == 7.0).all()
    # without a cache: the same rotated q and k, nothing written
    q_only, k_only = rotary_write.qk_norm_rotary_write(q, k, v, cos, sin, q_norm_weight=qw, k_norm_weight=kw,
                                                       eps=1e-6, clip=clip)
    assert torch.equal(q_only, q_out) and torch.equal(k_only, k_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rotary_write_adversarial(device, dtype):
    from moekv.layers.rotary import RotaryEmbedding

    big = 3e4 if dtype != torch.float32 else 1e15
    q, k, v = _qkv(3, 4, 2, 32, dtype, device, 17, scale=big)
    q[1], k[1] = 0, 0                                                   # a zero token: normed to exactly 0
    cos, sin = RotaryEmbedding(32, 1e6, device)(torch.tensor([0, 1, 131071], device=device), dtype)
    qw, kw = _rand((32,), dtype, device, 18), _rand((32,), dtype, device, 19)
    caches = [torch.zeros((4, 2, 32), dtype=dtype, device=device) for _ in range(4)]
    slots = torch.tensor([3, 1, 2], dtype=torch.int32, device=device)                 # int32 slots too
    q_out, k_out = rotary_write.qk_norm_rotary_write(q, k, v, cos, sin, caches[0], caches[1], slots, qw, kw, 1e-6)
    q_ref, k_ref = ref.qk_norm_rotary_write(q, k, v, cos, sin, caches[2], caches[3], slots.long(), qw, kw, 1e-6)
    assert torch.isfinite(q_out).all() and (q_out[1] == 0).all() and (k_out[1] == 0).all()
    no_rotary = lambda a, b, c, s: (a, b)                                              # noqa: E731
    q_pre, k_pre = ref.compose_qk_norm_rotary_write(ref.rms_norm, no_rotary, q, k, v, cos, sin, None, None, None,
                                                    qw, kw, 1e-6)
    _assert_rotated_close(q_out, q_ref, q_pre, cos, sin, dtype, exact=False)
    _assert_rotated_close(k_out, k_ref, k_pre, cos, sin, dtype, exact=False)
    assert torch.equal(caches[1], caches[3]) and torch.equal(caches[0][slots.long()], k_out)
    # no norm: huge values rotate bit for bit as the reference
    q_out, k_out = rotary_write.qk_norm_rotary_write(q, k, v, cos, sin)
    q_ref, k_ref = ref.qk_norm_rotary_write(q, k, v, cos, sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_qk_norm_rotary_write_supports(device):
    q, k, v = _qkv(2, 4, 2, 16, torch.bfloat16, device, 20, 1.0)
    cos = sin = torch.ones((2, 16), dtype=torch.bfloat16, device=device)
    cache = torch.zeros((4, 2, 16), dtype=torch.bfloat16, device=device)
    slots = torch.tensor([0, 1], device=device)
    assert rotary_write.supports(q, k, v, cos, sin, cache, cache.clone(), slots)
    assert not rotary_write.supports(q, k, v, cos, sin, cache.float(), cache.float(), slots)   # cache dtype differs
    assert not rotary_write.supports(q, k, v, cos, sin, cache, None, slots)
    assert not rotary_write.supports(q, k, v, cos.float(), sin.float())
    w = torch.ones(16, dtype=torch.bfloat16, device=device)
    assert not rotary_write.supports(q, k, v, cos, sin, q_norm_weight=w)                 # k's weight missing
    assert not rotary_write.supports(q, k, v, cos, sin, q_norm_weight=torch.ones(48, dtype=torch.bfloat16),
                                     k_norm_weight=torch.ones(32, dtype=torch.bfloat16))   # neither D nor H*D


# -- dispatch ---------------------------------------------------------------------------------------------------

def test_dispatch_runs_the_twins_on_cpu_under_auto():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    x, r, w, router = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.randn(4, 8)
    with dispatch.override(backend="auto"):
        got = dispatch.add_rms_norm_route(x, r, w, 1e-6, router, 2, True)
    for a, b in zip(got, ref.add_rms_norm_route(x, r, w, 1e-6, router, 2, True)):
        assert torch.equal(a, b)


def test_dispatch_composes_the_unfused_kernels_where_the_fused_one_cannot(device, triton_backend, monkeypatch):
    calls = []
    monkeypatch.setattr(norm_route, "add_rms_norm_route", lambda *a, **k: calls.append("fused"))
    x, r = _rand((2, 16), torch.float32, device, 21), _rand((2, 16), torch.float32, device, 22)
    w, router = _rand((16,), torch.float32, device, 23), _rand((300, 16), torch.float32, device, 24)   # E > 256
    dispatch._warned.discard("route_topk:unsupported")
    with pytest.warns(RuntimeWarning, match="no Triton routing"):
        got = dispatch.add_rms_norm_route(x, r, w, 1e-6, router, 2, True)
    assert calls == []
    expected = ref.add_rms_norm_route(x, r, w, 1e-6, router, 2, True)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[3], expected[3])
    # an fp32 cache under a bf16 model: the rotary kernel, then the cache write by index_copy_ (rounding-free here)
    q, k, v = _qkv(2, 2, 1, 8, torch.bfloat16, device, 25, 1.0)
    cos = sin = torch.full((2, 8), 0.5, dtype=torch.bfloat16, device=device)
    caches = [torch.zeros((3, 1, 8), device=device) for _ in range(2)]
    q_out, k_out = dispatch.qk_norm_rotary_write(q, k, v, cos, sin, *caches, torch.tensor([2, 0], device=device))
    assert torch.equal(caches[0][[2, 0]], k_out.float()) and torch.equal(caches[1][[2, 0]], v.float())


# -- whole models ---------------------------------------------------------------------------------------------

FUSED_OPS = {"add_rms_norm_route", "qk_norm_rotary_write"}


def _greedy(model, prompts, fused: bool, monkeypatch):
    """moekv_greedy with the fused decode layer on (its two ops on Triton, everything else on the reference)
    or off (every op on the reference); -> tokens, logits, expert load, Triton calls per fused op."""
    from tests.hf_fixtures import moekv_greedy

    calls = {"norm_route": 0, "rotary_write": 0}
    with monkeypatch.context() as patch:
        for module, name in ((norm_route, "add_rms_norm_route"), (rotary_write, "qk_norm_rotary_write")):
            def spy(*args, _kernel=getattr(module, name), _key=module.__name__.rsplit(".", 1)[1], **kwargs):
                calls[_key] += 1
                return _kernel(*args, **kwargs)
            patch.setattr(module, name, spy)
        patch.setattr(dispatch, "_layer_op_triton", lambda op, tensor: fused and op in FUSED_OPS)
        with dispatch.override(backend="reference", fused_decode_layer=fused):
            model.reset_expert_load()
            tokens, logits = moekv_greedy(model, prompts, 3)
            return tokens, logits, model.expert_load.clone(), calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,overrides", MODEL_FAMILIES)
def test_model_with_fused_decode_layer_matches_unfused(device, tmp_path, monkeypatch, family, overrides, dtype):
    """The two fused kernels in a whole model (prefill and decode steps through the full-precision cache, whose
    rows the rotary kernel writes) against the same model with every op unfused on the reference; tolerances as
    test_layer_kernels' whole-model test (fp32: 1e-5 of the logit scale; bf16: the unfused bf16 model's own
    error against fp32)."""
    from moekv.models import load_model
    from tests.hf_fixtures import make_checkpoint
    from tests.ops.test_layer_kernels import MODEL_FP32_REL, _logit_error

    if device == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    path, _ = make_checkpoint(tmp_path, family, **overrides)
    prompts = [[5, 6, 7], [11]]
    model = load_model(path, dtype=dtype, device=device)
    ref_tokens, ref_logits, ref_load, unfused_calls = _greedy(model, prompts, False, monkeypatch)
    tokens, logits, load, calls = _greedy(model, prompts, True, monkeypatch)
    forwards = 3                                                 # the prefill step and two decode steps
    assert unfused_calls == {"norm_route": 0, "rotary_write": 0}
    assert calls == {"norm_route": forwards * model.arch.num_layers, "rotary_write": forwards * model.arch.num_layers}
    err, scale, diverged = _logit_error(prompts, tokens, logits, ref_tokens, ref_logits)
    if dtype == torch.float32:
        tol = MODEL_FP32_REL * scale
    else:
        fp32 = load_model(path, dtype=torch.float32, device=device)
        fp32_tokens, fp32_logits, _, _ = _greedy(fp32, prompts, False, monkeypatch)
        tol = _logit_error(prompts, ref_tokens, ref_logits, fp32_tokens, fp32_logits)[0]
    report = (f"{family} {dtype}: fused vs unfused max |logit error| {err:.3g} ({err / scale:.3g} of the scale "
              f"{scale:.3g}), tolerance {tol:.3g}; divergences {diverged}")
    print(report)
    assert err <= tol, report
    for _, _, margin in diverged:
        assert margin <= 2 * tol, report
    if not diverged:
        assert torch.equal(load.sum(1), ref_load.sum(1)), report
        if dtype == torch.float32:
            assert torch.equal(load, ref_load), report

"""Top-k routing in one launch (the Triton twin of ops.reference.layers.route_topk): softmax over the
experts in fp32, top-k, optional renormalisation and the expert-load count, one token per program.

Top-k is k rounds of (max, lowest index holding it, knock it out), so ties between equal
probabilities go to the lowest expert index first. The expert-load count is k atomic adds into
expert_load [E] (int64), skipped for tokens whose token_valid is 0 (padding rows of a CUDA-graph
bucket) -- it replaces the reference's index_add_ and its mask expansion.

Numerics against torch.softmax: on CUDA the exponential is libdevice's expf (the CUDA math library's,
as torch's softmax kernel calls; tl.exp would be ex2.approx of x * log2(e), whose error grows with
|x - max|) and both divisions are correctly rounded (div_rn; `/` compiles to the approximate
div.full.f32). What stays different is the order of the fp32 sum of the exponentials, so weights
agree to a few fp32 ulps, and ids agree except where two probabilities tie to that precision. That order
follows the launch's warp count (the reductions' layouts): ops.triton.layer.norm_route launches this kernel
with its own warps, so its in-launch routing (topk_epilogue) and this second launch give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moekv.ops.triton import pdl
from moekv.ops.triton.common import check_launchable

MAX_EXPERTS = 256


@triton.jit
def topk_epilogue(x, experts, emask, t, weights_ptr, ids_ptr, load_ptr, valid_ptr,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_LOAD: tl.constexpr, HAS_VALID: tl.constexpr,
                  E_PAD: tl.constexpr, K_PAD: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """Token t's fp32 logits x [E_PAD] (-inf where not emask) -> softmax, top-k, renormalisation, stored to
    weights / ids [T, TOP_K] (contiguous), and the expert-load count (also used by ops.triton.layer.norm_route)."""
    shifted = x - tl.max(x, axis=0)
    if LIBDEVICE_EXP:                                                     # compiled (CUDA): expf
        e = libdevice.exp(shifted)
    else:                                                                 # the interpreter: numpy's exp
        e = tl.exp(shifted)
    e = tl.where(emask, e, 0.0)
    probs = tl.math.div_rn(e, tl.sum(e, axis=0))                          # [E_PAD]
    # probabilities are >= 0; a NaN one (a token whose logits hold NaN, or are all -inf) ranks below every real
    # one (-1) but above the experts already chosen (-2) and the padding (-3), so the ids stay distinct experts
    # of [0, E) whatever the logits (an id of E_PAD would count its load past expert_load's end); such a
    # token's weights are NaN, as torch's softmax gives them, so the non-finite value stays visible downstream
    work = tl.where(emask, tl.where(probs == probs, probs, -1.0), -3.0)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], tl.float32)
    ids = tl.zeros([K_PAD], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(work, axis=0)
        index = tl.min(tl.where(work == best, experts, E_PAD), axis=0)   # lowest index among equals
        weights = tl.where(slots == i, tl.where(best >= 0.0, best, float("nan")), weights)
        ids = tl.where(slots == i, index, ids)
        work = tl.where(experts == index, -2.0, work)
    kmask = slots < TOP_K
    if RENORMALIZE:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=0))
    tl.store(weights_ptr + t * TOP_K + slots, weights, mask=kmask)
    tl.store(ids_ptr + t * TOP_K + slots, ids.to(tl.int64), mask=kmask)
    if HAS_LOAD:
        if HAS_VALID:
            count = tl.load(valid_ptr + t).to(tl.int64)
        else:
            count = tl.full([], 1, tl.int64)
        counts = tl.zeros([K_PAD], tl.int64) + count
        tl.atomic_add(load_ptr + ids, counts, mask=kmask & (counts != 0), sem="relaxed")


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, load_ptr, valid_ptr, num_experts, stride_t,
                       TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_LOAD: tl.constexpr,
                       HAS_VALID: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                       LIBDEVICE_EXP: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl.enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    emask = experts < num_experts
    x = tl.load(logits_ptr + t * stride_t + experts, mask=emask, other=float("-inf")).to(tl.float32)
    topk_epilogue(x, experts, emask, t, weights_ptr, ids_ptr, load_ptr, valid_ptr, TOP_K, RENORMALIZE, HAS_LOAD,
                  HAS_VALID, E_PAD, K_PAD, LIBDEVICE_EXP)


def supports(logits: torch.Tensor, top_k: int, expert_load: torch.Tensor | None = None) -> bool:
    if logits.dim() != 2 or not 1 <= logits.shape[1] <= MAX_EXPERTS or not 1 <= top_k <= logits.shape[1]:
        return False
    if expert_load is not None and (expert_load.dtype != torch.int64 or not expert_load.is_contiguous()):
        return False
    return logits.dtype in (torch.float32, torch.float16, torch.bfloat16)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, expert_load: torch.Tensor | None = None,
               token_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ops.reference.layers.route_topk (ties: lowest expert index first)."""
    check_launchable(_route_topk_kernel, logits)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if token_valid is not None and not token_valid.is_contiguous():
        token_valid = token_valid.contiguous()
    _route_topk_kernel[(num_tokens,)](
        logits, weights, ids, expert_load if expert_load is not None else ids,
        token_valid if token_valid is not None else ids, num_experts, logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_LOAD=expert_load is not None, HAS_VALID=token_valid is not None,
        E_PAD=triton.next_power_of_2(max(num_experts, 2)), K_PAD=triton.next_power_of_2(max(top_k, 2)),
        LIBDEVICE_EXP=logits.is_cuda, num_warps=1 if num_experts <= 64 else 2, **pdl.launch_kwargs(logits))
    return weights, ids

"""Residual add + RMSNorm + the router GEMV + softmax / top-k + the expert-load count in one launch (the Triton
twin of ops.reference.layers.add_rms_norm_route): the post-attention half of an MoE decoder layer up to its
experts, for decode-size batches.

Grid (T, expert blocks). Every program of token t holds the row in registers: the residual sum, rounded to the
model dtype (stored as the new residual), the fp32 statistics and the normalised row, rounded as
ops.triton.layer.norm rounds them (the same code: residual sum and normed output bit for bit the norm
kernel's). Then it reads its block of router rows W[e, :] (all H of them, in sub-tiles of <= 16K values) and
reduces normed * W over H in fp32 (products of two 16-bit values are exact in fp32), rounding each logit to the
model dtype as F.linear's output is. Logits go to a [T, E] buffer (the model dtype; `logits_out` when given).

One block of experts (the router weight of a token fits ROUTER_BYTES_PER_PROGRAM: Mixtral-8x7B's [8, 4096] bf16,
64 KB): the same program then reads its row of logits back after a CTA barrier (global stores of a CTA are
visible to its threads after bar.sync) and runs the routing epilogue of ops.triton.layer.routing (softmax with
expf, top-k with ties to the lowest index, renormalisation, atomic expert-load count): one launch for the
four of norm / router GEMM / split-K reduce / route. More experts (Qwen3-30B-A3B: [128, 2048], 512 KB): blocks of
ROUTER_BYTES_PER_PROGRAM per program (8 programs per token for Qwen3), and then either

* the fold (`route_counters` given: an int32 buffer of at least T zeros, the MoE block's): every program of token
  t counts its arrival on route_counters[t] after storing its logits (bar.sync, one gpu-scope acq_rel atomic,
  bar.sync: the pattern and ordering argument of ops.triton.attention.split_k.combine_if_last), and the last of the
  token's programs to arrive reads the whole row of stored, rounded logits back from L2 and runs the same routing
  epilogue, then stores 0 to its counter (the buffer is zero again between launches, so a captured CUDA graph
  replays it as it is). Nobody waits: the last arrival does the work, deadlock-free at any occupancy. One launch.
* or (no counters) the routing kernel as a second launch, with this kernel's warp count: two launches.

Both read the same rounded logits back and run topk_epilogue with the same warps, so ids, weights and the load
count are the same bits either way (and the same as the one-block launch of a router of that shape would give).

Each program re-reads the router weight for its token: worth it for decode-size T only (the model takes this
path up to KernelConfig.FUSED_ROUTER_MAX_TOKENS tokens). No host reads: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton import pdl
from moekv.ops.triton.common import check_launchable
from moekv.ops.triton.layer.norm import MAX_HIDDEN, round_to
from moekv.ops.triton.layer.routing import MAX_EXPERTS, _route_topk_kernel, topk_epilogue

ROUTER_BYTES_PER_PROGRAM = 64 * 1024     # router rows one program reads (one SM streams this in ~2 us)
SUB_TILE = 16384                         # router values per sub-tile of a program's loop (registers)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _route_if_last(counter_ptr, logits_ptr, num_arrivals, t, num_experts, weights_ptr, ids_ptr, load_ptr, valid_ptr,
                   TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_LOAD: tl.constexpr, HAS_VALID: tl.constexpr,
                   E_PAD: tl.constexpr, K_PAD: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """Count this program's arrival at counter_ptr (token t's); the last of num_arrivals reads the token's logits
    row [E] (logits_ptr: its start) back and routes it, then leaves the counter 0. This program's logits must be
    stored before the call. Memory ordering: split_k.combine_if_last's steps 2-6 (bar.sync; one thread's gpu-scope
    acq_rel add; bar.sync; reads through L2 with .cg; the reset after the reads)."""
    tl.debug_barrier()                                        # every thread's logit stores before the release
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()                                        # the acquire before any thread's read-back
    if arrived == num_arrivals - 1:
        experts = tl.arange(0, E_PAD)
        emask = experts < num_experts
        logits = tl.load(logits_ptr + experts, mask=emask, other=float("-inf"), cache_modifier=".cg")
        topk_epilogue(logits.to(tl.float32), experts, emask, t, weights_ptr, ids_ptr, load_ptr, valid_ptr, TOP_K,
                      RENORMALIZE, HAS_LOAD, HAS_VALID, E_PAD, K_PAD, LIBDEVICE_EXP)
        tl.store(counter_ptr, 0)                              # every program of this token has arrived


@triton.jit
def _add_norm_route_kernel(
    x_ptr, res_ptr, nw_ptr, rw_ptr,                       # x, residual [T, H]; norm weight [H]; router [E, H]
    normed_ptr, new_res_ptr, logits_ptr,                  # [T, H], [T, H] contiguous; [T, E] contiguous
    weights_ptr, ids_ptr, load_ptr, valid_ptr,            # [T, k] fp32, [T, k] int64; [E] int64; [T]
    counters_ptr,                                         # [>= T] int32 zeros (FOLD), else unused
    hidden, num_experts, eps, stride_xt, stride_rt, stride_we,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_LOAD: tl.constexpr, HAS_VALID: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, SUB_E: tl.constexpr, FUSE_TOPK: tl.constexpr,
    E_PAD: tl.constexpr, K_PAD: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, EMULATE_BF16: tl.constexpr,
    FOLD: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < hidden
    x = tl.load(x_ptr + t * stride_xt + cols, mask=hmask, other=0.0)
    r = tl.load(res_ptr + t * stride_rt + cols, mask=hmask, other=0.0)
    s = round_to(x.to(tl.float32) + r.to(tl.float32), new_res_ptr.dtype.element_ty, EMULATE_BF16)   # `r + x`
    sf = s.to(tl.float32)
    variance = tl.sum(sf * sf, axis=0) / hidden
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(variance + eps))
    normed = round_to(sf * rstd, s.dtype, EMULATE_BF16).to(tl.float32)      # rounded to the input dtype first
    w = tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    out = round_to(w * normed, normed_ptr.dtype.element_ty, EMULATE_BF16)
    if block == 0:
        tl.store(new_res_ptr + t * hidden + cols, s, mask=hmask)
        tl.store(normed_ptr + t * hidden + cols, out, mask=hmask)
    outf = out.to(tl.float32)
    for i in tl.static_range(BLOCK_E // SUB_E):
        experts = block * BLOCK_E + i * SUB_E + tl.arange(0, SUB_E)
        emask = experts < num_experts
        rows = tl.load(rw_ptr + experts[:, None].to(tl.int64) * stride_we + cols[None, :],
                       mask=emask[:, None] & hmask[None, :], other=0.0)                   # [SUB_E, BLOCK_H]
        logit = tl.sum(rows.to(tl.float32) * outf[None, :], axis=1)                       # [SUB_E] fp32
        tl.store(logits_ptr + t * num_experts + experts,
                 round_to(logit, logits_ptr.dtype.element_ty, EMULATE_BF16), mask=emask)   # F.linear's rounding
    if FUSE_TOPK:
        tl.debug_barrier()                                    # this CTA's logit stores -> visible to all its threads
        experts = tl.arange(0, E_PAD)
        emask = experts < num_experts
        logits = tl.load(logits_ptr + t * num_experts + experts, mask=emask, other=float("-inf")).to(tl.float32)
        topk_epilogue(logits, experts, emask, t, weights_ptr, ids_ptr, load_ptr, valid_ptr, TOP_K, RENORMALIZE,
                      HAS_LOAD, HAS_VALID, E_PAD, K_PAD, LIBDEVICE_EXP)
    if FOLD:                                                  # several blocks: the token's last arrival routes
        _route_if_last(counters_ptr + t, logits_ptr + t * num_experts, tl.num_programs(1), t, num_experts,
                       weights_ptr, ids_ptr, load_ptr, valid_ptr, TOP_K, RENORMALIZE, HAS_LOAD, HAS_VALID, E_PAD,
                       K_PAD, LIBDEVICE_EXP)


def supports(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, router_weight: torch.Tensor,
             top_k: int, expert_load: torch.Tensor | None = None) -> bool:
    """x, residual [T, H] of one float dtype; norm weight [H] and router [E, H] (rows contiguous) of that dtype,
    H <= MAX_HIDDEN, 1 <= top_k <= E <= MAX_EXPERTS; expert_load contiguous int64 [E]."""
    if x.dim() != 2 or residual.shape != x.shape or x.dtype not in DTYPES or residual.dtype != x.dtype:
        return False
    hidden = x.shape[1]
    if not 1 <= hidden <= MAX_HIDDEN or norm_weight.shape != (hidden,) or norm_weight.dtype != x.dtype:
        return False
    if router_weight.dim() != 2 or router_weight.shape[1] != hidden or router_weight.dtype != x.dtype:
        return False
    if router_weight.stride(1) != 1 or not 1 <= top_k <= router_weight.shape[0] <= MAX_EXPERTS:
        return False
    return expert_load is None or (expert_load.dtype == torch.int64 and expert_load.is_contiguous()
                                   and expert_load.shape == (router_weight.shape[0],))


def _prev_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def launch_config(hidden: int, num_experts: int, element_size: int) -> dict:
    """BLOCK_H, SUB_E, BLOCK_E (experts per program), num_warps for a router of [num_experts, hidden]."""
    block_h = triton.next_power_of_2(hidden)
    e_pad = triton.next_power_of_2(num_experts)
    sub_e = max(1, min(e_pad, SUB_TILE // block_h))
    block_e = max(sub_e, min(e_pad, _prev_pow2(ROUTER_BYTES_PER_PROGRAM // (block_h * element_size))))
    return dict(BLOCK_H=block_h, SUB_E=sub_e, BLOCK_E=block_e, num_warps=min(16, max(1, sub_e * block_h // 1024)))


def add_rms_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       router_weight: torch.Tensor, top_k: int, renormalize: bool,
                       expert_load: torch.Tensor | None = None, token_valid: torch.Tensor | None = None,
                       logits_out: torch.Tensor | None = None, route_counters: torch.Tensor | None = None,
                       config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ops.reference.layers.add_rms_norm_route. logits_out [T, E] (contiguous, the model dtype):
    where the router logits go (else a new buffer). route_counters: contiguous int32 zeros, at least T of them, on
    x's device (the MoE block's), left zero: a router of several blocks is routed by each token's last program
    (one launch) instead of by a second launch; unused for one block. config: overrides of launch_config
    (BLOCK_E, SUB_E, num_warps)."""
    check_launchable(_add_norm_route_kernel, x)
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    device = x.device
    normed = torch.empty((num_tokens, hidden), dtype=x.dtype, device=device)
    new_residual = torch.empty((num_tokens, hidden), dtype=x.dtype, device=device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    logits = logits_out if logits_out is not None else torch.empty((num_tokens, num_experts), dtype=x.dtype,
                                                                   device=device)
    assert logits.shape == (num_tokens, num_experts) and logits.dtype == x.dtype and logits.is_contiguous()
    if num_tokens == 0:
        return normed, new_residual, weights, ids
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    norm_weight = norm_weight.contiguous()
    if token_valid is not None and not token_valid.is_contiguous():
        token_valid = token_valid.contiguous()
    cfg = {**launch_config(hidden, num_experts, x.element_size()), **(config or {})}
    cfg["SUB_E"] = min(cfg["SUB_E"], cfg["BLOCK_E"])
    num_blocks = triton.cdiv(num_experts, cfg["BLOCK_E"])
    e_pad = triton.next_power_of_2(max(num_experts, 2))
    k_pad = triton.next_power_of_2(max(top_k, 2))
    fuse = num_blocks == 1
    fold = not fuse and route_counters is not None
    if fold:
        _check_counters(route_counters, num_tokens, x.device)
    routing = dict(TOP_K=top_k, RENORMALIZE=renormalize, HAS_LOAD=expert_load is not None,
                   HAS_VALID=token_valid is not None, E_PAD=e_pad, K_PAD=k_pad, LIBDEVICE_EXP=x.is_cuda)
    load_arg = expert_load if expert_load is not None else ids
    valid_arg = token_valid if token_valid is not None else ids
    _add_norm_route_kernel[(num_tokens, num_blocks)](
        x, residual, norm_weight, router_weight, normed, new_residual, logits, weights, ids, load_arg, valid_arg,
        route_counters if fold else ids, hidden, num_experts, eps, x.stride(0), residual.stride(0),
        router_weight.stride(0), FUSE_TOPK=fuse, EMULATE_BF16=not x.is_cuda, FOLD=fold, enable_fp_fusion=False,
        **routing, **cfg, **pdl.launch_kwargs(x))
    if not fuse and not fold:               # more router rows than one program reads, no counters: a second launch,
        _route_topk_kernel[(num_tokens,)](  # with the fused kernel's warps (the fold's reduction layouts, its bits)
            logits, weights, ids, load_arg, valid_arg, num_experts, logits.stride(0), num_warps=cfg["num_warps"],
            enable_fp_fusion=False, **routing, **pdl.launch_kwargs(x))
    return normed, new_residual, weights, ids


def _check_counters(counters: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    if (counters.dtype != torch.int32 or counters.dim() != 1 or not counters.is_contiguous()
            or counters.numel() < num_tokens or counters.device != device):
        raise ValueError(f"route_counters must be a contiguous int32 vector of at least {num_tokens} zeros on "
                         f"{device}, got {counters.dtype} {tuple(counters.shape)} on {counters.device}")

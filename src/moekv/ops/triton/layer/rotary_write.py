"""q/k RMSNorm + clipping + rotary + the full-precision KV write in one launch (the Triton twin of
ops.reference.layers.qk_norm_rotary_write).

One program per token holds all of the token's q heads, then all of its k heads, as two half tiles
[heads, D/2] (the rotate_half pairs). In the attention layer's order: the norm over the whole projection
(NORM 1, OLMoE: a weight of H*D values) or none, clipping to +-clip (CLIP), the per-head norm (NORM 2,
Qwen3-MoE: a weight of D values), then rotary. Norms round as ops.triton.layer.norm does (fp32 statistics,
the normed value rounded to the dtype before the weight multiply), rotary as ops.triton.layer.rotary does
(every product and the sum rounded to the dtype); the launch passes enable_fp_fusion=False for both (see
those modules). Rotated q and k go to new contiguous tensors; with a cache (WRITE) the rotated key and the
(clipped) value of token t also go to row slots[t] of key_cache / value_cache [S, Hkv, D] -- the
full-precision page format's write (FullPrecisionKVCache.fused_write_target), replacing its two index_copy_
launches. The checked write (WRITE 2, flags given: the low-bit format's decode staging, LowBitKVCache.
fused_write_target) holds the token's rotated key and clipped value tiles, counts their NaN / Inf over all kv
heads, sets flags[t] when any (never clears it), zeroes both, and stores them to row slots[t] and to row t of
the persistent copies key_copy / value_copy -- ops.triton.lowbit.stage's work, in the same launch. The rows
are of the input dtype (supports()), so what is checked is what is stored. Padding tokens of a CUDA-graph
bucket may share a slot (the runner's scratch page): one of them wins, as with index_copy_. No host reads:
CUDA-graph safe.

Replaces per layer: rotary + 2 index_copy_ (Mixtral, bf16 KV), q norm + k norm + rotary + 2 index_copy_
(Qwen3-MoE); with a low-bit cache's decode step (checked write) rotary (+ q norm + k norm) + the staging
launch; without a cache (a low-bit cache's prefill / lazy steps stage their own keys) q norm + k norm + rotary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton import pdl
from moekv.ops.triton.common import check_launchable
from moekv.ops.triton.layer.norm import round_to
from moekv.ops.triton.layer.rotary import load_cos_sin

MAX_VALUES = 16384          # q (or k) values of one token held in registers
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _norm_halves(x1, x2, w1, w2, rstd, dt: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """(round(w * round(x * rstd)) for both halves), as ops.triton.layer.norm rounds; rstd broadcasts."""
    n1 = round_to(x1 * rstd, dt, EMULATE_BF16).to(tl.float32)
    n2 = round_to(x2 * rstd, dt, EMULATE_BF16).to(tl.float32)
    return (round_to(w1 * n1, dt, EMULATE_BF16).to(tl.float32), round_to(w2 * n2, dt, EMULATE_BF16).to(tl.float32))


@triton.jit
def _clamp(x, clip):
    """x clamped to +-clip, NaN kept NaN (as torch.clamp; a GPU's min / max would return the other operand)."""
    return tl.where(x != x, x, tl.minimum(tl.maximum(x, -clip), clip))


@triton.jit
def _transform(src_ptr, stride_t, stride_h, t, num_heads, half, c1, c2, s1, s2, w_ptr, eps, clip,
               NORM: tl.constexpr, CLIP: tl.constexpr, ROTATE: tl.constexpr, BLOCK_H: tl.constexpr,
               HALF: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Norm / clip / rotate the heads of token t of one of q, k, v -> the two half tiles [BLOCK_H, HALF] in the
    input dtype and their mask. ROTATE False (v): clip only."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
    src = src_ptr + t * stride_t + heads[:, None] * stride_h + dims[None, :]              # [BLOCK_H, HALF]
    a = tl.load(src, mask=mask, other=0.0)
    dt = a.dtype
    x1 = a.to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    head_dim = 2 * half
    if NORM == 1:                                        # over all heads (the whole projection), weight [H * D]
        total = tl.sum(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), axis=0)
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(total / (num_heads * head_dim) + eps))
        woff = heads[:, None] * head_dim + dims[None, :]
        w1 = tl.load(w_ptr + woff, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + woff + half, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = _norm_halves(x1, x2, w1, w2, rstd, dt, EMULATE_BF16)
    if CLIP:                                             # exact: a clamp of 16-bit values, then rounded as torch's
        x1 = round_to(_clamp(x1, clip), dt, EMULATE_BF16).to(tl.float32)
        x2 = round_to(_clamp(x2, clip), dt, EMULATE_BF16).to(tl.float32)
    if NORM == 2:                                        # per head, weight [D]
        per_head = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)                        # [BLOCK_H]
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(per_head / head_dim + eps))[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)[None, :]
        x1, x2 = _norm_halves(x1, x2, w1, w2, rstd, dt, EMULATE_BF16)
    if ROTATE:                                           # rotate_half: each product and the sum rounded to dt
        p1 = round_to(x1 * c1[None, :], dt, EMULATE_BF16).to(tl.float32)
        q1 = round_to(-x2 * s1[None, :], dt, EMULATE_BF16).to(tl.float32)
        p2 = round_to(x2 * c2[None, :], dt, EMULATE_BF16).to(tl.float32)
        q2 = round_to(x1 * s2[None, :], dt, EMULATE_BF16).to(tl.float32)
        o1 = round_to(p1 + q1, dt, EMULATE_BF16)
        o2 = round_to(p2 + q2, dt, EMULATE_BF16)
    else:
        o1 = x1.to(dt)                                   # exact: x1 / x2 hold dt values
        o2 = x2.to(dt)
    return o1, o2, mask


@triton.jit
def _store(ptr, row, stride_r, stride_h, o1, o2, mask, half, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """The half tiles to row `row` of ptr [R, H, D] (strides stride_r / stride_h, unit along D), in ptr's dtype."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    dst = ptr + row * stride_r + heads[:, None] * stride_h + dims[None, :]
    tl.store(dst, o1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, o2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _num_bad(o1, o2, mask):
    """How many masked-in elements of the two half tiles are NaN or +-Inf."""
    a = o1.to(tl.float32)
    b = o2.to(tl.float32)
    bad = ((a != a) | (tl.abs(a) == float("inf")) | (b != b) | (tl.abs(b) == float("inf"))) & mask
    return tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)


@triton.jit
def _qk_norm_rotary_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr,
    kc_ptr, vc_ptr, slots_ptr, flags_ptr, kcopy_ptr, vcopy_ptr,
    num_q_heads, num_k_heads, half, eps, clip,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st, stride_cs, stride_ch,
    stride_pt, stride_ph,
    NORM: tl.constexpr, CLIP: tl.constexpr, WRITE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr, EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """WRITE 0: no cache; 1: the rows at slots[t]; 2: checked (flags, zeros where non-finite, and the copies)."""
    pdl.enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = load_cos_sin(cos_ptr, sin_ptr, t, stride_ct, stride_st, half, HALF)
    q1, q2, q_mask = _transform(q_ptr, stride_qt, stride_qh, t, num_q_heads, half, c1, c2, s1, s2, qw_ptr, eps, clip,
                                NORM, CLIP, True, BLOCK_HQ, HALF, EMULATE_BF16)
    _store(q_out_ptr, t, num_q_heads * 2 * half, 2 * half, q1, q2, q_mask, half, BLOCK_HQ, HALF)
    k1, k2, k_mask = _transform(k_ptr, stride_kt, stride_kh, t, num_k_heads, half, c1, c2, s1, s2, kw_ptr, eps, clip,
                                NORM, CLIP, True, BLOCK_HK, HALF, EMULATE_BF16)
    _store(k_out_ptr, t, num_k_heads * 2 * half, 2 * half, k1, k2, k_mask, half, BLOCK_HK, HALF)
    if WRITE != 0:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        v1, v2, _ = _transform(v_ptr, stride_vt, stride_vh, t, num_k_heads, half, c1, c2, s1, s2, kw_ptr, eps, clip,
                               0, CLIP, False, BLOCK_HK, HALF, EMULATE_BF16)
        if WRITE == 2:
            # the rows' dtype is the input dtype (supports()): these are the values stored, and the ones checked
            num_bad = _num_bad(k1, k2, k_mask) + _num_bad(v1, v2, k_mask)
            finite = num_bad == 0
            k1 = tl.where(finite, k1, tl.zeros_like(k1))
            k2 = tl.where(finite, k2, tl.zeros_like(k2))
            v1 = tl.where(finite, v1, tl.zeros_like(v1))
            v2 = tl.where(finite, v2, tl.zeros_like(v2))
            if not finite:
                tl.store(flags_ptr + t, 1)               # OR into the flag: only ever set here
            _store(kcopy_ptr, t, stride_pt, stride_ph, k1, k2, k_mask, half, BLOCK_HK, HALF)
            _store(vcopy_ptr, t, stride_pt, stride_ph, v1, v2, k_mask, half, BLOCK_HK, HALF)
        _store(kc_ptr, slot, stride_cs, stride_ch, k1, k2, k_mask, half, BLOCK_HK, HALF)
        _store(vc_ptr, slot, stride_cs, stride_ch, v1, v2, k_mask, half, BLOCK_HK, HALF)


def norm_mode(q_norm_weight: torch.Tensor | None, head_dim: int) -> int:
    """0: no q/k norm, 1: over the whole projection (weight of H*D values), 2: per head (weight of D values)."""
    if q_norm_weight is None:
        return 0
    return 2 if q_norm_weight.numel() == head_dim else 1


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             key_cache: torch.Tensor | None = None, value_cache: torch.Tensor | None = None,
             slots: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
             k_norm_weight: torch.Tensor | None = None, flags: torch.Tensor | None = None,
             key_copy: torch.Tensor | None = None, value_copy: torch.Tensor | None = None) -> bool:
    """[T, H, D] q / k / v of one float dtype with unit stride along D (views of a fused projection are fine),
    D even, a token's q in registers (next_pow2(Hq) * next_pow2(D) <= MAX_VALUES); cos / sin [T, D]; norm
    weights and caches of the same dtype; caches [S, Hkv, D] with rows of unit stride along D, slots [T]; the
    checked write: flags [T] bool contiguous, key_copy / value_copy [T, Hkv, D] of that dtype, same strides,
    unit stride along D (a cache of another dtype than q's: the dispatch composes the unfused ops)."""
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape or cos.dim() != 2 or sin.shape != cos.shape:
        return False
    num_tokens, num_q, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or head_dim % 2 or cos.shape != (num_tokens, head_dim):
        return False
    tensors = [query, key, value, cos, sin]
    if any(t.dtype != query.dtype or t.stride(-1) != 1 for t in tensors) or query.dtype not in DTYPES:
        return False
    if triton.next_power_of_2(num_q) * triton.next_power_of_2(head_dim) > MAX_VALUES:
        return False
    if (q_norm_weight is None) != (k_norm_weight is None):
        return False
    if q_norm_weight is not None:
        mode = norm_mode(q_norm_weight, head_dim)
        want = (head_dim, head_dim) if mode == 2 else (num_q * head_dim, key.shape[1] * head_dim)
        if (q_norm_weight.numel(), k_norm_weight.numel()) != want or \
                any(w.dtype != query.dtype or not w.is_contiguous() for w in (q_norm_weight, k_norm_weight)):
            return False
    if key_cache is None:
        return value_cache is None and flags is None
    if value_cache is None or slots is None or slots.shape != (num_tokens,):
        return False
    if slots.dtype not in (torch.int64, torch.int32):
        return False
    if flags is not None:
        if key_copy is None or value_copy is None or flags.shape != (num_tokens,) or flags.dtype != torch.bool \
                or not flags.is_contiguous():
            return False
        if key_copy.shape != key.shape or value_copy.shape != key.shape or key_copy.stride() != value_copy.stride() \
                or key_copy.stride(-1) != 1 or key_copy.dtype != query.dtype or value_copy.dtype != query.dtype:
            return False
    return (key_cache.dim() == 3 and key_cache.shape[1:] == key.shape[1:] and value_cache.shape == key_cache.shape
            and key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
            and key_cache.dtype == query.dtype and value_cache.dtype == query.dtype)


def qk_norm_rotary_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, key_cache: torch.Tensor | None = None,
                         value_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                         q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                         eps: float = 1e-6, clip: float | None = None, flags: torch.Tensor | None = None,
                         key_copy: torch.Tensor | None = None, value_copy: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ops.reference.layers.qk_norm_rotary_write (shapes as supports() says)."""
    check_launchable(_qk_norm_rotary_write_kernel, query)
    num_tokens, num_q, head_dim = query.shape
    num_k = key.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    write = 0 if key_cache is None else (1 if flags is None else 2)
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    dummy = q_out
    slots = slots.contiguous() if write else None
    qw = q_norm_weight if q_norm_weight is not None else dummy
    kw = k_norm_weight if k_norm_weight is not None else dummy
    checked = write == 2
    block_hq = triton.next_power_of_2(num_q)
    _qk_norm_rotary_write_kernel[(num_tokens,)](
        query, key, value, cos, sin, qw, kw, q_out, k_out,
        key_cache if write else dummy, value_cache if write else dummy, slots if write else dummy,
        flags.view(torch.uint8) if checked else dummy, key_copy if checked else dummy,
        value_copy if checked else dummy,
        num_q, num_k, half, eps, 0.0 if clip is None else float(clip),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos.stride(0), sin.stride(0), key_cache.stride(0) if write else 0, key_cache.stride(1) if write else 0,
        key_copy.stride(0) if checked else 0, key_copy.stride(1) if checked else 0,
        NORM=norm_mode(q_norm_weight, head_dim), CLIP=clip is not None, WRITE=write, BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_k), HALF=half_pad, EMULATE_BF16=not query.is_cuda,
        num_warps=4 if block_hq * half_pad <= 2048 else 8, enable_fp_fusion=False, **pdl.launch_kwargs(query))
    return q_out, k_out

"""Rotary embedding of q and k in one launch (the Triton twin of ops.reference.layers.apply_rotary_qk).

One program per token rotates every head of q and of k: out[:h] = x1*cos1 - x2*sin1 and
out[h:] = x2*cos2 + x1*sin2 (rotate_half convention, h = D/2). For 16-bit inputs each product is
rounded to the dtype before the sum, as the reference's `x * cos + rotate_half(x) * sin` does, so the
results match it bit for bit. q and k may be strided views (the split of a fused qkv projection);
the outputs are new contiguous tensors.

The launch passes enable_fp_fusion=False. With contraction on, the compiled code does not keep these
rounding points: LLVM narrows `fp32 product -> 16-bit -> fp32 -> sum -> 16-bit` to native 16-bit
mul/add and then contracts them into one `fma.rn.bf16` / `fma.rn.f16` (fp32: `fma.rn.f32`), one
rounding where the reference has two -- the one-ulp difference of the first H200 run. Without it the
PTX holds `mul.rn` + `add.rn`/`sub.rn`, each correctly rounded, which equals the reference's rounding
of every product and of the sum (rounding a sum or product of 16-bit values to fp32 and then to 16
bits rounds as once: fp32's 24 significand bits >= 2p + 2 for p = 8 and 11).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.common import check_launchable
from moekv.ops.triton.layer.norm import round_to


@triton.jit
def _rotate_heads(x_ptr, out_ptr, t, num_heads, stride_t, stride_h, c1, c2, s1, s2, half,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr, EMULATE_BF16: tl.constexpr):
    dims = tl.arange(0, HALF)
    dmask = dims < half
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & dmask[None, :]
        src = x_ptr + t * stride_t + heads[:, None] * stride_h + dims[None, :]       # [BLOCK_H, HALF]
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + half, mask=mask, other=0.0)
        dt = x1.dtype
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        a1 = round_to(x1f * c1[None, :], dt, EMULATE_BF16).to(tl.float32)
        b1 = round_to(-x2f * s1[None, :], dt, EMULATE_BF16).to(tl.float32)
        a2 = round_to(x2f * c2[None, :], dt, EMULATE_BF16).to(tl.float32)
        b2 = round_to(x1f * s2[None, :], dt, EMULATE_BF16).to(tl.float32)
        dst = out_ptr + (t * num_heads + heads[:, None]) * (2 * half) + dims[None, :]
        tl.store(dst, round_to(a1 + b1, dt, EMULATE_BF16), mask=mask)
        tl.store(dst + half, round_to(a2 + b2, dt, EMULATE_BF16), mask=mask)


@triton.jit
def load_cos_sin(cos_ptr, sin_ptr, t, stride_ct, stride_st, half, HALF: tl.constexpr):
    """Token t's cos and sin rows as fp32 halves (c1, c2, s1, s2), each [HALF] (zero past `half`)."""
    dims = tl.arange(0, HALF)
    dmask = dims < half
    c1 = tl.load(cos_ptr + t * stride_ct + dims, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + half + dims, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + dims, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + half + dims, mask=dmask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rotary_qk_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, num_q_heads, num_k_heads, half,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                      BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
                      EMULATE_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = load_cos_sin(cos_ptr, sin_ptr, t, stride_ct, stride_st, half, HALF)
    _rotate_heads(q_ptr, q_out_ptr, t, num_q_heads, stride_qt, stride_qh, c1, c2, s1, s2, half,
                  BLOCK_HQ, HALF, EMULATE_BF16)
    _rotate_heads(k_ptr, k_out_ptr, t, num_k_heads, stride_kt, stride_kh, c1, c2, s1, s2, half,
                  BLOCK_HK, HALF, EMULATE_BF16)


def supports(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if query.dim() != 3 or key.dim() != 3 or cos.dim() != 2 or sin.dim() != 2:
        return False
    num_tokens, _, head_dim = query.shape
    if head_dim % 2 or key.shape[0] != num_tokens or key.shape[2] != head_dim:
        return False
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        return False
    dtypes = {query.dtype, key.dtype, cos.dtype, sin.dtype}
    return len(dtypes) == 1 and query.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def block_heads(num_heads: int, half_pad: int) -> int:
    """Heads per step of a program's loop: a tile of at most 2048 values per half."""
    return max(1, min(triton.next_power_of_2(max(num_heads, 1)), 2048 // half_pad))


def apply_rotary_qk(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ops.reference.layers.apply_rotary_qk."""
    check_launchable(_rotary_qk_kernel, query)
    query, key, cos, sin = (_unit_last(t) for t in (query, key, cos, sin))
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    _rotary_qk_kernel[(num_tokens,)](
        query, key, cos, sin, q_out, k_out, num_q_heads, num_k_heads, half,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0), sin.stride(0),
        BLOCK_HQ=block_heads(num_q_heads, half_pad), BLOCK_HK=block_heads(num_k_heads, half_pad), HALF=half_pad,
        EMULATE_BF16=not query.is_cuda, num_warps=4, enable_fp_fusion=False)   # no FMA: see the module doc
    return q_out, k_out

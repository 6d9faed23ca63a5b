"""Register tiles of the GEMV ("fma") kernels: ops.triton.moe.decode_fma (the MoE experts at <= 4 tokens) and
ops.triton.layer.fp8_gemv (fp8_linear's "fma" variant). See decode_fma's docstring for the design: [BLOCK_T,
BLOCK_N, BLOCK_K] tiles all addressed at that full 3-D shape (one register layout, no shuffles), 16 bytes of a
weight row per thread and step, FP8 codes widened to fp32 in registers, elementwise fp32 accumulation and one
reduction across K at the end; per-output-channel scales (ROW_SCALES) multiply the reduced rows once, narrower
scale blocks the widened codes of each K tile (a K tile lies inside one scale block: the launch caps BLOCK_K).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def weight_tile(w_rows, s_rows, ks, k_mask, k0, stride_sk, scale_block_k, BLOCK_T: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, ROW_SCALES: tl.constexpr,
                MASK_K: tl.constexpr):
    """The weight rows w_rows [1, BN, 1] at columns ks [1, 1, BK] as fp32 [BT, BN, BK] (FP8: codes widened and,
    with block scales, times the scales of K block k0 // scale_block_k at s_rows [1, BN, 1])."""
    ptrs = tl.broadcast_to(w_rows + ks, [BLOCK_T, BLOCK_N, BLOCK_K])
    if MASK_K:
        w = tl.load(ptrs, mask=tl.broadcast_to(k_mask, [BLOCK_T, BLOCK_N, BLOCK_K]), other=0.0).to(tl.float32)
    else:
        w = tl.load(ptrs).to(tl.float32)
    if FP8 and not ROW_SCALES:
        scale = tl.load(tl.broadcast_to(s_rows + (k0 // scale_block_k) * stride_sk, [BLOCK_T, BLOCK_N, 1]))
        w = w * scale
    return w


@triton.jit
def activation_tile(x_rows, x_mask, ks, k_mask, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, MASK_K: tl.constexpr):
    """Activation rows x_rows [BT, 1, 1] (rows outside x_mask read as 0) at columns ks as fp32 [BT, BN, BK]."""
    ptrs = tl.broadcast_to(x_rows + ks, [BLOCK_T, BLOCK_N, BLOCK_K])
    mask = x_mask & k_mask if MASK_K else x_mask
    return tl.load(ptrs, mask=tl.broadcast_to(mask, [BLOCK_T, BLOCK_N, BLOCK_K]), other=0.0).to(tl.float32)


@triton.jit
def row_scales(s_rows, FP8: tl.constexpr, ROW_SCALES: tl.constexpr):
    """[1, BN] scales of the reduced rows (one K block: ROW_SCALES), else 1."""
    if FP8 and ROW_SCALES:
        return tl.sum(tl.load(s_rows), axis=2)
    else:
        return 1.0


@triton.jit
def fma_rows(w_rows, s_rows, x_rows, x_mask, k_begin, k_len, stride_sk, scale_block_k, BLOCK_T: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, ROW_SCALES: tl.constexpr,
             EVEN_K: tl.constexpr, UNROLL: tl.constexpr):
    """sum over k in [k_begin, k_begin + k_len) of w[n, k] * x[t, k] as fp32 [BT, BN] (scaled: FP8), for the
    weight rows w_rows [1, BN, 1] (scales s_rows [1, BN, 1]) and activation rows x_rows [BT, 1, 1] (x_mask).
    k_begin is a multiple of BLOCK_K; the full tiles run without K masks, a tail (only where not EVEN_K) is
    one masked step after them."""
    offs_k = tl.arange(0, BLOCK_K)[None, None, :]                               # [1, 1, BK]
    acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], tl.float32)
    for i in tl.range(0, k_len // BLOCK_K, loop_unroll_factor=UNROLL):        # full tiles: no K masks
        k0 = k_begin + i * BLOCK_K
        ks = k0 + offs_k
        x = activation_tile(x_rows, x_mask, ks, ks < k_begin + k_len, BLOCK_T, BLOCK_N, BLOCK_K, False)
        acc += weight_tile(w_rows, s_rows, ks, ks < k_begin + k_len, k0, stride_sk, scale_block_k, BLOCK_T,
                           BLOCK_N, BLOCK_K, FP8, ROW_SCALES, False) * x
    if not EVEN_K:                                        # the K tail (of the last split)
        if k_len % BLOCK_K != 0:
            k0 = k_begin + (k_len // BLOCK_K) * BLOCK_K
            ks = k0 + offs_k
            k_mask = ks < k_begin + k_len
            x = activation_tile(x_rows, x_mask, ks, k_mask, BLOCK_T, BLOCK_N, BLOCK_K, True)
            acc += weight_tile(w_rows, s_rows, ks, k_mask, k0, stride_sk, scale_block_k, BLOCK_T, BLOCK_N,
                               BLOCK_K, FP8, ROW_SCALES, True) * x
    return tl.sum(acc, axis=2) * row_scales(s_rows, FP8, ROW_SCALES)         # [BT, BN]

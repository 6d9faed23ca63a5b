"""The GEMV ("fma") variant of fp8_linear for 1 to FMA_MAX_ROWS (4) rows: out [M, N] = x [M, K] @
dequantize(weight)[N, K]^T (+ bias), FP8 e4m3 codes, same contract as ops.reference.fp8_linear.fp8_linear.

Why: the "dot" kernel (layer.fp8_linear) feeds tl.dot, so every K step moves its [BLOCK_K, BLOCK_N] code tile
into the MMA operand layout through shared memory and widens it there; at one row that is all overhead (H200:
~0.014 ms for Mixtral's qkv / o projections, level with bf16 cuBLAS although it reads half the bytes). This
kernel streams the codes as the MoE experts' GEMV does (moe.decode_fma, whose docstring has the design; the
tiles and the K loop are ops.triton.fma_tiles.fma_rows, shared with it):

- a program owns BLOCK_N weight rows (output features, [N, K] row-major, K contiguous) and one K split, and
  reads [BLOCK_N, BLOCK_K] tiles along K, 16 codes (one 16-byte load) per thread and row per step, widened to
  fp32 in registers; fp32 products accumulate elementwise in a [BLOCK_T, BLOCK_N, BLOCK_K] register tile
  (BLOCK_T: the rows of x padded to a power of two) reduced across K once at the end; no shared memory;
- per-output-channel scales (block (1, K), `--quantization fp8`) multiply each reduced row once at the end;
  block scales ([128, 128] checkpoints) multiply the widened codes of each K tile: BLOCK_K is capped at the
  largest power of two dividing the block width, so a K tile never crosses a scale block (as the dot kernel);
- weight rows past N are clamped into range and dropped at the store; a K tail is one masked step;
- split-K (SPLIT_K > 1: the [4096 -> 4096] o projection gives only 4096 / BLOCK_N programs for 132 SMs):
  fp32 partials [S, M, N], summed in a fixed order by layer.skinny_gemm's reduce launch (deterministic);
- bias in fp32 and one rounding to x.dtype (EMULATE_BF16 under the CPU interpreter), as the dot kernel.

Selection: fp8_linear's config "VARIANT" (layer.fp8_linear.default_config; "dot" until a GPU measures this).
Launch shapes: default_config, reasoned (decode_fma.default_part for one-byte weights), not measured.
No host reads: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.core.fp8 import Fp8Weight, k_tile_cap
from moekv.ops.triton import pdl
from moekv.ops.triton.fma_tiles import fma_rows
from moekv.ops.triton.layer.skinny_gemm import _store_tile, default_split, num_sms, reduce_splits, split_plan
from moekv.ops.triton.moe.decode_fma import FMA_MAX_TOKENS, check_part, default_part

FMA_MAX_ROWS = FMA_MAX_TOKENS       # BLOCK_T * 16 fp32 accumulators per thread and weight row: beyond, "dot"


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr,                  # [M, K], K contiguous
    w_ptr,                  # [N, K] e4m3 codes, K contiguous
    s_ptr,                  # [N / SCALE_BN, K / scale_block_k] fp32 scales
    b_ptr,                  # [N] or a dummy (HAS_BIAS False)
    out_ptr,                # [M, N] x.dtype, or [S, M, N] fp32 partials (SPLIT)
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_sk, scale_block_k, stride_om, stride_ps,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr, ROW_SCALES: tl.constexpr,
    UNROLL: tl.constexpr, EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    split = tl.program_id(1)
    tokens = tl.arange(0, BLOCK_T)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                  # [BN] output features
    rows = tl.minimum(cols, N - 1).to(tl.int64)[None, :, None]                # [1, BN, 1], clamped into range
    k_begin = split * k_per_split
    y = fma_rows(w_ptr + rows * stride_wn, s_ptr + (rows // SCALE_BN) * stride_sn,
                 x_ptr + tokens.to(tl.int64)[:, None, None] * stride_xm, (tokens < M)[:, None, None],
                 k_begin, tl.minimum(k_per_split, K - k_begin), stride_sk, scale_block_k, BLOCK_T, BLOCK_N,
                 BLOCK_K, True, ROW_SCALES, EVEN_K, UNROLL)                     # [BT, BN] fp32
    _store_tile(y, tokens, cols, M, N, b_ptr, out_ptr, split, stride_om, stride_ps, HAS_BIAS, SPLIT,
                EMULATE_BF16)


# ---------------------------------------------------------------------------------------- host side
def applies(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether the fma variant can take this call: 1 to FMA_MAX_ROWS rows, codes contiguous along K."""
    return 1 <= x.shape[0] <= FMA_MAX_ROWS and weight.codes.stride(-1) == 1


def default_config(N: int, K: int, cap: int | None, device: torch.device) -> dict:
    """Reasoned, not measured: decode_fma.default_part for one-byte weights (16 codes per thread and row per
    step; Mixtral's K = 4096: BLOCK_N 1, BLOCK_K 4096, 8 warps; 128-wide scale blocks: BLOCK_N 16, BLOCK_K 128,
    4 warps), SPLIT_K only when N / BLOCK_N programs leave SMs idle (skinny_gemm.default_split)."""
    cfg = default_part(K, 1, cap)
    return dict(cfg, SPLIT_K=default_split(triton.cdiv(N, cfg["BLOCK_N"]), num_sms(device), K, cfg["BLOCK_K"]))


def fp8_gemv(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None, out: torch.Tensor,
             config: dict | None = None) -> torch.Tensor:
    """out [M, N] (x.dtype) = x [M, K] (K contiguous, M <= FMA_MAX_ROWS) @ dequantize(weight)^T (+ bias).
    config: entries overriding default_config (BLOCK_N, BLOCK_K, SPLIT_K, UNROLL, num_warps, num_stages);
    BLOCK_K is capped at the scale-block width."""
    assert applies(x, weight) and x.stride(-1) == 1, (tuple(x.shape), x.stride(), weight.codes.stride())
    M, K = x.shape
    N = weight.shape[0]
    cap = k_tile_cap(weight)
    cfg = {**default_config(N, K, cap, x.device), **(config or {})}
    if cap is not None:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], cap)
    check_part(cfg, "fp8_linear")
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    split_k, k_per_split = split_plan(K, block_k, cfg.pop("SPLIT_K", 1))
    cfg.setdefault("UNROLL", 1)
    split = split_k > 1
    target = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split else out
    codes, scale = weight.codes, weight.scale
    b_arg = bias if bias is not None else scale                # never read without HAS_BIAS
    _fp8_gemv_kernel[(triton.cdiv(N, block_n), split_k)](
        x, codes, scale, b_arg, target, M, N, K, k_per_split,
        x.stride(0), codes.stride(0), scale.stride(0), scale.stride(1), weight.block[1], target.stride(-2),
        target.stride(0) if split else 0, HAS_BIAS=bias is not None, SPLIT=split, EVEN_K=K % block_k == 0,
        BLOCK_T=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, SCALE_BN=weight.block[0],
        ROW_SCALES=weight.block[1] >= K, EMULATE_BF16=not x.is_cuda, **cfg, **pdl.launch_kwargs(x))
    if split:
        reduce_splits(target, b_arg, out, bias is not None, not x.is_cuda)
    return out

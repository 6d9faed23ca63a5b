"""W8A16 linear layer: out [M, N] = x [M, K] @ dequantize(weight)[N, K]^T (+ bias), FP8 weight codes (W8A8 with
`act_fp8`: x's rows quantized to e4m3 per row first, fp8 x fp8 dots, each row's scale on its accumulator).

Same contract as ops.reference.fp8_linear.fp8_linear. One program per (BLOCK_M rows, BLOCK_N output
features); the K loop reads [BLOCK_K, BLOCK_N] tiles of e4m3 codes (one byte per weight: half the bytes of
a bf16 projection), widens them in registers for the dot (exact) and scales each tile's fp32 product by its
columns' scales (common.weight_dot; BLOCK_K is capped so a tile never crosses a scale block). Bias in fp32,
one rounding to x.dtype (EMULATE_BF16 under the CPU interpreter, whose bf16 cast truncates). No host reads:
CUDA-graph safe. Launch shapes: default_config (decode sizes measured, larger ones reasoned).

Two variants, picked by the config's "VARIANT" (default_config's, or a caller's config entry):
  "dot"  this kernel, any M (the default);
  "fma"  1 to 4 rows: layer.fp8_gemv, a GEMV streaming the codes without tl.dot or shared memory (as the MoE
         experts' moe.decode_fma). Not measured on a GPU yet; benchmarks/bench_fp8_linear.py times both. Where
         it does not apply (more rows, codes not contiguous along K) "dot" runs with its own default tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.core.fp8 import Fp8Weight, k_tile_cap, quantize_rows
from moekv.ops.triton import pdl
from moekv.ops.triton.common import check_launchable, weight_dot
from moekv.ops.triton.layer import fp8_gemv
from moekv.ops.triton.layer.norm import round_to
from moekv.ops.triton.moe.decode import fp8_runs_on

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(
    x_ptr,                  # [M, K]
    w_ptr,                  # [N, K] e4m3 codes
    s_ptr,                  # [N / SCALE_BN, K / scale_block_k] fp32 scales
    b_ptr,                  # [N] or a dummy (HAS_BIAS False)
    out_ptr,                # [M, N] x.dtype
    xs_ptr,                 # A8: [M] fp32 per-row scales of x's e4m3 codes (else unused)
    M, N, K,
    stride_xm, stride_wn, stride_wk, stride_sn, stride_sk, scale_block_k, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BN: tl.constexpr, UPCAST: tl.constexpr, EMULATE_BF16: tl.constexpr, A8: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rows < M
    n_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm                                   # [BM, 1]
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn                                   # [1, BN]
    s_cols = s_ptr + (cols // SCALE_BN) * stride_sn                                           # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)   # [BM, BK]
        w = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)   # [BK, BN]
        acc += weight_dot(x, w, s_cols, k0, stride_sk, scale_block_k, n_mask, UPCAST, True)
    if A8:
        acc = acc * tl.load(xs_ptr + rows, mask=m_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    offs = rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptr + offs, round_to(acc, out_ptr.dtype.element_ty, EMULATE_BF16),
             mask=m_mask[:, None] & n_mask[None, :])


def supports(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """2-D activations of a float dtype and an FP8 weight whose scale blocks span K or a multiple of 16 of it, on
    a GPU that converts e4m3 in registers (compute capability >= 8.9) or the CPU interpreter."""
    return (isinstance(weight, Fp8Weight) and fp8_runs_on(x.device) and x.dim() == 2 and len(weight.shape) == 2 and x.dtype in DTYPES
            and x.shape[1] == weight.shape[1] and (weight.block[1] >= weight.shape[1] or weight.block[1] % 16 == 0))


def default_config(num_rows: int) -> dict:
    """Decode sizes (<= 16 rows): narrow column tiles and long K tiles, so a projection spreads over ~130-190
    programs (H200, session 25 sweep on Mixtral's qkv / o shapes at 1 and 8 rows, benchmarks/results/
    fp8-linear-sweep-h200.md: 0.034 -> 0.014 ms, the old 64 x 64 tiles gave 64-96 programs); else 64 x 64.
    One row: the GEMV ("fma") with one column per program and 1024-wide K tiles over 2 warps (session 27 sweep,
    benchmarks/results/fp8-linear-fma-h200.md: qkv 0.0169 -> 0.0102 ms, o 0.0136 -> 0.0073, 1.65x / 1.86x the dot
    kernel; cuBLAS bf16 0.0168 / 0.0135). 2-4 rows stay "dot" until measured (fp8_gemv.default_config fills the
    tiles an "fma" entry leaves out)."""
    if num_rows == 1:
        return dict(VARIANT="fma", BLOCK_N=1, BLOCK_K=1024, num_warps=2, num_stages=1, UNROLL=1, SPLIT_K=1)
    return dict(VARIANT="dot", **dot_config(num_rows))


def dot_config(num_rows: int) -> dict:
    """The dot kernel's launch shape (default_config's history above)."""
    if num_rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4)


def resolve_config(x: torch.Tensor, weight: Fp8Weight, config: dict | None) -> tuple[str, dict]:
    """(variant, its launch entries): config's "VARIANT", else default_config's ("dot" for block-scaled weights,
    whose GEMV tiles are not measured). "fma" (where it applies) takes
    default_config's entries if that chose "fma" (fp8_gemv.default_config fills the rest), then config's; "dot"
    takes dot_config's, then config's unless config asked for an "fma" that does not apply (its entries were fma
    tiles)."""
    num_rows = x.shape[0]
    base = default_config(num_rows)
    base_variant = base.pop("VARIANT")
    if base_variant == "fma" and k_tile_cap(weight) is not None:    # the sweep measured per-channel scales only
        base, base_variant = dot_config(num_rows), "dot"
    user = dict(config or {})
    variant = user.pop("VARIANT", base_variant)
    assert variant in ("dot", "fma"), variant
    if variant == "fma" and fp8_gemv.applies(x, weight):
        return "fma", {**(base if base_variant == "fma" else {}), **user}
    return "dot", {**dot_config(num_rows), **(user if variant == "dot" else {})}


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
               config: dict | None = None, act_fp8: bool = False) -> torch.Tensor:
    """Same contract as ops.reference.fp8_linear.fp8_linear (act_fp8: W8A8, the "dot" kernel with e4m3 rows and
    fp8 x fp8 dots); config overrides default_config's entries ("VARIANT": "dot" / "fma", and the chosen variant's
    launch entries: resolve_config)."""
    num_rows, _ = x.shape
    out_features, in_features = weight.shape
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)                 # [M, N]
    if num_rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    check_launchable(_fp8_linear_kernel, x)
    variant, cfg = resolve_config(x, weight, dict(config or {}, VARIANT="dot") if act_fp8 else config)
    if variant == "fma":
        return fp8_gemv.fp8_gemv(x, weight, bias, out, cfg)
    rows, row_scale = quantize_rows(x) if act_fp8 else (x, x)
    cap = k_tile_cap(weight)                     # a K tile must not cross a scale block
    if cap is not None:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], cap)
    codes, scale = weight.codes, weight.scale
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]), triton.cdiv(out_features, cfg["BLOCK_N"]))
    _fp8_linear_kernel[grid](
        rows, codes, scale, bias if bias is not None else scale, out, row_scale, num_rows, out_features, in_features,
        rows.stride(0), codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1), weight.block[1],
        out.stride(0), HAS_BIAS=bias is not None, SCALE_BN=weight.block[0],
        UPCAST=rows.dtype == torch.float32 or (rows.dtype == torch.bfloat16 and not x.is_cuda),
        EMULATE_BF16=not x.is_cuda, A8=act_fp8, **cfg, **pdl.launch_kwargs(x))
    return out

"""Weight-streaming skinny GEMM for decode: out [M, N] = x [M, K] @ weight[N, K]^T (+ bias), M <= 64.

Same contract as ops.reference.skinny_gemm.skinny_gemm. At decode batch sizes a dense projection is
bound by reading its weight once (Mixtral-8x7B qkv: 50 MB, M FLOPs per weight byte), so the kernel is
built around streaming `weight` at the copy bandwidth:

- one program per (BLOCK_N output features, K-split): its rows of `weight` are read once, as
  [BLOCK_N, BLOCK_K] tiles contiguous along K (nn.Linear's row-major layout: 16-byte vector loads
  when K, the row stride and the pointers allow, which Triton's specialisation sees at launch), and
  multiplied against *all* M rows of x at once ([BLOCK_M = 16, BLOCK_K] tiles, read from L2);
- no K masks in the main loop (a K tail, K % BLOCK_K != 0, is one masked step after it); weight rows
  past N are clamped into range (the duplicate columns are dropped at the store), x rows past M
  masked (no bytes moved: x comes from L2 for every program, and padding rows would double that
  traffic at M = 1);
- fp32 accumulation; bias added in fp32 before the single rounding to x.dtype (as cuBLAS does);
- enough programs for the GPU: BLOCK_N 16 or 32 by N; split-K only when N / BLOCK_N leaves SMs idle
  (e.g. a router's [4096 -> 8]), its fp32 partials [S, M, N] summed in a fixed order by a second
  launch (deterministic, no atomics).

Two variants:
  "dot"  tl.dot on [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles (tensor cores; the padded rows cost no
         bandwidth -- as ops.triton.moe.decode, which streams its experts at 4.2 TB/s on an H200);
         BLOCK_M 16 for every M <= 16 (one binary), 32 / 64 above (decode batches of 17 .. 64 rows, where
         cuBLAS's tiles leave the GPU part idle: Mixtral's qkv at B=64 read at 2.7 TB/s in
         graph-step-kernels-h200-b64.md). The default from M = 2.
  "fma"  M == 1 only: a GEMV on CUDA cores, fp32 products accumulated elementwise in a
         [BLOCK_N, BLOCK_K] register tile and reduced once at the end (no shared memory). The default at
         M == 1 (H200: 0.32-0.96x of cuBLAS's time on the Mixtral projections; "dot" 0.78-1.01x).
Launch shapes: default_config ("fma" from the H200 sweep of benchmarks/bench_gemv.py, "dot" reasoned).
No host reads: the launch depends on shapes only, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moekv.ops.triton import pdl
from moekv.ops.triton.common import check_launchable, mma
from moekv.ops.triton.layer.norm import round_to

MAX_ROWS = 64                   # M <= this (the dot variant's largest BLOCK_M)
ONE_BINARY_ROWS = 16            # every M <= this: BLOCK_M 16, one binary
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_SMS = 132               # an H200 (also what the CPU interpreter plans for)


@triton.jit
def _store_tile(acc, rows, cols, M, N, b_ptr, out_ptr, split, stride_om, stride_ps,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """acc [BM, BN] fp32 -> out rows / cols (in range only): fp32 partials of `split` when SPLIT, else
    + bias (fp32) and one rounding to out's dtype (to nearest even; EMULATE_BF16: on the bits, for the
    CPU interpreter, whose fp32 -> bf16 cast truncates)."""
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    if SPLIT:
        tl.store(out_ptr + split.to(tl.int64) * stride_ps + offs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, round_to(acc, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


@triton.jit(do_not_specialize=["M"])               # one binary per BLOCK_M (16: every M <= 16)
def _skinny_dot_kernel(
    x_ptr,                  # [M, K], K contiguous
    w_ptr,                  # [N, K], K contiguous
    b_ptr,                  # [N] or a dummy (HAS_BIAS False)
    out_ptr,                # [M, N] x.dtype, or [S, M, N] fp32 partials (SPLIT)
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_ps,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # x rows past M: masked (a masked lane moves no bytes); weight rows past N: clamped (no mask at all)
    m_mask = (rows < M)[:, None]                                                    # [BM, 1]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm                         # [BM, 1]
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn      # [BN, 1]
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = split * k_per_split
    k_len = tl.minimum(k_per_split, K - k_begin)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, k_len // BLOCK_K):                       # full tiles: no K masks
        ks = k_begin + i * BLOCK_K + offs_k
        x = tl.load(x_rows + ks[None, :], mask=m_mask, other=0.0)                   # [BM, BK]
        w = tl.load(w_rows + ks[None, :])                                           # [BN, BK]
        acc += mma(x, tl.trans(w), UPCAST)                                          # [BM, BN]
    if not EVEN_K:                                             # the K tail (last split only)
        ks = k_begin + (k_len // BLOCK_K) * BLOCK_K + offs_k
        k_mask = (ks < k_begin + k_len)[None, :]
        x = tl.load(x_rows + ks[None, :], mask=m_mask & k_mask, other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=k_mask, other=0.0)
        acc += mma(x, tl.trans(w), UPCAST)
    _store_tile(acc, rows, cols, M, N, b_ptr, out_ptr, split, stride_om, stride_ps, HAS_BIAS, SPLIT,
                EMULATE_BF16)


@triton.jit
def _skinny_fma_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,                              # as _skinny_dot_kernel, M == 1
    N, K, k_per_split,
    stride_wn, stride_ps,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE_BF16: tl.constexpr, UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn      # [BN, 1], clamped
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = split * k_per_split
    k_len = tl.minimum(k_per_split, K - k_begin)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)             # elementwise partial sums
    # unrolled so that the next tiles' loads are issued before this tile's FMAs (no cp.async pipeline)
    for i in tl.range(0, k_len // BLOCK_K, loop_unroll_factor=UNROLL):
        ks = k_begin + i * BLOCK_K + offs_k
        x = tl.load(x_ptr + ks).to(tl.float32)                                      # [BK]
        w = tl.load(w_rows + ks[None, :]).to(tl.float32)                            # [BN, BK]
        acc += w * x[None, :]
    if not EVEN_K:
        ks = k_begin + (k_len // BLOCK_K) * BLOCK_K + offs_k
        k_mask = ks < k_begin + k_len
        x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)[None, :]                                                # [1, BN]
    _store_tile(y, tl.arange(0, 1), cols, 1, N, b_ptr, out_ptr, split, N, stride_ps, HAS_BIAS, SPLIT,
                EMULATE_BF16)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,               # [S, M, N] fp32
    b_ptr, out_ptr,         # [N], [M, N]
    N, num_splits, stride_ps, stride_pm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    part = part_ptr + row.to(tl.int64) * stride_pm + cols
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in range(0, num_splits):                             # fixed order: deterministic
        acc += tl.load(part + s * stride_ps, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, round_to(acc, out_ptr.dtype.element_ty, EMULATE_BF16),
             mask=n_mask)


# ---------------------------------------------------------------------------------------- host side
@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of `device` (a host-side property, no sync); DEFAULT_SMS off CUDA."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))


def default_config(M: int, N: int, K: int, device: torch.device, variant: str = "dot") -> dict:
    """Launch parameters. "dot" is reasoned from the sm_90 compile (bench_gemv.py --static); "fma" is the
    H200 sweep's best over the six Mixtral-8x7B projections at M = 1 (benchmarks/results/gemv-h200.md:
    0.32-0.96x of cuBLAS's time on every shape; the earlier BLOCK_N 4 / BLOCK_K 1024 / 4 warps / UNROLL 2
    lost on the down projection). SPLIT_K only when there are fewer programs than SMs: up to ~2 programs per SM, each
    split at least 2 BLOCK_K steps.

    "dot": BLOCK_N 32 when that still gives 2 programs per SM, else 16; BLOCK_K 256 and 4 stages keep
           3 x 8 KB of weight tiles in flight per program (cp.async), 40-48 registers. Above 16 rows
           (BLOCK_M 32 / 64): BLOCK_N = 2 x BLOCK_M, so that the x tiles every program reads from L2 ((N / BLOCK_N)
           x M x K in all) stay at half the weight's bytes, BLOCK_K 128, 3 stages (48 KB of tiles a stage at
           BLOCK_M 64), 8 warps at BLOCK_M 64; split-K fills the SMs as below. Reasoned, not yet swept on a GPU.
    "fma": each thread owns 8 consecutive K of every row (one 16-byte load), so BLOCK_K = 256 x warps
           makes x's layout that of the weight tile's columns (no shared-memory shuffle in the loop);
           BLOCK_N 2 rows of BLOCK_K 2048 over 8 warps (fewer for short K) per step.
    """
    sms = num_sms(device)
    if variant == "dot" and M > ONE_BINARY_ROWS:
        block_m = block_rows(M)
        cfg = {"BLOCK_N": 2 * block_m, "BLOCK_K": min(128, _pow2(K)), "num_warps": 8 if block_m == 64 else 4,
               "num_stages": 3}
    elif variant == "dot":
        cfg = {"BLOCK_N": 32 if triton.cdiv(N, 32) >= 2 * sms else 16, "BLOCK_K": min(256, _pow2(K)),
               "num_warps": 4, "num_stages": 4}
    else:
        block_k = min(2048, _pow2(K, floor=256))
        cfg = {"BLOCK_N": 2, "BLOCK_K": block_k, "UNROLL": 1, "num_warps": block_k // 256, "num_stages": 1}
    return dict(cfg, SPLIT_K=default_split(triton.cdiv(N, cfg["BLOCK_N"]), sms, K, cfg["BLOCK_K"]))


def block_rows(M: int) -> int:
    """The dot variant's BLOCK_M for M rows: 16 up to ONE_BINARY_ROWS, else the next power of two (<= MAX_ROWS)."""
    return ONE_BINARY_ROWS if M <= ONE_BINARY_ROWS else triton.next_power_of_2(M)


def default_split(programs: int, sms: int, K: int, block_k: int) -> int:
    """SPLIT_K for a launch of `programs` column tiles: 1 when they fill the SMs, else up to ~2 programs per
    SM, each split at least 2 BLOCK_K steps."""
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), K // (2 * block_k)))


def split_plan(K: int, block_k: int, split_k) -> tuple[int, int]:
    """(splits, k_per_split) for a requested SPLIT_K: each split a whole number of BLOCK_K steps, none empty."""
    split_k = max(1, min(int(split_k or 1), triton.cdiv(K, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def reduce_splits(partials: torch.Tensor, bias_arg: torch.Tensor, out: torch.Tensor, has_bias: bool,
                  emulate_bf16: bool) -> torch.Tensor:
    """out [M, N] = sum over splits of partials [S, M, N] fp32, in a fixed order (deterministic), + bias, one
    rounding to out's dtype (the second launch of a split-K GEMM)."""
    M, N = out.shape
    reduce_n = min(1024, triton.next_power_of_2(N))
    _splitk_reduce_kernel[(M, triton.cdiv(N, reduce_n))](
        partials, bias_arg, out, N, partials.shape[0], partials.stride(0), partials.stride(1), out.stride(0),
        HAS_BIAS=has_bias, BLOCK_N=reduce_n, EMULATE_BF16=emulate_bf16, **pdl.launch_kwargs(out))
    return out


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Shapes and dtypes the kernel takes: x [M, K] with 1 <= M <= MAX_ROWS (64), weight [N, K], both K-contiguous,
    one dtype (fp16 / bf16 / fp32) for x, weight and bias [N]."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return False
    if not 1 <= x.shape[0] <= MAX_ROWS or weight.shape[0] == 0 or x.dtype not in DTYPES:
        return False
    if weight.dtype != x.dtype or weight.device != x.device or weight.stride(1) != 1:
        return False
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device):
        return False
    return True


def rounding_modes(dtype: torch.dtype, device: torch.device) -> tuple[bool, bool]:
    """(UPCAST, EMULATE_BF16). UPCAST: exact fp32 dots ("ieee") for fp32, and for bf16 on the CPU
    interpreter (whose bf16 tl.dot is wrong; bf16 products are exact in fp32, so the sums are what the
    tensor cores' fp32 accumulation gives). EMULATE_BF16: round to bf16 on the bits (the interpreter's
    fp32 -> bf16 cast truncates; a GPU's rounds to nearest even)."""
    interpreted_bf16 = dtype == torch.bfloat16 and device.type != "cuda"
    return dtype == torch.float32 or interpreted_bf16, interpreted_bf16


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: dict | None = None, variant: str | None = None) -> torch.Tensor:
    """Same contract as ops.reference.skinny_gemm.skinny_gemm, for M <= MAX_ROWS (see supports()).

    config: entries overriding default_config (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages; UNROLL
    for "fma").
    variant: None (the measured faster one: "fma" at M == 1, else "dot"), "dot" (any M) or "fma" (M == 1;
    "dot" is used for M > 1)."""
    assert supports(x, weight, bias), (tuple(x.shape), x.dtype, tuple(weight.shape), weight.dtype, weight.stride())
    if variant is None:
        variant = "fma" if x.shape[0] == 1 else "dot"
    assert variant in ("dot", "fma"), variant
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    if x.stride(1) != 1:
        x = x.contiguous()
    check_launchable(_skinny_dot_kernel, x)
    if M > 1:
        variant = "dot"
    cfg = dict(default_config(M, N, K, x.device, variant), **(config or {}))
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    split_k, k_per_split = split_plan(K, block_k, cfg.pop("SPLIT_K"))
    split = split_k > 1
    has_bias = bias is not None
    b_arg = bias if has_bias else out                     # never read without HAS_BIAS
    target = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split else out
    stride_ps = target.stride(0) if split else 0
    grid = (triton.cdiv(N, block_n), split_k)
    upcast, emulate = rounding_modes(x.dtype, x.device)
    flags = dict(HAS_BIAS=has_bias, SPLIT=split, EVEN_K=K % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k,
                 EMULATE_BF16=emulate)
    if variant == "fma":
        _skinny_fma_kernel[grid](x, weight, b_arg, target, N, K, k_per_split, weight.stride(0), stride_ps,
                                 **flags, **cfg, **pdl.launch_kwargs(x))
    else:
        _skinny_dot_kernel[grid](x, weight, b_arg, target, M, N, K, k_per_split, x.stride(0), weight.stride(0),
                                 N, stride_ps, BLOCK_M=block_rows(M), UPCAST=upcast,
                                 **flags, **cfg, **pdl.launch_kwargs(x))
    if split:
        reduce_splits(target, b_arg, out, has_bias, emulate)
    return out

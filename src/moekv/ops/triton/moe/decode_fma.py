"""The GEMV ("fma") variant of the MoE decode path's gate_up and down launches, for T <= FMA_MAX_TOKENS tokens.

Same launches, grid, deduplication and outputs as ops.triton.moe.decode (which picks the variant: the decode
config's "VARIANT", see ops.triton.moe.configs): gate_up writes act [T*k, I] (act = silu(gate) * up, the model
dtype), down writes the fp32 K-split partial sums [S, T*k, H] that decode.combine, or the fused combine + norm
(`moe_expert_partials`), sum as before. A program runs an expert only from the first slot routed to it
(common.owned_expert), for every token routed to it, so each needed expert's weights are read once per step.

Why a second variant: the "dot" kernels feed tl.dot [16, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles, so every K step
moves the weight tile into the MMA operand layout -- through shared memory -- and, with FP8 codes, widens it
there too (common.weight_dot). At one token that is all overhead: the H200 streams bf16 experts at ~3.85 TB/s
but FP8 ones at ~2.6 TB/s. Here, as in layer.skinny_gemm's "fma" variant, there is no tl.dot and no shared
memory in the loop:

- a program owns BLOCK_N rows (output features) of the expert's weight, [N, K] row-major with K contiguous,
  and reads them as [BLOCK_N, BLOCK_K] tiles along K: 16 consecutive bytes of a row per thread (one 16-byte
  vector load: 16 e4m3 codes, 8 bf16), the codes widened to fp32 in registers (exact);
- fp32 products are accumulated elementwise in a [BLOCK_T, BLOCK_N, BLOCK_K] register tile (BLOCK_T: tokens,
  a power of two >= T) and reduced across K once, after the loop;
- every tile of the loop -- weights, activations, scales -- is addressed at that full 3-D shape, so Triton
  gives them all one register layout and nothing is converted between layouts per step (a [BLOCK_K] activation
  vector would get 8 bf16 per thread against the codes' 16, i.e. a shared-memory shuffle every step). The price:
  a row's activations are loaded once per weight row of the tile (L1 hits; BLOCK_N = 1 loads them once, and
  gate_up's gate and up rows share them) and, for T > 1, the weight tile once per token (L1 hits: HBM sees each
  byte once);
- no masks in the main loop: K tails (K % BLOCK_K != 0) are one masked step after it; rows past N are clamped
  into range and dropped at the store;
- gate_up reads gate row n and up row I + n in the same loop (two accumulators) and applies silu(gate) * up on
  the reduced rows; down splits K over program_id(2) (SPLIT_K) exactly as the dot kernel does.

FP8 scales (FP8 constexpr, moekv.core.fp8.Fp8Weight): one scale block spanning the reduced size (per output
channel, `--quantization fp8`: ROW_SCALES) multiplies each reduced row once at the end; narrower blocks
(checkpoints' 128 x 128) multiply the widened codes of every K tile by the scales of its rows -- a K tile
lies inside one scale block, since the launch caps BLOCK_K as the dot variant does (decode.fp8_block_k).
16-bit / fp32 weights run the same kernels (FP8 False: the widening is the only conversion, no scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton import pdl
from moekv.ops.triton.common import expert_sources, owned_expert, round_to, store_slot_rows
from moekv.ops.triton.fma_tiles import activation_tile, fma_rows, row_scales, weight_tile

FMA_MAX_TOKENS = 4          # BLOCK_T * 16 fp32 accumulators per thread and weight row: beyond, "dot"
VECTOR_BYTES = 16           # one vector load per thread and row per K step


@triton.jit(do_not_specialize=["num_tokens"])
def _fma_gate_up_kernel(
    x_ptr,                  # [T, H], H contiguous
    w_ptr,                  # [E, 2I, H] gate rows then up rows, H contiguous (FP8: e4m3 codes)
    ids_ptr,                # [T, k] int (contiguous)
    act_ptr,                # [T*k, I] out, model dtype
    s_ptr,                  # FP8: [E, 2I / SCALE_BN, H / scale_block_k] fp32 scales (else unused)
    num_tokens, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_at, stride_se, stride_sn, stride_sk, scale_block_k,
    TOP_K: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr, ROW_SCALES: tl.constexpr,
    EVEN_K: tl.constexpr, UNROLL: tl.constexpr, EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    slot = tl.program_id(0)
    expert, owner = owned_expert(ids_ptr, slot, num_tokens * TOP_K, SLOTS_PAD)
    if owner:
        tokens = tl.arange(0, BLOCK_T)
        routed = expert_sources(ids_ptr, expert, num_tokens, TOP_K, BLOCK_T) >= 0   # tokens routed to the expert
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)              # [BN] rows of W_gate
        rows = tl.minimum(cols, inter - 1).to(tl.int64)[None, :, None]        # [1, BN, 1], clamped into range
        w_gate = w_ptr + expert.to(tl.int64) * stride_we + rows * stride_wn
        w_up = w_ptr + expert.to(tl.int64) * stride_we + (rows + inter) * stride_wn
        s_gate = s_ptr + expert.to(tl.int64) * stride_se + (rows // SCALE_BN) * stride_sn
        s_up = s_ptr + expert.to(tl.int64) * stride_se + ((rows + inter) // SCALE_BN) * stride_sn
        x_rows = x_ptr + tokens.to(tl.int64)[:, None, None] * stride_xt         # [BT, 1, 1]
        x_mask = routed[:, None, None]
        offs_k = tl.arange(0, BLOCK_K)[None, None, :]                           # [1, 1, BK]
        acc_gate = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], tl.float32)
        for i in tl.range(0, hidden // BLOCK_K, loop_unroll_factor=UNROLL):   # full tiles: no K masks
            k0 = i * BLOCK_K
            ks = k0 + offs_k
            x = activation_tile(x_rows, x_mask, ks, ks < hidden, BLOCK_T, BLOCK_N, BLOCK_K, False)
            acc_gate += weight_tile(w_gate, s_gate, ks, ks < hidden, k0, stride_sk, scale_block_k, BLOCK_T,
                                    BLOCK_N, BLOCK_K, FP8, ROW_SCALES, False) * x
            acc_up += weight_tile(w_up, s_up, ks, ks < hidden, k0, stride_sk, scale_block_k, BLOCK_T, BLOCK_N,
                                  BLOCK_K, FP8, ROW_SCALES, False) * x
        if not EVEN_K:                                                          # the K tail
            k0 = (hidden // BLOCK_K) * BLOCK_K
            ks = k0 + offs_k
            k_mask = ks < hidden
            x = activation_tile(x_rows, x_mask, ks, k_mask, BLOCK_T, BLOCK_N, BLOCK_K, True)
            acc_gate += weight_tile(w_gate, s_gate, ks, k_mask, k0, stride_sk, scale_block_k, BLOCK_T, BLOCK_N,
                                    BLOCK_K, FP8, ROW_SCALES, True) * x
            acc_up += weight_tile(w_up, s_up, ks, k_mask, k0, stride_sk, scale_block_k, BLOCK_T, BLOCK_N,
                                  BLOCK_K, FP8, ROW_SCALES, True) * x
        gate = tl.sum(acc_gate, axis=2) * row_scales(s_gate, FP8, ROW_SCALES)   # [BT, BN]
        up = tl.sum(acc_up, axis=2) * row_scales(s_up, FP8, ROW_SCALES)
        act = round_to(gate * tl.sigmoid(gate) * up, act_ptr.dtype.element_ty, EMULATE_BF16)
        n_mask = cols < inter
        store_slot_rows(act_ptr, stride_at, cols, n_mask, act, ids_ptr, expert, num_tokens, TOP_K, BLOCK_T)


@triton.jit(do_not_specialize=["num_tokens"])
def _fma_down_kernel(
    act_ptr,                # [T*k, I], I contiguous
    w_ptr,                  # [E, H, I], I contiguous (FP8: e4m3 codes)
    ids_ptr,                # [T, k] int (contiguous)
    partial_ptr,            # [S, T*k, H] fp32 out
    s_ptr,                  # FP8: [E, H / SCALE_BN, I / scale_block_k] fp32 scales (else unused)
    num_tokens, hidden, inter, k_per_split,
    stride_at, stride_we, stride_wn, stride_ps, stride_pt, stride_se, stride_sn, stride_sk, scale_block_k,
    TOP_K: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr, ROW_SCALES: tl.constexpr,
    EVEN_K: tl.constexpr, UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    slot = tl.program_id(0)
    split = tl.program_id(2)
    expert, owner = owned_expert(ids_ptr, slot, num_tokens * TOP_K, SLOTS_PAD)
    if owner:
        source = expert_sources(ids_ptr, expert, num_tokens, TOP_K, BLOCK_T)   # a slot of each routed token
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)              # [BN] output features
        rows = tl.minimum(cols, hidden - 1).to(tl.int64)[None, :, None]       # [1, BN, 1], clamped into range
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + rows * stride_wn
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + (rows // SCALE_BN) * stride_sn
        a_rows = act_ptr + source.to(tl.int64)[:, None, None] * stride_at      # [BT, 1, 1]
        a_mask = (source >= 0)[:, None, None]
        k_begin = split * k_per_split
        y = fma_rows(w_rows, s_rows, a_rows, a_mask, k_begin, tl.minimum(k_per_split, inter - k_begin), stride_sk,
                     scale_block_k, BLOCK_T, BLOCK_N, BLOCK_K, FP8, ROW_SCALES, EVEN_K, UNROLL)   # [BT, BN]
        n_mask = cols < hidden
        out = partial_ptr + split.to(tl.int64) * stride_ps
        store_slot_rows(out, stride_pt, cols, n_mask, y, ids_ptr, expert, num_tokens, TOP_K, BLOCK_T)


# ---------------------------------------------------------------------------------------- host side
def applies(num_tokens: int, *weights) -> bool:
    """Whether the fma variant takes this call: T <= FMA_MAX_TOKENS and weights (tensors or Fp8Weight; None:
    not known yet) whose rows are contiguous along K."""
    if not 1 <= num_tokens <= FMA_MAX_TOKENS:
        return False
    return all(w is None or getattr(w, "codes", w).stride(-1) == 1 for w in weights)


def _pow2(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))


def default_part(reduced: int, elem_bytes: int, block_k_cap: int | None = None) -> dict:
    """Launch parameters of one fma launch reducing over `reduced` with weights of elem_bytes per element
    (untuned, reasoned from layer.skinny_gemm's H200 sweep): each thread loads 16 bytes of a row per step;
    BLOCK_K covers the reduced size, up to 32 lanes x 8 warps of such loads (4096 e4m3 codes, 2048 bf16), at
    most the FP8 scale-block cap (block_k_cap), shrunk to the largest power of two dividing the reduced size
    when that leaves no K tail and still >= 256; rows per program so that a program fills >= 4 warps."""
    per_warp = 32 * max(1, VECTOR_BYTES // elem_bytes)           # K elements one warp loads per row and step
    block_k = min(8 * per_warp, _pow2(reduced, 16))
    if block_k_cap is not None:
        block_k = min(block_k, block_k_cap)
    even = reduced & -reduced                                      # largest power of two dividing reduced
    if reduced % block_k and even >= 256:
        block_k = min(block_k, even)
    block_n = max(1, 4 * per_warp // block_k)
    warps = max(1, min(8, block_n * block_k // per_warp))
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": 1, "UNROLL": 1}


def config_parts(tuned: dict, hidden: torch.Tensor, inter: int, w_gate_up, w_down, caps: dict) -> dict:
    """{"gate_up": ..., "down": ...}: the tuned "fma" parts where given, else default_part for these weights
    (None: the activation dtype's) and BLOCK_K caps {part: cap or None} (decode.fp8_block_k's)."""
    def elem_bytes(w) -> int:
        return hidden.element_size() if w is None else getattr(w, "codes", w).element_size()

    sizes = {"gate_up": (hidden.shape[1], w_gate_up), "down": (inter, w_down)}
    return {part: dict(tuned.get(part) or default_part(reduced, elem_bytes(w), caps[part]))
            for part, (reduced, w) in sizes.items()}


def check_part(cfg: dict, name: str) -> None:
    """ValueError for launch parameters the kernels cannot take (powers of two: Triton's tile shapes)."""
    for key in ("BLOCK_N", "BLOCK_K"):
        value = cfg.get(key)
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"moe decode fma {name}: {key} must be a power of two, got {value!r}")


def _launch_flags(cfg: dict, reduced: int, scale_block_k: int, fp8: bool) -> dict:
    cfg = {key: value for key, value in cfg.items() if key != "SPLIT_K"}
    cfg.setdefault("UNROLL", 1)
    return dict(cfg, ROW_SCALES=fp8 and scale_block_k >= reduced, EVEN_K=reduced % cfg["BLOCK_K"] == 0)


def _token_flags(num_tokens: int, top_k: int) -> dict:
    assert 1 <= num_tokens <= FMA_MAX_TOKENS, f"the fma variant takes 1 to {FMA_MAX_TOKENS} tokens"
    block_t = triton.next_power_of_2(num_tokens)
    return dict(TOP_K=top_k, SLOTS_PAD=triton.next_power_of_2(block_t * top_k), BLOCK_T=block_t)


def _check_rows(weight: torch.Tensor, name: str) -> None:
    if weight.stride(-1) != 1:
        raise ValueError(f"moe decode fma {name}: weight rows must be contiguous along K, strides {weight.stride()}")


def gate_up(hidden: torch.Tensor, weight: torch.Tensor, scale_args: list, quant: dict, topk_ids: torch.Tensor,
            act: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The gate_up launch into act [T*k, I]: hidden [T, H] (H contiguous), weight [E, 2I, H] (codes or 16-bit;
    scale_args / quant as decode.weight_args gives them), topk_ids [T, k] contiguous, cfg one part's config."""
    check_part(cfg, "gate_up")
    _check_rows(weight, "gate_up")
    num_tokens, hidden_size = hidden.shape
    inter = weight.shape[1] // 2
    grid = (topk_ids.numel(), triton.cdiv(inter, cfg["BLOCK_N"]))
    _fma_gate_up_kernel[grid](
        hidden, weight, topk_ids, act, scale_args[0], num_tokens, hidden_size, inter,
        hidden.stride(0), weight.stride(0), weight.stride(1), act.stride(0), *scale_args[1:],
        **_token_flags(num_tokens, topk_ids.shape[1]), **_launch_flags(cfg, hidden_size, scale_args[4], quant["FP8"]),
        **quant, EMULATE_BF16=not hidden.is_cuda, **pdl.launch_kwargs(hidden))
    return act


def down(act: torch.Tensor, weight: torch.Tensor, scale_args: list, quant: dict, topk_ids: torch.Tensor,
         partial: torch.Tensor, k_per_split: int, cfg: dict) -> torch.Tensor:
    """The down launch into partial [S, T*k, H] fp32 (S = partial.shape[0] splits of k_per_split, a multiple
    of BLOCK_K): act [T*k, I] (I contiguous), weight [E, H, I], the rest as gate_up's."""
    check_part(cfg, "down")
    _check_rows(weight, "down")
    assert k_per_split % cfg["BLOCK_K"] == 0, (k_per_split, cfg["BLOCK_K"])
    num_tokens, top_k = topk_ids.shape
    hidden_size, inter = weight.shape[1], weight.shape[2]
    grid = (topk_ids.numel(), triton.cdiv(hidden_size, cfg["BLOCK_N"]), partial.shape[0])
    _fma_down_kernel[grid](
        act, weight, topk_ids, partial, scale_args[0], num_tokens, hidden_size, inter, k_per_split,
        act.stride(0), weight.stride(0), weight.stride(1), partial.stride(0), partial.stride(1), *scale_args[1:],
        **_token_flags(num_tokens, top_k), **_launch_flags(cfg, inter, scale_args[4], quant["FP8"]), **quant,
        **pdl.launch_kwargs(act))
    return partial

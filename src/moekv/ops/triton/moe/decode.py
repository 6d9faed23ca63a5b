"""The decode path of the routed experts (a few tokens per step): no sort, no align, no host sync.

Same contract as ops.reference.moe.moe_experts_reference. Three launches:

1. gate_up: one program per (token-slot, I-block). A program reads its slot's expert id from
   topk_ids on the device; if an earlier slot routes to the same expert it exits, otherwise it runs
   that expert for *every* token routed to it (the rows of a [BLOCK_T, BLOCK_K] tile, BLOCK_T >= T,
   masked to those tokens) -- so each needed expert's weights are read once per step however many
   tokens share it. Gate and up rows of w_gate_up are read in the same loop and
   act = silu(gate) * up is written per slot ([T*k, I], the model dtype).
2. down: one program per (token-slot, H-block, K-split), the same deduplication; partial sums of
   act @ W_down^T per slot and split go to an fp32 buffer [S, T*k, H].
3. combine: one program per (token, H-block): out[t] = sum_j w[t, j] * sum_s partial[s, t*k + j],
   in a fixed order -- deterministic, no atomics -- launched without multiply-add contraction (a rounded
   product, then a rounded add: the order and rounding points of ops.reference.moe_combine, bit for bit).
   With KernelConfig.fused_moe_combine the model skips this launch at decode: `moe_expert_partials` hands
   the partial sums on and the next residual add + RMSNorm sums them (ops.triton.layer.combine_norm).

Memory-bound: the weights dominate the bytes (Mixtral-8x7B at one token: 2 experts x 3 x 4096 x
14336 x 2 B = 704 MB), so the extra tile rows of tl.dot (BLOCK_T = 16 for one token) cost nothing.
The K-split of the down projection keeps enough programs in flight when few experts are active
(H / BLOCK_N blocks alone would leave most of an H200's 132 SMs idle).

FP8 weights (moekv.core.fp8.Fp8Weight, W8A16; FP8 constexpr): the e4m3 codes are read (half the bytes),
widened to the activation dtype in registers (exact) for the dot, and each BLOCK_K step's fp32 product is
multiplied by the scales of its columns, so a K tile must lie inside one scale block (the launch caps
BLOCK_K at the block width: fp8_block_k).

Two variants of launches 1 and 2 (the config's "VARIANT", decode_config): "dot", the kernels here, and "fma"
(T <= 4), GEMVs on CUDA cores without tl.dot or shared memory (ops.triton.moe.decode_fma: its docstring says
why; same grid, deduplication and outputs, so the combine and `moe_expert_partials` take either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.core.fp8 import Fp8Weight, k_tile_cap
from moekv.ops.triton import pdl
from moekv.ops.triton.common import (check_launchable, expert_sources, owned_expert, round_to, store_slot_rows,
                                     weight_dot)
from moekv.ops.triton.moe import decode_fma
from moekv.ops.triton.moe.configs import get_config

MAX_DECODE_TOKENS = 64     # BLOCK_T = next power of two >= T; beyond this the grouped path is better
VARIANTS = ("dot", "fma")  # the kernels of the gate_up and down launches (decode_config)


@triton.jit
def gate_up_tile(x_rows, row_mask, w_gate, w_up, hidden, n_mask, stride_wk, s_gate, s_up, stride_sk, scale_block_k,
                 row_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                 FP8: tl.constexpr, A8: tl.constexpr):
    """silu(x W_gate^T) * (x W_up^T) over the full hidden size, fp32 [BLOCK_M, BLOCK_N].

    x_rows [BLOCK_M, 1] row pointers (rows outside row_mask read as 0); w_gate / w_up [1, BLOCK_N]
    column pointers of the expert's gate and up rows; n_mask [BLOCK_N] valid columns. FP8: s_gate / s_up
    [BLOCK_N] pointers to the scale rows of those columns (K block 0), see weight_dot. A8 (W8A8): x holds e4m3
    codes (the dots are fp8 x fp8) and row_scale [BLOCK_M] their per-row scales, applied before the silu.
    """
    offs_k = tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < hidden
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)   # [BM, BK]
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(w_gate + ks[:, None] * stride_wk, mask=w_mask, other=0.0)              # [BK, BN]
        wu = tl.load(w_up + ks[:, None] * stride_wk, mask=w_mask, other=0.0)                # [BK, BN]
        acc_gate += weight_dot(x, wg, s_gate, k0, stride_sk, scale_block_k, n_mask, UPCAST, FP8)
        acc_up += weight_dot(x, wu, s_up, k0, stride_sk, scale_block_k, n_mask, UPCAST, FP8)
    if A8:
        acc_gate = acc_gate * row_scale[:, None]
        acc_up = acc_up * row_scale[:, None]
    return acc_gate * tl.sigmoid(acc_gate) * acc_up


@triton.jit(do_not_specialize=["num_tokens"])      # one binary for every T sharing BLOCK_T
def _decode_gate_up_kernel(
    x_ptr,                  # [T, H]
    w_ptr,                  # [E, 2I, H] gate rows then up rows (FP8: e4m3 codes)
    ids_ptr,                # [T, k] int (contiguous)
    act_ptr,                # [T*k, I] out, model dtype
    s_ptr,                  # FP8: [E, 2I / SCALE_BN, H / scale_block_k] fp32 scales (else unused)
    num_tokens, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_wk, stride_at,
    stride_se, stride_sn, stride_sk, scale_block_k,
    TOP_K: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    slot = tl.program_id(0)
    expert, owner = owned_expert(ids_ptr, slot, num_tokens * TOP_K, SLOTS_PAD)
    if owner:
        tokens = tl.arange(0, BLOCK_T)
        routed = expert_sources(ids_ptr, expert, num_tokens, TOP_K, BLOCK_T) >= 0   # tokens routed to the expert
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)              # [BLOCK_N] rows of W_gate
        n_mask = cols < inter
        w_gate = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn    # [1, BLOCK_N]
        w_up = w_gate + inter * stride_wn
        x_rows = x_ptr + tokens[:, None].to(tl.int64) * stride_xt                        # [BLOCK_T, 1]
        s_gate = s_ptr + expert.to(tl.int64) * stride_se + (cols // SCALE_BN) * stride_sn       # [BLOCK_N]
        s_up = s_ptr + expert.to(tl.int64) * stride_se + ((cols + inter) // SCALE_BN) * stride_sn
        act = gate_up_tile(x_rows, routed, w_gate, w_up, hidden, n_mask, stride_wk, s_gate, s_up, stride_sk,
                           scale_block_k, 1.0, BLOCK_T, BLOCK_N, BLOCK_K, UPCAST, FP8, False)
        act = act.to(act_ptr.dtype.element_ty)
        store_slot_rows(act_ptr, stride_at, cols, n_mask, act, ids_ptr, expert, num_tokens, TOP_K, BLOCK_T)


@triton.jit(do_not_specialize=["num_tokens"])
def _decode_down_kernel(
    act_ptr,                # [T*k, I]
    w_ptr,                  # [E, H, I] (FP8: e4m3 codes)
    ids_ptr,                # [T, k] int (contiguous)
    partial_ptr,            # [S, T*k, H] fp32 out
    s_ptr,                  # FP8: [E, H / SCALE_BN, I / scale_block_k] fp32 scales (else unused)
    num_tokens, hidden, inter, k_per_split,
    stride_at, stride_we, stride_wn, stride_wk, stride_ps, stride_pt,
    stride_se, stride_sn, stride_sk, scale_block_k,
    TOP_K: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    slot = tl.program_id(0)
    split = tl.program_id(2)
    expert, owner = owned_expert(ids_ptr, slot, num_tokens * TOP_K, SLOTS_PAD)
    if owner:
        source = expert_sources(ids_ptr, expert, num_tokens, TOP_K, BLOCK_T)   # a slot of each routed token
        routed = source >= 0
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)              # [BLOCK_N] output features
        n_mask = cols < hidden
        offs_k = tl.arange(0, BLOCK_K)
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, inter)
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn      # [1, BLOCK_N]
        a_rows = act_ptr + source[:, None].to(tl.int64) * stride_at                       # [BLOCK_T, 1]
        s_cols = s_ptr + expert.to(tl.int64) * stride_se + (cols // SCALE_BN) * stride_sn          # [BLOCK_N]
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < k_end
            a = tl.load(a_rows + ks[None, :], mask=routed[:, None] & k_mask[None, :], other=0.0)   # [BT, BK]
            w = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc += weight_dot(a, w, s_cols, k0, stride_sk, scale_block_k, n_mask, UPCAST, FP8)   # [BT, BN]
        out = partial_ptr + split.to(tl.int64) * stride_ps
        store_slot_rows(out, stride_pt, cols, n_mask, acc, ids_ptr, expert, num_tokens, TOP_K, BLOCK_T)


@triton.jit
def _combine_kernel(
    partial_ptr,            # [S, T*k, H] (fp32, or the model dtype from the grouped path)
    weights_ptr,            # [T, k] routing weights (contiguous)
    out_ptr,                # [T, H]
    hidden, num_splits, stride_ps, stride_pt, stride_ot,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < hidden
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        row = partial_ptr + (token * TOP_K + j).to(tl.int64) * stride_pt + cols
        expert_out = tl.zeros([BLOCK_N], tl.float32)
        for split in range(0, num_splits):
            expert_out += tl.load(row + split * stride_ps, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.load(weights_ptr + token * TOP_K + j).to(tl.float32) * expert_out
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + cols, round_to(acc, out_ptr.dtype.element_ty, EMULATE_BF16),
             mask=n_mask)


def upcast_dots(dtype: torch.dtype, device: torch.device) -> bool:
    """Widen dot operands to fp32 (exact, "ieee"): fp32 inputs, and bf16 under the CPU interpreter
    (whose bf16 tl.dot is wrong; products of bf16 values are exact in fp32, so the result matches a
    tensor-core bf16 dot with fp32 accumulation)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and device.type != "cuda")


def combine(partial: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, block_n: int = 256) -> torch.Tensor:
    """out [T, H] = sum_j topk_weights[t, j] * sum_s partial[s, t*k + j] (fp32 sums, fixed order, no multiply-add
    contraction; rounded to out's dtype to nearest even, under the interpreter too: ops.reference.moe_combine)."""
    num_tokens, top_k = topk_weights.shape
    hidden = out.shape[1]
    if num_tokens == 0 or hidden == 0:
        return out
    check_launchable(_combine_kernel, out)
    weights = topk_weights.contiguous()
    if partial.stride(-1) != 1:
        partial = partial.contiguous()
    block_n = min(block_n, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        partial, weights, out, hidden, partial.shape[0], partial.stride(0), partial.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_N=block_n, EMULATE_BF16=not out.is_cuda, enable_fp_fusion=False,
        **pdl.launch_kwargs(out))
    return out


def combine_partials(partial: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Same contract as ops.reference.moe_combine.moe_combine: partial [S, T*k, H] -> [T, H] in dtype."""
    out = torch.empty((topk_weights.shape[0], partial.shape[2]), dtype=dtype, device=partial.device)
    return combine(partial, topk_weights, out)


def default_split_k(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, block_n: int,
                    block_k: int) -> int:
    """K-splits for the down projection: about 1024 programs doing work when min(T*k, E) experts are
    active, each still looping over at least 4 BLOCK_K steps."""
    active = max(1, min(num_tokens * top_k, num_experts))
    programs = active * triton.cdiv(hidden, block_n)
    return max(1, min(triton.cdiv(1024, programs), inter // (4 * block_k)))


def weight_args(w: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, list, dict]:
    """(what the kernel reads as the weight, its scale arguments [s_ptr, stride_se, stride_sn, stride_sk,
    scale_block_k], its constexprs {FP8, SCALE_BN}); a 16-bit weight gets inert ones."""
    if isinstance(w, Fp8Weight):
        s = w.scale
        return w.codes, [s, s.stride(0), s.stride(1), s.stride(2), w.block[1]], dict(FP8=True, SCALE_BN=w.block[0])
    return w, [w, 0, 0, 0, 1], dict(FP8=False, SCALE_BN=1)


def weight_format(w: torch.Tensor | Fp8Weight) -> str | None:
    """The tuned-config key of the expert weights: None (16-bit) or "fp8" (ops.triton.moe.configs)."""
    return "fp8" if isinstance(w, Fp8Weight) else None


def fp8_block_k(part: dict, w: torch.Tensor | Fp8Weight, reduced: int) -> dict:
    """part's BLOCK_K, capped for FP8 weights so that a K tile never crosses a scale block (blocks narrower
    than the reduced size `reduced`); `supports` keeps blocks whose width is not a multiple of 16 away."""
    cap = k_tile_cap(w, reduced)
    return part if cap is None else dict(part, BLOCK_K=min(part["BLOCK_K"], cap))


def fp8_runs_on(device: torch.device) -> bool:
    """Triton converts e4m3 in registers on compute capability >= 8.9 (Ada, Hopper), and in the CPU interpreter."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def supports(w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight) -> bool:
    """Whether the kernels take these weights: 16-bit/fp32 tensors, or FP8 weights (on a GPU that converts
    e4m3) whose scale blocks span the whole reduced dimension or a multiple of 16 of it (a tl.dot tile is at
    least 16 deep)."""
    for w in (w_gate_up, w_down):
        if isinstance(w, Fp8Weight) and (not fp8_runs_on(w.codes.device)
                                         or (w.block[1] < w.shape[-1] and w.block[1] % 16)):
            return False
    return isinstance(w_gate_up, Fp8Weight) == isinstance(w_down, Fp8Weight)


def decode_config(hidden: torch.Tensor, num_experts: int, inter: int, w_gate_up=None, w_down=None,
                  config: dict | None = None) -> dict:
    """A decode call's launch configuration {"VARIANT": "dot" | "fma", "gate_up": {...}, "down": {...}} for
    hidden [T, H] over num_experts experts (the tuned table's shape) with these weights (None: 16-bit, not known).

    The tuned entry (configs.get_config, keyed by the weights' format) names the variant ("VARIANT", default
    "dot") and holds the dot variant's parameters as "gate_up" / "down", the fma variant's under "fma" (default:
    decode_fma.default_part). "fma" falls back to "dot" where it does not apply (decode_fma.applies: T >
    FMA_MAX_TOKENS, weight rows not contiguous along K). config: "VARIANT" forces one; its "gate_up" / "down"
    entries override the running variant's parameters (dropped when the variant they name falls back). FP8 scale
    blocks narrower than K cap BLOCK_K (fp8_block_k); the fma variant then takes BLOCK_N up by the same factor."""
    num_tokens, hidden_size = hidden.shape
    cfg = get_config("decode", num_experts, hidden_size, inter, num_tokens, hidden.dtype, hidden.device,
                     weights=weight_format(w_gate_up))
    config = config or {}
    wanted = config.get("VARIANT") or cfg.get("VARIANT") or "dot"
    if wanted not in VARIANTS:
        raise ValueError(f"moe decode: VARIANT must be one of {VARIANTS}, got {wanted!r}")
    variant = "fma" if wanted == "fma" and decode_fma.applies(num_tokens, w_gate_up, w_down) else "dot"
    caps = {"gate_up": k_tile_cap(w_gate_up, hidden_size), "down": k_tile_cap(w_down, inter)}
    base = cfg if variant == "dot" else decode_fma.config_parts(cfg.get("fma") or {}, hidden, inter, w_gate_up,
                                                                 w_down, caps)
    overrides = config if config.get("VARIANT", variant) == variant else {}
    out = {"VARIANT": variant}
    for part, cap in caps.items():
        merged = dict(base[part], **overrides.get(part, {}))
        if cap is not None and merged["BLOCK_K"] > cap:      # fma: as many codes per program, in more rows
            rows = merged["BLOCK_N"] * (merged["BLOCK_K"] // cap if variant == "fma" else 1)
            merged.update(BLOCK_N=rows, BLOCK_K=cap)
        out[part] = merged
    return out


def _resolve_config(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, config: dict | None,
                    w_down: torch.Tensor | Fp8Weight | None = None) -> dict:
    return decode_config(hidden, w_gate_up.shape[0], w_gate_up.shape[1] // 2, w_gate_up, w_down, config)


def _common(num_tokens: int, top_k: int, hidden: torch.Tensor) -> dict:
    assert num_tokens <= MAX_DECODE_TOKENS, f"the decode path takes at most {MAX_DECODE_TOKENS} tokens"
    block_t = max(16, triton.next_power_of_2(num_tokens))       # tl.dot wants 16 rows at least
    # SLOTS_PAD from BLOCK_T (not T) so every T <= 16 shares one compiled kernel
    return dict(TOP_K=top_k, SLOTS_PAD=triton.next_power_of_2(block_t * top_k), BLOCK_T=block_t,
                UPCAST=upcast_dots(hidden.dtype, hidden.device))


def decode_activation(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, topk_ids: torch.Tensor,
                      config: dict | None = None) -> torch.Tensor:
    """The first launch alone: act [T*k, I] (twin: ops.reference.moe.moe_activation_reference)."""
    num_tokens, hidden_size = hidden.shape
    inter = w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    resolved = _resolve_config(hidden, w_gate_up, config)
    cfg = {key: value for key, value in resolved["gate_up"].items() if key != "SPLIT_K"}
    act = torch.empty((num_tokens * top_k, inter), dtype=hidden.dtype, device=hidden.device)   # [T*k, I]
    if num_tokens == 0:
        return act
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    check_launchable(_decode_gate_up_kernel, hidden)
    ids = topk_ids.contiguous()
    weight, scale_args, quant = weight_args(w_gate_up)
    if resolved["VARIANT"] == "fma":
        return decode_fma.gate_up(hidden, weight, scale_args, quant, ids, act, cfg)
    grid = (num_tokens * top_k, triton.cdiv(inter, cfg["BLOCK_N"]))
    _decode_gate_up_kernel[grid](
        hidden, weight, ids, act, scale_args[0], num_tokens, hidden_size, inter,
        hidden.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), act.stride(0), *scale_args[1:],
        **_common(num_tokens, top_k, hidden), **cfg, **quant, **pdl.launch_kwargs(hidden))
    return act


def moe_shapes(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight,
               topk_ids: torch.Tensor,
               topk_weights: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
    """(tokens T, hidden H, experts E, intermediate I, top-k) of a MoE call, with its shapes checked."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    assert tuple(w_down.shape) == (num_experts, hidden_size, inter)
    assert topk_ids.shape[0] == num_tokens and (topk_weights is None or topk_ids.shape == topk_weights.shape)
    return num_tokens, hidden_size, num_experts, inter, topk_ids.shape[1]


def moe_experts_decode(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight,
                       topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, config: dict | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same contract as ops.reference.moe.moe_experts_reference, for T <= MAX_DECODE_TOKENS.

    config: {"VARIANT": "dot" | "fma", "gate_up": {BLOCK_N, BLOCK_K, num_warps, num_stages[, UNROLL]},
    "down": {..., SPLIT_K}}, entries overriding the tuned or default ones (decode_config); SPLIT_K None:
    default_split_k.
    Expert ids of a token are expected distinct (torch.topk's are); repeated ones still give the
    reference's result. out_dtype: the output's (None: hidden's; torch.float32: the sum unrounded).
    """
    moe_shapes(hidden, w_gate_up, w_down, topk_ids, topk_weights)
    out = torch.empty(hidden.shape, dtype=out_dtype or hidden.dtype, device=hidden.device)   # [T, H]
    if hidden.shape[0] == 0:
        return out
    partial = moe_expert_partials(hidden, w_gate_up, w_down, topk_ids, config)         # [S, T*k, H]
    return combine(partial, topk_weights, out)                                       # [T, H]


def moe_expert_partials(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight,
                        topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The first two launches alone: partial [S, T*k, H] fp32, the down projection's K-split sums per slot (twin:
    ops.reference.moe_combine.moe_expert_partials, one split). config as moe_experts_decode's."""
    num_tokens, hidden_size, num_experts, inter, top_k = moe_shapes(hidden, w_gate_up, w_down, topk_ids)
    if num_tokens == 0:
        return torch.zeros((1, 0, hidden_size), dtype=torch.float32, device=hidden.device)
    resolved = _resolve_config(hidden, w_gate_up, config, w_down)
    act = decode_activation(hidden, w_gate_up, topk_ids, resolved)                    # [T*k, I]
    cfg, split_k, k_per_split = down_splits(resolved["down"], num_tokens, top_k, num_experts, hidden_size, inter)
    partial = torch.empty((split_k, num_tokens * top_k, hidden_size), dtype=torch.float32, device=hidden.device)
    return down_partials(act, w_down, topk_ids, partial, k_per_split, cfg, resolved["VARIANT"], hidden)


def down_splits(down: dict, num_tokens: int, top_k: int, num_experts: int, hidden_size: int,
                inter: int) -> tuple[dict, int, int]:
    """(the down launch's parameters without SPLIT_K, splits S, k_per_split: a multiple of BLOCK_K) for the
    config part `down` (SPLIT_K None or absent: default_split_k)."""
    cfg = {key: value for key, value in down.items() if key != "SPLIT_K"}
    split_k = down.get("SPLIT_K") or default_split_k(
        num_tokens, top_k, num_experts, hidden_size, inter, cfg["BLOCK_N"], cfg["BLOCK_K"])
    k_per_split = triton.cdiv(triton.cdiv(inter, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    return cfg, triton.cdiv(inter, k_per_split), k_per_split


def down_partials(act: torch.Tensor, w_down: torch.Tensor | Fp8Weight, topk_ids: torch.Tensor, partial: torch.Tensor,
                  k_per_split: int, cfg: dict, variant: str, hidden: torch.Tensor) -> torch.Tensor:
    """The down launch of `variant` into partial [S, T*k, H] fp32 (S = partial.shape[0] splits of k_per_split),
    cfg its parameters without SPLIT_K (down_splits); hidden: the layer input (its dtype picks UPCAST)."""
    num_tokens, top_k = topk_ids.shape
    hidden_size, inter = w_down.shape[1], w_down.shape[2]
    weight, scale_args, quant = weight_args(w_down)
    ids = topk_ids.contiguous()
    if variant == "fma":
        return decode_fma.down(act, weight, scale_args, quant, ids, partial, k_per_split, cfg)
    grid = (num_tokens * top_k, triton.cdiv(hidden_size, cfg["BLOCK_N"]), partial.shape[0])
    _decode_down_kernel[grid](
        act, weight, ids, partial, scale_args[0], num_tokens, hidden_size, inter, k_per_split,
        act.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), partial.stride(0), partial.stride(1),
        *scale_args[1:], **_common(num_tokens, top_k, hidden), **cfg, **quant, **pdl.launch_kwargs(hidden))
    return partial                                                                   # [S, T*k, H]

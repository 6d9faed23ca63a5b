"""Small pieces shared by the Triton kernels (attention, MoE, layer ops)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634      # softmax runs in base 2: the scale and log2(e) are folded into q


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """a [M, K] @ b [K, N] with an fp32 result. UPCAST: multiply in fp32 (ieee, no tf32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def weight_dot(x, w, scale_cols, k0, stride_sk, scale_block_k, n_mask, UPCAST: tl.constexpr, FP8: tl.constexpr):
    """x [BM, BK] @ w [BK, BN] in fp32. FP8: w holds e4m3 codes, widened in registers (exact), and the
    product is scaled by the scales of K block k0 // scale_block_k at the pointers scale_cols [BN]."""
    if FP8:
        if UPCAST:
            product = mma(x, w.to(tl.float32), UPCAST)
        else:
            product = mma(x, w.to(x.dtype), UPCAST)
        scale = tl.load(scale_cols + (k0 // scale_block_k) * stride_sk, mask=n_mask, other=0.0)   # [BN]
        return product * scale[None, :]
    else:
        return mma(x, w, UPCAST)


@triton.jit
def gather_kv(k_ptr, v_ptr, table, keys, n_mask, kv_head, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
              stride_vh, offs_d, d_mask, PAGE_SIZE: tl.constexpr):
    """Rows `keys` [BLOCK_N] of one kv head from full-precision pages [num_pages, P, Hkv, D], each gathered through
    the sequence's block table `table` (masked rows read 0): (k, v), [BLOCK_N, BLOCK_D] each."""
    page = tl.load(table + keys // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = keys % PAGE_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def owned_expert(ids_ptr, slot, num_slots, SLOTS_PAD: tl.constexpr):
    """(expert of token-slot `slot` in topk_ids, whether `slot` is the first slot routed to it): the MoE decode
    kernels run an expert in the program of its first slot only, so each needed expert is read once per step."""
    expert = tl.load(ids_ptr + slot)
    offs = tl.arange(0, SLOTS_PAD)
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    earlier = tl.sum(((ids == expert) & (offs < slot)).to(tl.int32), axis=0)
    return expert, earlier == 0


@triton.jit
def expert_sources(ids_ptr, expert, num_tokens, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """For each token t < num_tokens routed to `expert`: its token-slot t * TOP_K + j (the row of the gate_up
    activations the down projection reads), else -1: [BLOCK_T] int32."""
    tokens = tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    source = tl.zeros([BLOCK_T], tl.int32) - 1
    for j in tl.static_range(TOP_K):
        hit = tl.load(ids_ptr + tokens * TOP_K + j, mask=t_mask, other=-1) == expert
        source = tl.where(hit, tokens * TOP_K + j, source)
    return source


@triton.jit
def store_slot_rows(out_ptr, stride_row, cols, n_mask, values, ids_ptr, expert, num_tokens, TOP_K: tl.constexpr,
                    BLOCK_T: tl.constexpr):
    """values [BLOCK_T, BN] (a row per token) into out rows t * TOP_K + j of every slot j of token t routed to
    `expert`, at columns cols [BN] (n_mask): the MoE decode kernels' act / partial rows of each token-slot."""
    tokens = tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    for j in tl.static_range(TOP_K):
        hit = tl.load(ids_ptr + tokens * TOP_K + j, mask=t_mask, other=-1) == expert
        rows = (tokens * TOP_K + j).to(tl.int64)
        tl.store(out_ptr + rows[:, None] * stride_row + cols[None, :], values, mask=hit[:, None] & n_mask[None, :])


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 x rounded to `dtype` (round to nearest even), returned in `dtype`. EMULATE_BF16: do the
    bf16 rounding on the bits (the CPU interpreter's fp32 -> bf16 cast truncates; a GPU's rounds)."""
    if EMULATE_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """Base-2 online softmax over one block of scores s [M, N] -> (p, alpha, new m, new l); a row whose
    scores are all -inf so far gets p = 0 and alpha = 1 instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


def dot_modes(query: torch.Tensor, pages_dtype: torch.dtype) -> tuple[bool, bool]:
    """(HALF, UPCAST) for a kernel's dots.

    HALF: query and pages share a 16-bit dtype, so q and the probabilities are rounded to it before
    the dots (as a tensor-core kernel does). UPCAST: dot operands are widened to fp32 and multiplied
    exactly -- for fp32 or mixed dtypes, and for bf16 under the CPU interpreter, whose bf16 tl.dot
    is wrong (triton 3.9 holds bf16 as uint16 there); the products of bf16 values are exact in fp32,
    so the result matches a tensor-core bf16 dot with fp32 accumulation.
    """
    half = query.dtype == pages_dtype and pages_dtype in (torch.float16, torch.bfloat16)
    upcast = (not half) or (not query.is_cuda and pages_dtype == torch.bfloat16)
    return half, upcast


def pow2(n: int, floor: int = 16) -> int:
    """The block size covering n: a power of two, at least `floor` (tl.dot wants 16)."""
    return max(floor, triton.next_power_of_2(max(n, 1)))


def check_launchable(kernel, tensor: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter (TRITON_INTERPRET=1
    set before moekv.ops.triton was imported); anything else is a clear error, not a driver crash."""
    if tensor.is_cuda or type(kernel).__name__ == "InterpretedFunction":
        return
    raise RuntimeError("moekv Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 in the environment before "
                       "moekv.ops.triton is first imported (CPU interpreter); use the reference backend instead")

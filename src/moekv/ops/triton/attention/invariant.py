"""The batch-invariant arithmetic of full-precision paged attention (KernelConfig.batch_invariant), shared by the
decode and the prefill kernel so that a query row gets the same bits from either.

A query row at absolute position p attends over keys 0..p. In the mode its result is defined as:
  1. the keys cut into splits of SPLIT_TOKENS, at fixed absolute positions (0, 256, 512, ...), whatever the batch,
     the chunk the row came in or the step kind;
  2. per split, an online softmax over BLOCK_N-key blocks from the split's start (`block_step`), on a
     [BLOCK_ROWS, BLOCK_N] score tile (the tile shape, and so the tensor-core instruction, fixed), then the
     split's normalised output and base-2 log-sum-exp (`split_result`);
  3. the splits merged in ascending order, one at a time (`merge`), and one division at the end (`finish`).
The decode kernel runs each split in its own program (split-K: splits sized by SPLIT_TOKENS, not by the batch or
the CUDA-graph bucket) and a second launch (`merge_splits`) merges them; the prefill kernel walks the same splits
in one program and merges them in registers. A row's arithmetic is the same sequence of the same operations on
the same values either way: masked keys (past p, or past the split in decode) score -inf and add exact zeros,
and a split holding no key of the row (prefill rows before a later row's keys) merges as an exact no-op (its
log-sum-exp is -inf). The launches pass enable_fp_fusion=False, so no multiply-add is contracted differently in
the two kernels' code.

Not covered: the low-bit formats (their CUDA decode kernel and Triton prefill kernel are different arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.common import mma

SPLIT_TOKENS = 256          # keys per split (a multiple of BLOCK_N): decode's split-K unit and prefill's merge unit
BLOCK_N = 64                # keys per block, both kernels
BLOCK_ROWS = 64             # rows of the score tile, both kernels (decode: the GQA group's heads, padded)
NUM_WARPS = 4


def block_rows(group: int) -> int:
    """The score tile's rows for a GQA group of `group` query heads per kv head (both kernels)."""
    return max(BLOCK_ROWS, triton.next_power_of_2(group))


def num_splits(seq_len: int) -> int:
    """Splits of a sequence of seq_len keys (host side: the decode launch's split count for its longest one, or
    for max_model_len in a CUDA-graph bucket)."""
    return max(1, -(-seq_len // SPLIT_TOKENS))


@triton.jit
def block_step(q, k, v, visible, m_i, l_i, acc, HALF: tl.constexpr, UPCAST: tl.constexpr):
    """One block of keys: q [R, D] (scaled, in the kernel's dot dtype) against k / v [BLOCK_N, D]; visible
    [R, BLOCK_N] -> the running (max, sum, acc). A row with nothing visible so far keeps m = -inf, l = 0, acc = 0."""
    s = mma(q, tl.trans(k), UPCAST)                                         # [R, BLOCK_N] fp32
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    if HALF:
        p = p.to(v.dtype)
    acc = acc * alpha[:, None] + mma(p, v, UPCAST)
    return m_new, l_new, acc


@triton.jit
def split_result(m_i, l_i, acc):
    """A split's normalised output [R, D] fp32 and base-2 log-sum-exp [R] (-inf: no visible key)."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    part = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    return part, lse


@triton.jit
def merge(m_run, l_run, acc_run, lse, part):
    """Fold one split (lse [R], part [R, D]) into the running merge (max [R], weight sum [R], acc [R, D])."""
    m_new = tl.maximum(m_run, lse)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_run - m_use)
    weight = tl.exp2(lse - m_use)
    acc_run = acc_run * alpha[:, None] + part * weight[:, None]
    l_run = l_run * alpha + weight
    return m_new, l_run, acc_run


@triton.jit
def finish(l_run, acc_run):
    return acc_run / tl.where(l_run > 0, l_run, 1.0)[:, None]


@triton.jit
def _merge_splits_kernel(
    partial_ptr,            # [B, Hq, S, D] fp32 per-split outputs
    lse_ptr,                # [B, Hq, S] fp32
    seq_lens_ptr,           # [B] int32
    out_ptr,                # [B, Hq, D]
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    heads = kv_head * GROUP + offs_h
    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    splits = tl.cdiv(tl.load(seq_lens_ptr + seq), SPLIT_LEN)      # this sequence's own; later ones are empty
    for split in range(0, splits):
        lse = tl.load(lse_ptr + seq * stride_lb + heads * stride_lh + split, mask=h_mask, other=float("-inf"))
        part = tl.load(partial_ptr + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                       + offs_d[None, :], mask=mask, other=0.0)
        m_run, l_run, acc = merge(m_run, l_run, acc, lse, part)
    out = finish(l_run, acc)
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                 num_kv_heads: int) -> torch.Tensor:
    """partial [B, Hq, S, D] fp32, lse [B, Hq, S] fp32 of the decode kernel's SPLIT_TOKENS splits -> out [B, Hq, D]."""
    batch, num_heads, _, head_dim = partial.shape
    group = num_heads // num_kv_heads
    _merge_splits_kernel[(batch, num_kv_heads)](
        partial, lse, seq_lens, out, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), GROUP=group, BLOCK_H=block_rows(group), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), SPLIT_LEN=SPLIT_TOKENS, num_warps=NUM_WARPS,
        enable_fp_fusion=False)
    return out

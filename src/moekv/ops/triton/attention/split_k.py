"""Split-K (flash-decoding) helpers shared by the decode kernels: how many splits to launch, and the
numerically stable combine of per-split partial results.

Each split of a sequence's context writes, per query head, its softmax-normalised partial output
o_s [D] (fp32) and its log-sum-exp in base 2, lse_s = m_s + log2(l_s) (-inf for an empty split).
The combine computes out = sum_s 2**(lse_s - M) o_s / sum_s 2**(lse_s - M) with M = max_s lse_s,
so no exponent ever exceeds 1 and empty splits weigh exactly 0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100/H200); 4 off-GPU (interpreter)."""
    if device_index < 0:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device,
                min_tokens_per_split: int = 256, waves: int = 2, max_splits: int = 128) -> tuple[int, int]:
    """(num_splits, tokens_per_split) so that batch * kv_heads * splits fills the GPU about `waves` times.

    tokens_per_split is a multiple of block_n; a split never gets fewer than min_tokens_per_split
    tokens (below that the combine costs more than the parallelism buys). Among split counts from
    the smallest that gives `waves` waves to twice that, the one whose last wave is fullest wins.
    Host-side only: uses the host max_seq_len, never a device value.
    """
    sms = num_sms(device.index if device.type == "cuda" and device.index is not None
                  else (torch.cuda.current_device() if device.type == "cuda" else -1))
    programs = max(batch * num_kv_heads, 1)
    length = max(max_seq_len, 1)
    by_length = max(1, length // max(min_tokens_per_split, block_n))
    want = max(1, min(-(-waves * sms // programs), by_length, max_splits))
    best, best_fill = None, -1.0
    for splits in range(want, min(2 * want, by_length, max_splits) + 1):
        tokens_per_split = -(-(-(-length // splits)) // block_n) * block_n       # round up to whole blocks
        splits = -(-length // tokens_per_split)                                  # drop splits left empty
        total = programs * splits
        fill = total / (-(-total // sms) * sms)                                  # share of the last wave used
        if fill > best_fill + 0.02:
            best, best_fill = (splits, tokens_per_split), fill
    return best


@triton.jit
def _combine_kernel(
    partial_ptr,            # [B, Hq, S, D] fp32 normalised partial outputs
    lse_ptr,                # [B, Hq, S] fp32 base-2 log-sum-exp (-inf: empty split)
    out_ptr,                # [B, Hq, D] output (query dtype)
    num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weight = tl.exp2(lse - lse_max)                                      # [BLOCK_S], 0 for empty splits
    weight = tl.where(s_mask, weight, 0.0)
    partial = tl.load(partial_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
                      + offs_d[None, :], mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)   # [BLOCK_D]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def combine_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """partial [B, Hq, S, D] fp32, lse [B, Hq, S] fp32 -> writes and returns out [B, Hq, D]."""
    batch, num_heads, num_splits, head_dim = partial.shape
    _combine_kernel[(batch, num_heads)](
        partial, lse, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=max(triton.next_power_of_2(num_splits), 2), num_warps=4)
    return out


def combine_splits_torch(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The same combine in torch ops (the twin of combine_splits; used by tests), fp32."""
    lse_max = lse.max(dim=-1, keepdim=True).values                       # [B, Hq, 1]
    weight = torch.exp2(lse - lse_max)                                   # [B, Hq, S]
    return (partial * weight.unsqueeze(-1)).sum(2) / weight.sum(-1, keepdim=True)

"""What the two decode-only low-bit kernels (lowbit_decode_tc.py, v5.1; lowbit_decode_tm.py, v6) share:
the code modes, the per-token scale / zero point helper of their page loops, and the host side of a
launch (override checks, the decode-only contract, split planning and the split-K outputs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.attention.split_k import plan_splits

CODES_FP32 = 0          # fp32 queries: fp32 operands, exact fp32 dots
CODES_MAGIC = 1         # fp16 (code | 0x6400) - 1024
CODES_SUBNORMAL = 2     # fp16 subnormal code * 2^-24 (bit pattern = the code); 2^24 applied after the dot


@triton.jit
def token_scale_zero(scale_ptr, zero_ptr, base, rows, BITS: tl.constexpr):
    """Per-token (one group) S / scale_base and Z of the rows `rows` (uint8 codes)."""
    relative = tl.exp2(-tl.load(scale_ptr + rows).to(tl.float32) * (1.0 / 16.0))
    zero = -((base * relative) * tl.load(zero_ptr + rows).to(tl.float32)) * (1.0 / (1 << (8 - BITS)))
    return relative, zero


def supports(key_spec, value_spec, head_dim: int) -> bool:
    """Whether the decode kernels (v5.1 and v6 take the same formats) handle the format: keys channel axis or
    token axis with one group, values token axis with one group, bits 4/3/2, head_dim 64 or 128, equal
    power-of-two pages >= 16."""
    page_size = key_spec.page_size
    return (page_size == value_spec.page_size and page_size >= 16 and page_size & (page_size - 1) == 0
            and head_dim in (64, 128) and key_spec.head_dim == value_spec.head_dim == head_dim
            and key_spec.bits in (2, 3, 4) and value_spec.bits in (2, 3, 4)
            and (key_spec.axis == "channel" or key_spec.num_groups == 1)
            and value_spec.axis == "token" and value_spec.num_groups == 1)


def launch_config(defaults: dict, overrides: dict) -> dict:
    """defaults updated by the caller's launch overrides; an unknown key is a TypeError."""
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise TypeError(f"unknown launch overrides {sorted(unknown)}")
    return {**defaults, **overrides}


def decode_batch(meta, num_tokens: int, name: str) -> int:
    """The batch of a decode step (one new token per sequence), else a ValueError naming the kernel."""
    batch = meta.context_lens.shape[0]
    fixed = getattr(meta, "fixed_num_splits", None)
    if (fixed is not None and num_tokens != batch) or (fixed is None and not meta.is_decode):
        raise ValueError(f"{name}: decode only (one new token per sequence)")
    return batch


def code_mode(query: torch.Tensor, codes: str) -> int:
    """How codes become dot operands: fp16 ("magic" / "subnormal") for 16-bit queries, fp32 otherwise."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return {"magic": CODES_MAGIC, "subnormal": CODES_SUBNORMAL}[codes]
    return CODES_FP32


def page_tensors(pages, prefix: str) -> list[torch.Tensor]:
    """A PackedPages' tensors in the kernels' argument order (each must be contiguous)."""
    for name, tensor in pages.tensors().items():
        assert tensor.is_contiguous(), f"{prefix} {name} must be contiguous"
    base = pages.scale_base if pages.scale_base is not None else pages.scale
    return [pages.codes, pages.scale, pages.zero, base, pages.outlier_vals, pages.outlier_idx, pages.outlier_count]


def decode_splits(meta, batch: int, num_kv_heads: int, page_size: int, device, num_splits, waves) -> tuple[int, int]:
    """(splits per (sequence, kv head), pages per split; 0: sized on the device) -- `meta.fixed_num_splits`
    when set (CUDA-graph safe, nothing read from the host), else planned from the host context lengths."""
    fixed = getattr(meta, "fixed_num_splits", None)
    if fixed is not None:
        return max(int(fixed), 1), 0
    max_context = max(meta.context_lens_host, default=0)
    if num_splits is None:
        num_splits, tokens_per_split = plan_splits(batch, num_kv_heads, max_context, page_size, device, waves=waves)
    else:
        tokens_per_split = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), page_size) * page_size
    return max(int(num_splits), 1), tokens_per_split // page_size


def split_outputs(out: torch.Tensor, num_splits: int, always: bool = False):
    """(partial, lse, target, strides): with several splits (or `always`) the kernel writes fp32 partial outputs
    and their log-sum-exp for split_k.combine_splits; with one it writes `out` directly (partial None, lse = out)."""
    if num_splits == 1 and not always:
        return None, out, out, (out.stride(0), out.stride(1), 0, 0, 0)
    num_tokens, num_heads, head_dim = out.shape
    partial = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device)
    lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=out.device)
    return partial, lse, partial, (partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1))

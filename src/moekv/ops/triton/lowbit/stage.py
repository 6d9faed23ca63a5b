"""Decode-step staging write of the low-bit cache, the Triton twin of ops.reference.lowbit.stage_decode_tokens.

One program per new token (decode: one token per sequence). It loads the token's key and value rows
[Hkv, D], checks that every element of both is finite, ORs "non-finite" into the token's flag, and
writes the rows (all zeros when either row has a non-finite element) to the token's staging row
(keys and values) and to the small persistent buffers the attention call reads the new token from.
One launch replaces isfinite / all / and / or / where / index_copy_ (about a dozen small kernels a
layer). Fixed grid [B], no host reads: safe to capture in a CUDA graph. Several tokens may share a
staging row (padding sequences on the runner's scratch page): they are then all written, in no set
order, as index_copy_ with repeated indices does (the row is never read back).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.common import check_launchable


@triton.jit
def _stage_kernel(
    key_ptr, stride_kt, stride_kh, value_ptr, stride_vt, stride_vh,
    staging_k_ptr, staging_v_ptr, stride_sr, stride_sh,       # staging viewed as [S * P, Hkv, D] (same strides)
    key_out_ptr, value_out_ptr, stride_ot, stride_oh,          # zeroed copies [B, Hkv, D] (same strides)
    rows_ptr, flags_ptr,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    kf = k.to(tl.float32)
    vf = v.to(tl.float32)
    bad_k = (kf != kf) | (tl.abs(kf) == float("inf"))
    bad_v = (vf != vf) | (tl.abs(vf) == float("inf"))
    num_bad = tl.sum(tl.sum(bad_k.to(tl.int32) + bad_v.to(tl.int32), axis=1), axis=0)
    finite = num_bad == 0
    k = tl.where(finite, k, tl.zeros_like(k))
    v = tl.where(finite, v, tl.zeros_like(v))
    if not finite:
        tl.store(flags_ptr + token, 1)                        # OR into the flag: only ever set here
    out_off = token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(key_out_ptr + out_off, k.to(key_out_ptr.dtype.element_ty), mask=mask)
    tl.store(value_out_ptr + out_off, v.to(value_out_ptr.dtype.element_ty), mask=mask)
    row = tl.load(rows_ptr + token).to(tl.int64)
    stage_off = row * stride_sr + offs_h[:, None] * stride_sh + offs_d[None, :]
    tl.store(staging_k_ptr + stage_off, k.to(staging_k_ptr.dtype.element_ty), mask=mask)
    tl.store(staging_v_ptr + stage_off, v.to(staging_v_ptr.dtype.element_ty), mask=mask)


def stage_decode_tokens(key: torch.Tensor, value: torch.Tensor, staging_keys: torch.Tensor,
                        staging_values: torch.Tensor, stage_rows: torch.Tensor, flags: torch.Tensor,
                        key_out: torch.Tensor, value_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ops.reference.lowbit.stage_decode_tokens."""
    count, heads, dim = key.shape
    if value.shape != key.shape or stage_rows.shape != (count,) or flags.shape != (count,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, stage_rows "
                         f"{tuple(stage_rows.shape)} and flags {tuple(flags.shape)} must be [B, Hkv, D] / [B]")
    if staging_keys.shape != staging_values.shape or staging_keys.shape[2:] != (heads, dim):
        raise ValueError(f"staging pools {tuple(staging_keys.shape)} / {tuple(staging_values.shape)} do not hold "
                         f"rows of [{heads}, {dim}]")
    if key_out.shape != key.shape or value_out.shape != key.shape:
        raise ValueError(f"key_out {tuple(key_out.shape)} / value_out {tuple(value_out.shape)} must be "
                         f"{tuple(key.shape)}")
    assert staging_keys.stride() == staging_values.stride() and key_out.stride() == value_out.stride()
    assert staging_keys.stride(0) == staging_keys.shape[1] * staging_keys.stride(1)    # [S * P] rows: one flat dim
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    assert staging_keys.stride(-1) == 1 and key_out.stride(-1) == 1
    assert flags.dtype == torch.bool and flags.is_contiguous()
    if count == 0:
        return key_out, value_out
    _launch(key, value, staging_keys, staging_values, stage_rows, flags, key_out, value_out)
    return key_out, value_out


def _launch(key, value, staging_keys, staging_values, stage_rows, flags, key_out, value_out) -> None:
    check_launchable(_stage_kernel, key)
    count, heads, dim = key.shape
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
    _stage_kernel[(count,)](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
        staging_keys, staging_values, staging_keys.stride(1), staging_keys.stride(2),
        key_out, value_out, key_out.stride(0), key_out.stride(1),
        stage_rows, flags.view(torch.uint8),
        H=heads, D=dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4)     # sm_90: no stack at 4 warps for [Hkv, D] up to [16, 128] (tools/sass_stats.py)

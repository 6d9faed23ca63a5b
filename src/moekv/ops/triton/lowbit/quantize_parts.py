"""Device helpers of the page-fill quantizer (quantize.py): fp16 rounding in a set direction, round half to
even, per-group statistics and extremes on either axis, and packing one bit plane (docs/kv-format.md)."""

from __future__ import annotations

import triton
import triton.language as tl

from moekv.ops.triton.lowbit.unpack import field_shifts


@triton.jit
def fp16_rounded(x, UP: tl.constexpr):
    """fp32 x -> fp16 rounded toward +inf (UP) or -inf, saturated to +-65504 (as the reference)."""
    h = tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)
    negative = bits < 0
    if UP:
        wrong = h.to(tl.float32) < x
        step = tl.where(negative, -1, 1)
    else:
        wrong = h.to(tl.float32) > x
        step = tl.where(negative, 1, -1)
    bits = tl.where(wrong, bits + step, bits)
    h = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.minimum(tl.maximum(h, -65504.0), 65504.0)


@triton.jit
def round_half_even(y):
    """torch.round for |y| < 2**22 (y is clamped to a few levels around the code range first)."""
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def group_stat(x, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """Sum of x [P, D] over each quantization group, broadcast back to [P, D]."""
    if AXIS_CHANNEL:
        return tl.broadcast_to(tl.sum(x, axis=0)[None, :], (P, D))
    else:
        grouped = tl.reshape(x, (P, G, D // G))
        return tl.reshape(tl.broadcast_to(tl.sum(grouped, axis=2)[:, :, None], (P, G, D // G)), (P, D))


@triton.jit
def group_extreme(x, IS_MAX: tl.constexpr, AXIS_CHANNEL: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                   G: tl.constexpr):
    """Min or max of x [P, D] over each group: [D] (channel axis) or [P, G] (token axis)."""
    if AXIS_CHANNEL:
        if IS_MAX:
            return tl.max(x, axis=0)
        else:
            return tl.min(x, axis=0)
    else:
        grouped = tl.reshape(x, (P, G, D // G))
        if IS_MAX:
            return tl.max(grouped, axis=2)
        else:
            return tl.min(grouped, axis=2)


@triton.jit
def pack_plane(fields, P: tl.constexpr, D: tl.constexpr, WIDTH: tl.constexpr):
    """fields [P, D] int32 (< 2**WIDTH) -> words [P, D * WIDTH // 32] int32: field j at bit
    core.lowbit_pack.field_bit(WIDTH, j % (32/W)): (j % (32/W)) * W, the 1-bit plane's word halves interleaved."""
    per_word: tl.constexpr = 32 // WIDTH
    grouped = tl.reshape(fields, (P, D // per_word, per_word))
    shifted = grouped << field_shifts(WIDTH)[None, None, :]
    return tl.sum(shifted, axis=2)                       # disjoint fields: the sum is the bitwise or

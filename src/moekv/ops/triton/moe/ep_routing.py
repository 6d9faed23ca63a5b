"""The expert-parallel all-gather exchange's routing step in one launch (the Triton twin of
ops.reference.ep_routing.ep_local_routing, which documents the contract).

One program reads every gathered code (N * (k + 1) of them: at most a few thousand in a decode step),
looks each up in the table, takes the maximum local slot as the stand-in for choices held elsewhere,
and writes the local slots and masked weights: five small launches of the eager version become one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.triton.common import check_launchable

MAX_ELEMENTS = 16384           # one program holds every code of the call


@triton.jit
def _ep_routing_kernel(table_ptr, codes_ptr, weights_ptr, local_ptr, out_w_ptr, num_rows,
                       stride_c, stride_w, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    row = offs // (TOP_K + 1)
    col = offs % (TOP_K + 1)
    valid = row < num_rows
    code = tl.load(codes_ptr + row * stride_c + col, mask=valid, other=0)
    local = tl.load(table_ptr + code, mask=valid, other=-1)                     # [BLOCK] int64
    reused = tl.max(local, axis=0)                                               # >= 0: the floor column
    choice = valid & (col < TOP_K)
    weight = tl.load(weights_ptr + row * stride_w + col, mask=choice, other=0.0)
    mine = local >= 0
    out_index = row * TOP_K + col
    tl.store(local_ptr + out_index, tl.where(mine, local, reused), mask=choice)
    tl.store(out_w_ptr + out_index, tl.where(mine, weight, 0.0), mask=choice)


def supports(codes: torch.Tensor, top_k: int) -> bool:
    return codes.shape[0] * (top_k + 1) <= MAX_ELEMENTS and codes.stride(1) == 1


def ep_local_routing(table: torch.Tensor, codes: torch.Tensor, weights: torch.Tensor, top_k: int):
    num_rows = codes.shape[0]
    local = torch.empty((num_rows, top_k), dtype=torch.int64, device=codes.device)
    out_w = torch.empty((num_rows, top_k), dtype=torch.float32, device=codes.device)
    if num_rows == 0:
        return local, out_w
    check_launchable(_ep_routing_kernel, codes)
    assert codes.dtype == torch.int64 and table.dtype == torch.int64 and weights.dtype == torch.float32
    assert codes.shape[1] == top_k + 1 and weights.shape[1] >= top_k and weights.stride(1) == 1
    block = max(16, triton.next_power_of_2(num_rows * (top_k + 1)))
    _ep_routing_kernel[(1,)](table, codes, weights, local, out_w, num_rows, codes.stride(0), weights.stride(0),
                             TOP_K=top_k, BLOCK=block, num_warps=4)
    return local, out_w

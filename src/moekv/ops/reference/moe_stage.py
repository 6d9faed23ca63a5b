"""Expert copies described on the device: the reference twin of ops.triton.moe.stage (pure PyTorch).

`stage_expert_copies(src, dst, src_ids, dst_ids)`: for every entry m with src_ids[m] >= 0,
dst[dst_ids[m]] = src[src_ids[m]] (one expert's slice of one plane: host copy -> device slot pool).
Entries with src_ids[m] < 0 copy nothing (their dst_ids name the pool's trash slot, so the fixed-shape
gather below may write there). src [E, ...] may live in host memory, dst [N, ...] on the device;
src_ids / dst_ids [M] int64 on dst's device. Reads the ids from the device when src is in host memory
(the reference is not capturable; the Triton kernel reads host memory from the device and is).
"""

from __future__ import annotations

import torch


def _bytes(plane: torch.Tensor) -> torch.Tensor:
    return plane.reshape(plane.shape[0], -1).view(torch.uint8)                      # [R, bytes] (any dtype)


def stage_expert_copies(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    gather = src_ids.clamp(min=0).to(src.device)                                     # [M]
    rows = _bytes(src).index_select(0, gather).to(dst.device, non_blocking=True)     # [M, bytes]
    _bytes(dst).index_copy_(0, dst_ids, rows)

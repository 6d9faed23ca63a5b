"""The align step of the grouped MoE path on the device: token-slots sorted by expert, each expert's
run padded to a multiple of BLOCK_M, so that every BLOCK_M rows of the grouped GEMM share one expert.

The Triton twin of ops.reference.moe.moe_align_reference (same outputs, bit for bit). Three
launches, no host synchronisation and no memset:

1. count (one program per CHUNK slots): each slot's rank among the slots of its expert inside the
   chunk (a one-hot [CHUNK, E] matrix, cumulated down the chunk), and the chunk's per-expert counts.
2. scan (one program): per expert, the exclusive prefix of the chunk counts (rewritten in place: the
   row where the chunk's slots of that expert start, relative to the expert's run), the total counts,
   the padded run starts, num_padded and the expert of every block.
3. scatter (one program per CHUNK rows of the output): writes each slot of chunk `pid` to its row,
   and the "no slot" marker N into the padding rows of rows pid*CHUNK .. (disjoint rows, no races).

Slots keep their ascending order inside an expert's run (chunks are ranked in order), as the stable
argsort of the reference does.

Up to ONE_PROGRAM_SLOTS slots (decode batches: Mixtral's B=64 is 128 slots, Qwen3-30B-A3B's 512) the three steps run
as one program instead (`_align_one_kernel`): two passes over the slots (counts, then each slot's row from the
running per-expert counts) and one over the rows (padding, block experts). One launch instead of three, and its
chunk sized to the slots (the count launch's one-hot tile is 1024 x E rows even for 128 slots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.reference.moe import padded_capacity
from moekv.ops.triton.common import check_launchable


@triton.jit
def _align_count_kernel(ids_ptr, rank_ptr, chunk_counts_ptr, num_slots, num_experts,
                        CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    slots = chunk * CHUNK + tl.arange(0, CHUNK)                                 # [CHUNK]
    valid = slots < num_slots
    ids = tl.load(ids_ptr + slots, mask=valid, other=-1).to(tl.int32)            # [CHUNK]
    experts = tl.arange(0, E_PAD)                                               # [E_PAD]
    one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)                   # [CHUNK, E_PAD]
    running = tl.cumsum(one_hot, axis=0)                                        # [CHUNK, E_PAD]
    rank = tl.sum(running * one_hot, axis=1) - 1                                # [CHUNK]
    tl.store(rank_ptr + slots, rank, mask=valid)
    counts = tl.sum(one_hot, axis=0)                                            # [E_PAD]
    tl.store(chunk_counts_ptr + chunk * num_experts + experts, counts, mask=experts < num_experts)


@triton.jit
def _align_scan_kernel(chunk_counts_ptr, counts_ptr, padded_start_ptr, block_experts_ptr, num_padded_ptr,
                       num_chunks, num_experts, num_blocks,
                       BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNKS_PER_STEP: tl.constexpr,
                       BLOCKS_PER_STEP: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    e_mask = experts < num_experts
    carry = tl.zeros([E_PAD], tl.int32)
    rows = tl.arange(0, CHUNKS_PER_STEP)
    for first in range(0, num_chunks, CHUNKS_PER_STEP):
        chunk = first + rows                                                    # [C]
        ptrs = chunk_counts_ptr + chunk[:, None] * num_experts + experts[None, :]
        mask = (chunk < num_chunks)[:, None] & e_mask[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)                              # [C, E_PAD]
        inclusive = tl.cumsum(counts, axis=0)
        tl.store(ptrs, inclusive - counts + carry[None, :], mask=mask)          # exclusive prefix
        carry += tl.sum(counts, axis=0)
    padded = (carry + BLOCK_M - 1) // BLOCK_M * BLOCK_M                         # [E_PAD]
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(counts_ptr + experts, carry, mask=e_mask)
    tl.store(padded_start_ptr + experts, padded_end - padded, mask=e_mask)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    offs = tl.arange(0, BLOCKS_PER_STEP)
    for first in range(0, num_blocks, BLOCKS_PER_STEP):
        block = first + offs                                                    # [B]
        start = block * BLOCK_M
        before = (padded_end[None, :] <= start[:, None]) & e_mask[None, :]      # runs that end before it
        expert = tl.sum(before.to(tl.int32), axis=1)
        expert = tl.where(start < total, expert, -1)
        tl.store(block_experts_ptr + block, expert, mask=block < num_blocks)


@triton.jit
def _align_scatter_kernel(ids_ptr, rank_ptr, chunk_offsets_ptr, counts_ptr, padded_start_ptr, block_experts_ptr,
                          sorted_ptr, num_slots, num_experts, num_chunks, capacity,
                          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)                                    # [CHUNK]
    if pid < num_chunks:
        valid = offs < num_slots
        ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
        rank = tl.load(rank_ptr + offs, mask=valid, other=0)
        before = tl.load(chunk_offsets_ptr + pid * num_experts + ids, mask=valid, other=0)
        start = tl.load(padded_start_ptr + ids, mask=valid, other=0)
        tl.store(sorted_ptr + start + before + rank, offs, mask=valid)
    # padding rows among rows pid*CHUNK ..: past num_padded, or past the end of their expert's slots
    in_range = offs < capacity
    expert = tl.load(block_experts_ptr + offs // BLOCK_M, mask=in_range, other=-1)
    owned = expert >= 0
    start = tl.load(padded_start_ptr + expert, mask=in_range & owned, other=0)
    count = tl.load(counts_ptr + expert, mask=in_range & owned, other=0)
    padding = (~owned) | (offs - start >= count)
    tl.store(sorted_ptr + offs, tl.full([CHUNK], 0, tl.int32) + num_slots, mask=in_range & padding)


ONE_PROGRAM_SLOTS = 1024          # at most this many slots: one program (`_align_one_kernel`), else three launches


@triton.jit
def _align_one_kernel(ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, num_slots, num_experts, capacity,
                      BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr):
    experts = tl.arange(0, E_PAD)                                               # [E_PAD]
    e_mask = experts < num_experts
    lanes = tl.arange(0, CHUNK)                                                 # [CHUNK]
    counts = tl.zeros([E_PAD], tl.int32)
    for first in range(0, num_slots, CHUNK):                                    # pass 1: per-expert counts
        slots = first + lanes
        ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M                        # [E_PAD]
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    seen = tl.zeros([E_PAD], tl.int32)                                          # slots of each expert so far
    for first in range(0, num_slots, CHUNK):                                    # pass 2: each slot to its row
        slots = first + lanes
        valid = slots < num_slots
        ids = tl.load(ids_ptr + slots, mask=valid, other=-1).to(tl.int32)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)               # [CHUNK, E_PAD]
        base = padded_start + seen - 1                                          # [E_PAD]
        row = tl.sum((tl.cumsum(one_hot, axis=0) + base[None, :]) * one_hot, axis=1)
        tl.store(sorted_ptr + row, slots, mask=valid)
        seen += tl.sum(one_hot, axis=0)
    offs = tl.arange(0, ROWS)                                                   # pass 3: padding rows, blocks
    for first in range(0, capacity, ROWS):
        rows = first + offs                                                     # [ROWS]
        in_range = rows < capacity
        before = (padded_end[None, :] <= rows[:, None]) & e_mask[None, :]       # runs that end at or before it
        expert = tl.sum(before.to(tl.int32), axis=1)                            # [ROWS]
        owned = rows < total
        mine = experts[None, :] == expert[:, None]                              # [ROWS, E_PAD]
        start = tl.sum(tl.where(mine, padded_start[None, :], 0), axis=1)
        count = tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
        padding = (~owned) | (rows - start >= count)
        tl.store(sorted_ptr + rows, tl.full([ROWS], 0, tl.int32) + num_slots, mask=in_range & padding)
        tl.store(block_experts_ptr + rows // BLOCK_M, tl.where(owned, expert, -1),
                 mask=in_range & (rows % BLOCK_M == 0))


def align_chunk(num_experts: int) -> tuple[int, int]:
    """(CHUNK, E_PAD): slots per count program, keeping the one-hot tile at 8K elements or less."""
    e_pad = triton.next_power_of_2(max(num_experts, 2))
    return max(16, min(1024, 8192 // e_pad)), e_pad


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ops.reference.moe.moe_align_reference; block_m a power of two."""
    flat_ids = topk_ids.reshape(-1)                                             # [N]
    if not flat_ids.is_contiguous():
        flat_ids = flat_ids.contiguous()
    num_slots = flat_ids.numel()
    device = flat_ids.device
    capacity = padded_capacity(num_slots, num_experts, block_m)
    num_blocks = capacity // block_m
    sorted_slots = torch.empty(capacity, dtype=torch.int32, device=device)     # [P]
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)  # [P / block_m]
    num_padded = torch.empty(1, dtype=torch.int32, device=device)              # [1]
    chunk, e_pad = align_chunk(num_experts)
    num_chunks = triton.cdiv(num_slots, chunk)
    if num_slots == 0:
        num_padded.zero_()
        return sorted_slots, block_experts, num_padded
    check_launchable(_align_count_kernel, flat_ids)
    if num_slots <= ONE_PROGRAM_SLOTS:
        one_chunk = max(16, min(chunk, triton.next_power_of_2(num_slots)))
        _align_one_kernel[(1,)](flat_ids, sorted_slots, block_experts, num_padded, num_slots, num_experts, capacity,
                                BLOCK_M=block_m, CHUNK=one_chunk, E_PAD=e_pad, ROWS=max(16, 4096 // e_pad))
        return sorted_slots, block_experts, num_padded
    rank = torch.empty(num_slots, dtype=torch.int32, device=device)            # [N]
    chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)        # [E]
    padded_start = torch.empty(num_experts, dtype=torch.int32, device=device)  # [E]
    _align_count_kernel[(num_chunks,)](flat_ids, rank, chunk_counts, num_slots, num_experts,
                                       CHUNK=chunk, E_PAD=e_pad)
    _align_scan_kernel[(1,)](chunk_counts, counts, padded_start, block_experts, num_padded,
                             num_chunks, num_experts, num_blocks, BLOCK_M=block_m, E_PAD=e_pad,
                             CHUNKS_PER_STEP=max(1, min(64, 4096 // e_pad)), BLOCKS_PER_STEP=max(1, 4096 // e_pad))
    _align_scatter_kernel[(triton.cdiv(capacity, chunk),)](
        flat_ids, rank, chunk_counts, counts, padded_start, block_experts, sorted_slots,
        num_slots, num_experts, num_chunks, capacity, BLOCK_M=block_m, CHUNK=chunk)
    return sorted_slots, block_experts, num_padded

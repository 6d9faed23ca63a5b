"""Expert copies described on the device (twin: ops.reference.moe_stage), for offloaded decode without host
reads: the copy list (which expert goes to which pool slot) is a device tensor written by the device slot
table (moe/prefetch/device_staging.py), and this kernel reads the host copies of the experts straight from
pinned host memory through the unified virtual address space (zero-copy: a pinned allocation's host address
is valid on the device), so no host decision is needed and a CUDA graph can capture it.

One launch per plane: program (m, c) copies chunk c (CHUNK words) of entry m's expert, skipping entries
whose source id is negative. The grid is fixed by the shapes (M entries x chunks per expert), so the copy
always takes the same launch; unused entries exit at once. Words are the widest of 4 / 2 / 1 bytes dividing
one expert's slice. Under TRITON_INTERPRET the same kernel runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 1 << 20          # bytes one program copies (a 336 MiB expert: 336 programs per entry)
BLOCK = 2048                   # words per loop step


@triton.jit
def _stage_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, words, chunk_words, BLOCK: tl.constexpr):
    entry = tl.program_id(0)
    chunk = tl.program_id(1)
    expert = tl.load(src_ids_ptr + entry)
    if expert >= 0:
        slot = tl.load(dst_ids_ptr + entry)
        src = src_ptr + expert.to(tl.int64) * words
        dst = dst_ptr + slot.to(tl.int64) * words
        begin = chunk.to(tl.int64) * chunk_words
        end = tl.minimum(begin + chunk_words, words)
        for start in range(begin, end, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < end
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def word_view(plane: torch.Tensor) -> torch.Tensor:
    """plane [R, ...] contiguous -> [R, W] of the widest integer words dividing one row's bytes."""
    row_bytes = plane[0].nbytes if plane.shape[0] else 0
    word = torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.uint8
    return plane.reshape(plane.shape[0], -1).view(torch.uint8).view(word)


def stage_expert_copies(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    assert src.is_contiguous() and dst.is_contiguous() and src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype
    source, target = word_view(src), word_view(dst)
    words = source.shape[1]
    chunk_words = max(BLOCK, CHUNK_BYTES // source.element_size() // BLOCK * BLOCK)
    entries = src_ids.shape[0]
    if entries == 0 or words == 0:
        return
    grid = (entries, triton.cdiv(words, chunk_words))
    _stage_kernel[grid](source, target, src_ids.contiguous(), dst_ids.contiguous(), words, chunk_words, BLOCK=BLOCK)

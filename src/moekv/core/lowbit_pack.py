"""Dense bit packing of low-bit codes into 32-bit words along head_dim (see docs/kv-format.md).

A row of `head_dim` codes of `bits` bits is stored as one or two *bit planes*; a plane of k-bit
fields packs 32 // k fields per int32 word, field j of the row in word j // (32 // k) at bit
field_bit(k, j % (32 // k)): (j % (32 // k)) * k for the 2- and 4-bit planes; the 1-bit plane
interleaves the halves of its word (field i < 16 at bit 2i, field 16 + i at bit 2i + 1), so that a
field's high bit sits two bits above where a mask of its 2-bit word leaves its low bits, after one
shift per word (the v7 decode kernel, docs/kv-format.md). int4 = one 4-bit plane, int2 = one 2-bit
plane, int3 = a 2-bit plane (the code's low two bits) followed by a 1-bit plane (its high bit):
exactly 3 bits per code when head_dim is a multiple of 32.
"""

from __future__ import annotations

import functools
import sys

import torch

# Field widths of the bit planes of each code width, lowest code bits first.
PLANES: dict[int, tuple[int, ...]] = {4: (4,), 3: (2, 1), 2: (2,)}
SUPPORTED_BITS = tuple(sorted(PLANES))


def _check_bits(bits: int) -> None:
    if bits not in PLANES:
        raise ValueError(f"code width must be one of {SUPPORTED_BITS} bits, got {bits!r}")


def plane_words(width: int, head_dim: int) -> int:
    """Words one row of `head_dim` fields of `width` bits takes (the last word zero-padded)."""
    per_word = 32 // width
    return -(-head_dim // per_word)


def words_per_row(bits: int, head_dim: int) -> int:
    """int32 words per packed row of `head_dim` codes (all planes)."""
    _check_bits(bits)
    return sum(plane_words(width, head_dim) for width in PLANES[bits])


def field_bit(width: int, field: int) -> int:
    """Bit position of field `field` (0 <= field < 32 // width) inside its word."""
    if width == 1:
        return 2 * field if field < 16 else 2 * (field - 16) + 1
    return field * width


def field_shifts(width: int, device=None) -> torch.Tensor:
    """[32 // width] int64: field_bit of every field of a word, in field order."""
    return torch.tensor([field_bit(width, f) for f in range(32 // width)], dtype=torch.int64, device=device)


def plane_offsets(bits: int, head_dim: int) -> list[tuple[int, int, int]]:
    """(first word, word count, field width) of each plane inside a packed row."""
    _check_bits(bits)
    offsets, start = [], 0
    for width in PLANES[bits]:
        count = plane_words(width, head_dim)
        offsets.append((start, count, width))
        start += count
    return offsets


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same bits as int32 (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] integers in [0, 2**bits) -> packed words [..., words_per_row(bits, D)] int32."""
    _check_bits(bits)
    head_dim = codes.shape[-1]
    codes = codes.to(torch.int64)
    planes, low_bit = [], 0
    for width in PLANES[bits]:
        per_word = 32 // width
        count = plane_words(width, head_dim)
        field = (codes >> low_bit) & ((1 << width) - 1)                          # [..., D]
        field = torch.nn.functional.pad(field, (0, count * per_word - head_dim))  # [..., count * per_word]
        field = field.unflatten(-1, (count, per_word))                           # [..., count, per_word]
        planes.append(_to_int32((field << field_shifts(width, codes.device)).sum(-1)))   # [..., count]
        low_bit += width
    return torch.cat(planes, dim=-1)


@functools.lru_cache(maxsize=32)
def _byte_table(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8 // width]: the fields of every byte value, lowest bits first."""
    per_byte = 8 // width
    values = torch.arange(256, dtype=torch.int32).unsqueeze(1)                   # [256, 1]
    shifts = torch.arange(per_byte, dtype=torch.int32) * width
    return ((values >> shifts) & ((1 << width) - 1)).to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=8)
def _bit_of_field(device: torch.device) -> torch.Tensor:
    """[32]: the bit that holds each field of a 1-bit-plane word (field order -> bit order)."""
    return field_shifts(1, device)


def unpack_codes(words: torch.Tensor, bits: int, head_dim: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """packed words [..., W] int32 -> codes [..., head_dim] (the exact inverse of pack_codes), as `dtype`.

    Per plane, `(word >> field_bit(k, i)) & (2**k - 1)` for i < 32 / k is field i of the word; this
    reference reads the fields in bit order one byte at a time through a 256-entry table (little-endian
    words), which is the fast way on a CPU, then puts the 1-bit plane's fields back in field order.
    """
    _check_bits(bits)
    if words.shape[-1] != words_per_row(bits, head_dim):
        raise ValueError(f"{bits}-bit rows of {head_dim} codes take {words_per_row(bits, head_dim)} words, "
                         f"got {words.shape[-1]}")
    codes, low_bit = None, 0
    for start, count, width in plane_offsets(bits, head_dim):
        plane = words[..., start:start + count].contiguous()                     # [..., count] int32
        if sys.byteorder == "little":
            table = _byte_table(width, dtype if dtype.is_floating_point else torch.int32, words.device)
            field = table[plane.view(torch.uint8).int()].flatten(-2)             # [..., count * 32 / k], bit order
            if width == 1:
                field = field.unflatten(-1, (count, 32))[..., _bit_of_field(words.device)].flatten(-2)
        else:
            shifts = field_shifts(width, words.device)
            field = ((plane.unsqueeze(-1).long() >> shifts) & ((1 << width) - 1)).flatten(-2)
        field = field[..., :head_dim]
        codes = field if codes is None else codes + field * (1 << low_bit)
        low_bit += width
    return codes.to(dtype)

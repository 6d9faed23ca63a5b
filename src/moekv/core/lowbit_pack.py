"""Dense bit packing of low-bit codes into 32-bit words along head_dim (see docs/kv-format.md, section 2).

int4 and int2: one *bit plane* of k-bit fields, 32 // k fields per int32 word, field j of the row in word
j // (32 // k) at bit (j % (32 // k)) * k.

int3: *triplets*. The row's channels go in groups of 32 (the last group zero-padded); group j owns three words,
words 2j and 2j + 1 of the row's first 2 * G words and word 2G + j of its last G (G = ceil(head_dim / 32)), called
its words 0, 1 and 2. Local channel l of the group (h = l // 16, m = l % 16): for m < 15 the code sits in word
m // 5 at bit 16h + TRIPLET_BITS[m % 5] (3 bits); channel m = 15 of each half is spread over the three words, bit
i of its code at bit 16h + 9 of word i. So every 16-bit half holds five 3-bit fields at bits 0, 3, 6, 10, 13 plus
one bit of the half's sixteenth code: the v10 decode kernel turns a word into five fp16 operand registers with
one shift and five masks (docs/attention-kernels.md). Exactly 3 bits per code when head_dim is a multiple of 32.
"""

from __future__ import annotations

import functools
import sys

import torch

# Field widths of the bit planes of the one-plane widths.
PLANES: dict[int, tuple[int, ...]] = {4: (4,), 2: (2,)}
SUPPORTED_BITS = (2, 3, 4)
TRIPLET_BITS = (0, 3, 6, 10, 13)     # int3: bits of the five whole fields of a 16-bit half
TRIPLET_SPARE_BIT = 9                # int3: the half's bit of its sixteenth code
GROUP = 32                           # int3: channels per triplet group (three words)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"code width must be one of {SUPPORTED_BITS} bits, got {bits!r}")


def plane_words(width: int, head_dim: int) -> int:
    """Words one row of `head_dim` fields of `width` bits takes (the last word zero-padded)."""
    per_word = 32 // width
    return -(-head_dim // per_word)


def groups(head_dim: int) -> int:
    """int3: triplet groups of a row."""
    return -(-head_dim // GROUP)


def words_per_row(bits: int, head_dim: int) -> int:
    """int32 words per packed row of `head_dim` codes."""
    _check_bits(bits)
    if bits == 3:
        return 3 * groups(head_dim)
    return plane_words(PLANES[bits][0], head_dim)


def field_bit(width: int, field: int) -> int:
    """int4 / int2: bit position of field `field` (0 <= field < 32 // width) inside its word."""
    return field * width


def field_shifts(width: int, device=None) -> torch.Tensor:
    """[32 // width] int64: field_bit of every field of a word, in field order."""
    return torch.tensor([field_bit(width, f) for f in range(32 // width)], dtype=torch.int64, device=device)


def code_bits(bits: int, head_dim: int, channel: int) -> list[tuple[int, int, int, int]]:
    """Where the code of channel `channel` lives: (word, bit in the word, bit of the code, width) per piece."""
    _check_bits(bits)
    if bits != 3:
        per_word = 32 // bits
        return [(channel // per_word, field_bit(bits, channel % per_word), 0, bits)]
    group, local = divmod(channel, GROUP)
    half, m = divmod(local, 16)
    word = [2 * group, 2 * group + 1, 2 * groups(head_dim) + group]
    if m == 15:
        return [(word[i], 16 * half + TRIPLET_SPARE_BIT, i, 1) for i in range(3)]
    return [(word[m // 5], 16 * half + TRIPLET_BITS[m % 5], 0, 3)]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same bits as int32 (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@functools.lru_cache(maxsize=8)
def _triplet_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[2, 3, 5] bit of field (half, word, field); [2] bit of the spare bits per half; [3] 1 << word."""
    field = torch.tensor([[[16 * h + b for b in TRIPLET_BITS] for _ in range(3)] for h in range(2)],
                         dtype=torch.int64, device=device)
    spare = torch.tensor([TRIPLET_SPARE_BIT, 16 + TRIPLET_SPARE_BIT], dtype=torch.int64, device=device)
    return field, spare, torch.arange(3, dtype=torch.int64, device=device)


def _pack_triplets(codes: torch.Tensor) -> torch.Tensor:
    """int3 codes [..., D] int64 -> words [..., 3G] int32."""
    head_dim = codes.shape[-1]
    g = groups(head_dim)
    field_bits, spare_bits, word_index = _triplet_tables(codes.device)
    x = torch.nn.functional.pad(codes, (0, g * GROUP - head_dim)).unflatten(-1, (g, 2, 16))   # [..., G, h, m]
    whole = x[..., :15].unflatten(-1, (3, 5))                                  # [..., G, h, word, field]
    words = (whole << field_bits).sum(dim=(-3, -1))                             # [..., G, word]: sum over h, field
    spare = x[..., 15]                                                          # [..., G, h]
    spare_words = ((spare.unsqueeze(-1) >> word_index) & 1) << spare_bits.unsqueeze(-1)   # [..., G, h, word]
    words = words + spare_words.sum(dim=-2)
    return _to_int32(torch.cat([words[..., :2].flatten(-2), words[..., 2]], dim=-1))


@functools.lru_cache(maxsize=8)
def _half_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[65536, 6]: the five whole fields of every 16-bit half, then its spare bit."""
    half = torch.arange(65536, dtype=torch.int32).unsqueeze(1)
    bits = torch.tensor(TRIPLET_BITS + (TRIPLET_SPARE_BIT,), dtype=torch.int32)
    masks = torch.tensor((7,) * 5 + (1,), dtype=torch.int32)
    return ((half >> bits) & masks).to(device=device, dtype=dtype)


def _unpack_triplets(words: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """int3 words [..., 3G] int32 -> codes [..., head_dim] as `dtype`, through a table of 16-bit halves."""
    g = groups(head_dim)
    work = dtype if dtype.is_floating_point else torch.int32
    w = torch.cat([words[..., :2 * g].unflatten(-1, (g, 2)), words[..., 2 * g:].unsqueeze(-1)], dim=-1)
    halves = (w.unsqueeze(-1) >> torch.tensor([0, 16], dtype=torch.int32, device=words.device)) & 0xFFFF
    fields = _half_table(work, words.device)[halves.transpose(-1, -2)]           # [..., G, h, word, 6]
    whole = fields[..., :5].flatten(-2)                                           # [..., G, h, 15]
    spare = fields[..., 0, 5] + 2 * fields[..., 1, 5] + 4 * fields[..., 2, 5]      # [..., G, h]
    codes = torch.cat([whole, spare.unsqueeze(-1)], dim=-1)                       # [..., G, h, 16]
    return codes.flatten(-3)[..., :head_dim].to(dtype)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] integers in [0, 2**bits) -> packed words [..., words_per_row(bits, D)] int32."""
    _check_bits(bits)
    codes = codes.to(torch.int64)
    if bits == 3:
        return _pack_triplets(codes)
    width = PLANES[bits][0]
    head_dim = codes.shape[-1]
    per_word = 32 // width
    count = plane_words(width, head_dim)
    field = torch.nn.functional.pad(codes, (0, count * per_word - head_dim)).unflatten(-1, (count, per_word))
    return _to_int32((field << field_shifts(width, codes.device)).sum(-1))


@functools.lru_cache(maxsize=32)
def _byte_table(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8 // width]: the fields of every byte value, lowest bits first."""
    per_byte = 8 // width
    values = torch.arange(256, dtype=torch.int32).unsqueeze(1)                   # [256, 1]
    shifts = torch.arange(per_byte, dtype=torch.int32) * width
    return ((values >> shifts) & ((1 << width) - 1)).to(device=device, dtype=dtype)


def unpack_codes(words: torch.Tensor, bits: int, head_dim: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """packed words [..., W] int32 -> codes [..., head_dim] (the exact inverse of pack_codes), as `dtype`.

    int4 / int2 read the fields in bit order one byte at a time through a 256-entry table (little-endian words),
    the fast way on a CPU; int3 through a table of 16-bit halves (five whole fields and one spare bit each).
    """
    _check_bits(bits)
    if words.shape[-1] != words_per_row(bits, head_dim):
        raise ValueError(f"{bits}-bit rows of {head_dim} codes take {words_per_row(bits, head_dim)} words, "
                         f"got {words.shape[-1]}")
    if bits == 3:
        return _unpack_triplets(words, head_dim, dtype)
    width = PLANES[bits][0]
    if sys.byteorder == "little":
        table = _byte_table(width, dtype if dtype.is_floating_point else torch.int32, words.device)
        field = table[words.contiguous().view(torch.uint8).int()].flatten(-2)
    else:
        field = ((words.unsqueeze(-1).long() >> field_shifts(width, words.device)) & ((1 << width) - 1)).flatten(-2)
    return field[..., :head_dim].to(dtype)

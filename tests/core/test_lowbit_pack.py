"""Bit packing: exact round trips, the documented bit positions, dense widths."""

import pytest
import torch

from moekv.core.lowbit_pack import pack_codes, plane_offsets, unpack_codes, words_per_row


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [1, 5, 16, 31, 33, 64, 100, 128])
def test_round_trip_is_bit_exact(bits, head_dim):
    generator = torch.Generator().manual_seed(bits * 1000 + head_dim)
    codes = torch.randint(0, 2**bits, (3, 2, 7, head_dim), generator=generator).to(torch.uint8)
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32
    assert words.shape == (3, 2, 7, words_per_row(bits, head_dim))
    assert torch.equal(unpack_codes(words, bits, head_dim), codes)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_extreme_codes_use_the_sign_bit(bits):
    codes = torch.full((4, 64), 2**bits - 1, dtype=torch.uint8)
    words = pack_codes(codes, bits)
    assert (words == -1).all()                      # every bit set, including bit 31
    assert torch.equal(unpack_codes(words, bits, 64), codes)
    assert (pack_codes(torch.zeros_like(codes), bits) == 0).all()


@pytest.mark.parametrize("bits, expected", [(4, 8), (3, 6), (2, 4)])
def test_dense_width_at_head_dim_64(bits, expected):
    # 3-bit codes take exactly 3 bits: 64 codes -> 4 words of 2-bit fields + 2 words of 1-bit fields
    assert words_per_row(bits, 64) == expected
    assert words_per_row(bits, 64) * 32 == bits * 64


def test_documented_bit_positions():
    # int3: plane 0 (low two bits, 16 fields per word), then plane 1 (high bit, 32 per word, the word's two
    # halves interleaved: field i < 16 at bit 2i, field 16 + i at bit 2i + 1)
    codes = torch.zeros(64, dtype=torch.uint8)
    codes[17] = 0b110                               # low bits 0b10 -> word 1, bit 2; high bit -> word 4, bit 3
    codes[37] = 0b100                               # high bit only: field 5 of the second 1-bit word -> bit 10
    words = pack_codes(codes, 3)
    expected = torch.zeros(6, dtype=torch.int64)
    expected[1] = 0b10 << 2
    expected[4] = 1 << 3
    expected[5] = 1 << 10
    assert torch.equal(words.long(), expected)
    assert torch.equal(unpack_codes(words, 3, 64), codes)
    assert plane_offsets(3, 64) == [(0, 4, 2), (4, 2, 1)]
    # int4: field j in word j // 8 at bit (j % 8) * 4
    codes = torch.zeros(64, dtype=torch.uint8)
    codes[13] = 0xB
    words = pack_codes(codes, 4)
    assert words[1].item() == 0xB << 20 and int(words.count_nonzero()) == 1


def test_wrong_word_count_is_refused():
    with pytest.raises(ValueError, match="words"):
        unpack_codes(torch.zeros(3, 5, dtype=torch.int32), 3, 64)
    with pytest.raises(ValueError, match="bits"):
        pack_codes(torch.zeros(3, dtype=torch.uint8), 5)

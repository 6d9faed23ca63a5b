"""Bit packing: exact round trips, the documented bit positions, dense widths."""

import pytest
import torch

from moekv.core.lowbit_pack import code_bits, pack_codes, unpack_codes, words_per_row


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
    # 3-bit codes take exactly 3 bits: 64 codes -> two triplet groups of three words
    assert words_per_row(bits, 64) == expected
    assert words_per_row(bits, 64) * 32 == bits * 64


def test_documented_bit_positions():
    # int3 triplets, D = 64 (G = 2): group j owns words 2j, 2j + 1 and 4 + j; local channel 16h + m (m < 15) in
    # word m // 5 at bit 16h + (0, 3, 6, 10, 13)[m % 5]; m = 15: bit i of its code at bit 16h + 9 of word i
    codes = torch.zeros(64, dtype=torch.uint8)
    codes[17] = 0b110          # group 0, h 1, m 1: word 0, bit 16 + 3
    codes[2] = 0b111           # group 0, h 0, m 2: word 0, bit 6
    codes[12] = 0b010          # group 0, h 0, m 12: word 2 of the group = row word 4, bit 6
    codes[31] = 0b110          # group 0, h 1, m 15: code bits 1 and 2 at bit 25 of words 1 and 4
    codes[40] = 0b011          # group 1, h 0, m 8: word 1 of group 1 = row word 3, bit 10
    codes[45] = 0b101          # group 1, h 0, m 13: word 2 of group 1 = row word 5, bit 10
    words = pack_codes(codes, 3)
    expected = torch.zeros(6, dtype=torch.int64)
    expected[0] = (0b110 << 19) | (0b111 << 6)
    expected[1] = 1 << 25
    expected[3] = 0b011 << 10
    expected[4] = (1 << 25) | (0b010 << 6)
    expected[5] = 0b101 << 10
    assert code_bits(3, 64, 17) == [(0, 19, 0, 3)]
    assert code_bits(3, 64, 31) == [(0, 25, 0, 1), (1, 25, 1, 1), (4, 25, 2, 1)]
    assert code_bits(3, 64, 12) == [(4, 6, 0, 3)]
    assert torch.equal(words.long() & 0xFFFFFFFF, expected & 0xFFFFFFFF)
    assert torch.equal(unpack_codes(words, 3, 64), codes)
    # int4: field j in word j // 8 at bit (j % 8) * 4
    codes = torch.zeros(64, dtype=torch.uint8)
    codes[13] = 0xB
    words = pack_codes(codes, 4)
    assert words[1].item() == 0xB << 20 and int(words.count_nonzero()) == 1


@pytest.mark.parametrize("head_dim", [1, 15, 16, 31, 32, 33, 64, 100])
def test_every_channel_has_its_documented_bits(head_dim):
    for channel in range(head_dim):
        codes = torch.zeros(head_dim, dtype=torch.uint8)
        codes[channel] = 0b101
        expected = torch.zeros(words_per_row(3, head_dim), dtype=torch.int64)
        for word, bit, code_bit, width in code_bits(3, head_dim, channel):
            expected[word] |= ((0b101 >> code_bit) & ((1 << width) - 1)) << bit
        assert torch.equal(pack_codes(codes, 3).long() & 0xFFFFFFFF, expected), channel


def test_wrong_word_count_is_refused():
    with pytest.raises(ValueError, match="words"):
        unpack_codes(torch.zeros(3, 5, dtype=torch.int32), 3, 64)
    with pytest.raises(ValueError, match="bits"):
        pack_codes(torch.zeros(3, dtype=torch.uint8), 5)

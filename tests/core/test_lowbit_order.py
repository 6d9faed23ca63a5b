"""int3 / int2 fragment order (core.lowbit_order): a bijection per chunk, its inverse, and what the CUDA kernel's
lanes read from it, spelled from the kernel's side (lane (g, c) takes three (int3) or two (int2) 16-byte words per
chunk)."""

import pytest
import torch

from moekv.core import lowbit_order
from moekv.core.lowbit_layout import QuantSpec


def tau(r: int) -> int:
    return r ^ ((r >> 2) & 1)


def random_words(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


def half(word: int, h: int) -> int:
    return (word >> (16 * h)) & 0xFFFF


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("kind", lowbit_order.KINDS)
def test_round_trip_and_bijection(bits, kind):
    n = lowbit_order.WORDS[bits]
    assert sorted(lowbit_order.destinations(bits, kind).tolist()) == list(range(32 * n * 2))
    words = random_words((2, 3, 128, n))
    ordered = lowbit_order.to_fragment_order(words, kind)
    # int4 keys: the fragment order is the row order (a lane's 4 row words are one 16-byte word already)
    assert torch.equal(ordered, words) == (bits == 4 and kind == "key")
    assert torch.equal(lowbit_order.from_fragment_order(ordered, kind), words)


def key_source(bits: int, g: int, c: int, s: int) -> tuple[int, int]:
    """(row of the chunk, row word) of key lane (g, c)'s lane word s, as the kernel reads it."""
    if bits == 4:                                  # int4's tile token order is the identity
        return [g, g + 8, 16 + g, 24 + g][s // 4], 4 * c + s % 4
    rows = [tau(g), tau(g) + 8, 16 + tau(g), 24 + tau(g)]
    if bits == 3:
        return rows[s // 3], [2 * c, 2 * c + 1, 8 + c][s % 3]
    return rows[s // 2], 2 * c + s % 2


def value_source(bits: int, g: int, c: int, s: int) -> tuple[int, int, int, int]:
    """(token t0, token t1, row word, half) of value lane (g, c)'s lane word s: low 16 bits from t0, high from t1."""
    if bits == 4:                                  # identity token order; lane word 8m + 4 pair + 2i + h
        m, pair, i, h = s // 8, (s // 4) % 2, (s // 2) % 2, s % 2
        return 16 * m + 2 * c + 8 * pair, 16 * m + 2 * c + 1 + 8 * pair, 2 * g + i, h
    per_m = 6 if bits == 3 else 4
    m, pair, i = s // per_m, (s // (per_m // 2)) % 2, s % (per_m // 2)
    t0, t1 = 16 * m + tau(2 * c) + 8 * pair, 16 * m + tau(2 * c + 1) + 8 * pair
    if bits == 3:
        group = g // 2
        return t0, t1, [2 * group, 2 * group + 1, 8 + group][i], g % 2
    return t0, t1, g, i


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_key_lanes_read_their_rows(bits):
    n = lowbit_order.WORDS[bits]
    rows = random_words((32, n), seed=bits)
    chunk = lowbit_order.to_fragment_order(rows, "key").flatten().tolist()
    rows = rows.tolist()
    for lane in range(32):
        for s in range(n):
            row, word = key_source(bits, lane // 4, lane % 4, s)
            assert chunk[(s // 4) * 128 + 4 * lane + s % 4] == rows[row][word], (lane, s)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_value_lanes_read_token_pairs(bits):
    n = lowbit_order.WORDS[bits]
    rows = random_words((32, n), seed=10 + bits)
    chunk = lowbit_order.to_fragment_order(rows, "value").flatten().tolist()
    rows = rows.tolist()
    for lane in range(32):
        for s in range(n):
            t0, t1, word, h = value_source(bits, lane // 4, lane % 4, s)
            got = chunk[(s // 4) * 128 + 4 * lane + s % 4]
            assert half(got, 0) == half(rows[t0][word], h) and half(got, 1) == half(rows[t1][word], h), (lane, s)


@pytest.mark.parametrize("bits,head_dim,page_size,order", [
    (3, 128, 128, "key"), (3, 128, 32, "key"), (3, 128, 16, None), (3, 64, 128, None), (4, 128, 128, "key"), (4, 64, 128, None),
    (2, 128, 128, "key"), (2, 128, 64, "key"), (2, 96, 128, None)])
def test_spec_code_order(bits, head_dim, page_size, order):
    spec = QuantSpec(bits=bits, axis="channel", head_dim=head_dim, page_size=page_size)
    assert spec.code_order == order
    value = QuantSpec(bits=bits, axis="token", head_dim=head_dim, page_size=page_size)
    assert value.code_order == (None if order is None else "value")


def test_rejects_other_shapes():
    with pytest.raises(ValueError, match="chunks of 32"):
        lowbit_order.to_fragment_order(torch.zeros(16, 12, dtype=torch.int32), "key")
    with pytest.raises(ValueError, match="chunks of 32"):
        lowbit_order.to_fragment_order(torch.zeros(32, 20, dtype=torch.int32), "key")   # no width has 20 words
    with pytest.raises(ValueError, match="kind"):
        lowbit_order.to_fragment_order(torch.zeros(32, 12, dtype=torch.int32), "keys")

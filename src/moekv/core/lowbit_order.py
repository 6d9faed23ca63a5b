"""int3 pages in fragment order (docs/kv-format.md, section 2.1): the packed words of a page-head permuted within
each 32-token chunk so that the CUDA decode kernel's lane reads its codes of a chunk as three 16-byte words.

Applies to int3 pages of head_dim 128 whose page size is a multiple of 32 (`applies`); other pages keep the row
order of core.lowbit_pack. A chunk of a page-head holds 32 rows x 12 words = 768 16-bit halves, stored as
[3 pieces j][32 lanes][4 words], lane = 4g + c (g = lane // 4, c = lane % 4): lane word s (0..11) of piece s // 4
sits at word (s // 4) * 128 + 4 * lane + s % 4 of the chunk. tau(r) = r ^ ((r >> 2) & 1) is the kernel's token
order inside a 16-token MMA tile (an involution). Row words (core.lowbit_pack): group G's triplet word i is row
word 2G + i (i < 2) or 8 + G (i = 2).

- "key" order (arrays quantized along the channel axis): lane (g, c) holds the triplets of group c of the four
  rows r0 = tau(g), r1 = r0 + 8, r2 = 16 + r0, r3 = 24 + r0, as lane words s = 3 * row + i (whole words move).
- "value" order (arrays quantized along the token axis): lane (g, c) holds half g % 2 of group g // 2's triplet
  words of the token pairs (t0, t1) = (16m + tau(2c), 16m + tau(2c + 1)) and (t0 + 8, t1 + 8) for m = 0, 1:
  lane word s = 6m + 3 * pair + i has token t0's half in its low 16 bits and token t1's in its high 16 bits.
"""

from __future__ import annotations

import functools

import torch

CHUNK = 32              # tokens per chunk
ORDER_HEAD_DIM = 128    # the only head_dim in fragment order (four triplet groups: the kernel's four lanes c)
WORDS = 12              # int3 words of a 128-channel row
HALVES = CHUNK * WORDS * 2
KINDS = ("key", "value")


def applies(bits: int, page_size: int, head_dim: int) -> bool:
    """Whether pages of this shape are stored in fragment order."""
    return bits == 3 and head_dim == ORDER_HEAD_DIM and page_size % CHUNK == 0


def kind_of(axis: str) -> str:
    """The order of an array quantized along `axis`: "channel" -> "key", "token" -> "value"."""
    return "key" if axis == "channel" else "value"


def _tau(r: int) -> int:
    return r ^ ((r >> 2) & 1)


def _position(lane: int, s: int) -> int:
    """Word of the chunk holding lane word s of `lane`."""
    return (s // 4) * 128 + 4 * lane + s % 4


def _triplet(word: int) -> tuple[int, int]:
    """Row word -> (group, triplet word i)."""
    return (word // 2, word % 2) if word < 8 else (word - 8, 2)


def destination(kind: str, token: int, word: int, half: int) -> int:
    """Half index in the chunk ((word of the chunk) * 2 + half) of half `half` of row word `word` of token
    `token` (0..31) in row order."""
    group, i = _triplet(word)
    m, u = token // 16, token % 16
    if kind == "key":
        lane = 4 * _tau(u % 8) + group
        return 2 * _position(lane, 3 * (2 * m + u // 8) + i) + half
    q = _tau(u % 8)                             # = 2c + e: the pair's column c, e = 1 for the pair's second token
    lane = 4 * (2 * group + half) + q // 2
    return 2 * _position(lane, 6 * m + 3 * (u // 8) + i) + q % 2


@functools.lru_cache(maxsize=4)
def _table(kind: str) -> tuple[int, ...]:
    if kind not in KINDS:
        raise ValueError(f"fragment order kind must be one of {KINDS}, got {kind!r}")
    return tuple(destination(kind, t, w, h) for t in range(CHUNK) for w in range(WORDS) for h in range(2))


def destinations(kind: str, device=None) -> torch.Tensor:
    """[768] int64: the chunk half that row-order half (t * 12 + w) * 2 + h goes to."""
    return torch.tensor(_table(kind), dtype=torch.int64, device=device)


def _halves(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., P, 12] -> [..., P // 32, 768] int64 halves (low half first), independent of byte order."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    h = torch.stack([w & 0xFFFF, w >> 16], dim=-1)                              # [..., P, 12, 2]
    return h.reshape(*words.shape[:-2], words.shape[-2] // CHUNK, HALVES)


def _words(halves: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    h = halves.reshape(*shape, 2)
    w = h[..., 0] | (h[..., 1] << 16)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _check(words: torch.Tensor) -> None:
    if words.shape[-1] != WORDS or words.shape[-2] % CHUNK:
        raise ValueError(f"fragment order takes int3 rows of {WORDS} words in chunks of {CHUNK} tokens, "
                         f"got shape {tuple(words.shape)}")


def to_fragment_order(words: torch.Tensor, kind: str) -> torch.Tensor:
    """Row-order int3 words [..., P, 12] of page-heads -> the same words in fragment order (same shape)."""
    _check(words)
    dest = destinations(kind, words.device)
    halves = _halves(words)
    out = torch.empty_like(halves)
    out[..., dest] = halves
    return _words(out, words.shape)


def from_fragment_order(words: torch.Tensor, kind: str) -> torch.Tensor:
    """The inverse of to_fragment_order."""
    _check(words)
    return _words(_halves(words)[..., destinations(kind, words.device)], words.shape)

"""Low-bit pages in fragment order (docs/kv-format.md, section 2.1): the packed words of a page-head permuted within
each 32-token chunk so that the CUDA decode kernel's lane reads its codes of a chunk as 16-byte words.

Applies to int4, int3 and int2 pages of head_dim 128 whose page size is a multiple of 32 (`applies`); other pages
keep the row order of core.lowbit_pack. A chunk of a page-head holds 32 rows x n words (n = 16 int4, 12 int3, 8
int2), stored as
[n / 4 pieces j][32 lanes][4 words], lane = 4g + c (g = lane // 4, c = lane % 4): lane word s (0..n-1) sits at
word (s // 4) * 128 + 4 * lane + s % 4 of the chunk. tau(r) = r ^ ((r >> 2) & 1) is the kernel's token order
inside a 16-token MMA tile (an involution). The lane's rows are r0 = tau(g), r1 = r0 + 8, r2 = 16 + r0,
r3 = 24 + r0; its token pairs (t0, t1) = (16m + tau(2c) + 8 pair, 16m + tau(2c + 1) + 8 pair), m, pair = 0, 1.

int3 (row words, core.lowbit_pack: group G's triplet word i is row word 2G + i for i < 2, 8 + G for i = 2):
- "key" order (arrays quantized along the channel axis): lane word s = 3r + i is triplet word i of group c of
  row r (whole words move).
- "value" order (arrays quantized along the token axis): lane word s = 6m + 3 pair + i holds half g % 2 of
  triplet word i of group g // 2 of token t0 in its low 16 bits and of token t1 in its high 16 bits.
int2 (one plane, 16 codes a word: the kernel's lane c owns row words 2c, 2c + 1, lane g row word g):
- "key": lane word s = 2r + i is row word 2c + i of row r.
- "value": lane word s = 4m + 2 pair + i holds half i of row word g of token t0 (low 16 bits) and of t1 (high).
int4 (one plane, 8 codes a word; its tile token order is the identity, tau(r) = r: rows g, g + 8, 16 + g, 24 + g,
pairs (16m + 2c + 8 pair, 16m + 2c + 1 + 8 pair); lane c owns row words 4c..4c + 3, lane g row words 2g, 2g + 1):
- "key": lane word s = 4r + i is row word 4c + i of row r.
- "value": lane word s = 8m + 4 pair + 2i + h holds half h of row word 2g + i of t0 (low 16 bits) and of t1 (high).
"""

from __future__ import annotations

import functools

import torch

from moekv.core.lowbit_pack import pack_codes, unpack_codes

CHUNK = 32              # tokens per chunk
ORDER_HEAD_DIM = 128    # the only head_dim in fragment order (the kernel's four lanes c of a row)
WORDS = {4: 16, 3: 12, 2: 8}   # words of a 128-channel row, by code width
KINDS = ("key", "value")


def applies(bits: int, page_size: int, head_dim: int) -> bool:
    """Whether pages of this shape are stored in fragment order."""
    return bits in WORDS and head_dim == ORDER_HEAD_DIM and page_size % CHUNK == 0


def kind_of(axis: str) -> str:
    """The order of an array quantized along `axis`: "channel" -> "key", "token" -> "value"."""
    return "key" if axis == "channel" else "value"


def _tau(r: int) -> int:
    return r ^ ((r >> 2) & 1)


def _position(lane: int, s: int) -> int:
    """Word of the chunk holding lane word s of `lane`."""
    return (s // 4) * 128 + 4 * lane + s % 4


def _triplet(word: int) -> tuple[int, int]:
    """int3 row word -> (group, triplet word i)."""
    return (word // 2, word % 2) if word < 8 else (word - 8, 2)


def destination(bits: int, kind: str, token: int, word: int, half: int) -> int:
    """Half index in the chunk ((word of the chunk) * 2 + half) of half `half` of row word `word` of token
    `token` (0..31) in row order."""
    m, u = token // 16, token % 16
    row = 2 * m + u // 8                        # key order: the lane's row r
    if bits == 4:                               # int4's token order inside a tile is the identity
        if kind == "key":
            return 2 * _position(4 * (u % 8) + word // 4, 4 * row + word % 4) + half
        return 2 * _position(4 * (word // 2) + (u % 8) // 2, 8 * m + 4 * (u // 8) + 2 * (word % 2) + half) + u % 2
    q = _tau(u % 8)                             # value order: 2c + e, the pair's column c, e = 1 for its token t1
    if bits == 2:
        if kind == "key":
            return 2 * _position(4 * _tau(u % 8) + word // 2, 2 * row + word % 2) + half
        return 2 * _position(4 * word + q // 2, 4 * m + 2 * (u // 8) + half) + q % 2
    group, i = _triplet(word)
    if kind == "key":
        return 2 * _position(4 * _tau(u % 8) + group, 3 * row + i) + half
    return 2 * _position(4 * (2 * group + half) + q // 2, 6 * m + 3 * (u // 8) + i) + q % 2


@functools.lru_cache(maxsize=8)
def _table(bits: int, kind: str) -> tuple[int, ...]:
    if kind not in KINDS:
        raise ValueError(f"fragment order kind must be one of {KINDS}, got {kind!r}")
    return tuple(destination(bits, kind, t, w, h) for t in range(CHUNK) for w in range(WORDS[bits]) for h in range(2))


def _bits(words: torch.Tensor) -> int:
    """The code width of rows of this many words (16: int4, 12: int3, 8: int2)."""
    for bits, count in WORDS.items():
        if words.shape[-1] == count and words.dim() >= 2 and words.shape[-2] % CHUNK == 0:
            return bits
    raise ValueError(f"fragment order takes rows of {sorted(WORDS.values())} words (int2 / int3 / int4, head_dim "
                     f"{ORDER_HEAD_DIM}) in chunks of {CHUNK} tokens, got shape {tuple(words.shape)}")


def destinations(bits: int, kind: str, device=None) -> torch.Tensor:
    """[32 * n * 2] int64: the chunk half that row-order half (t * n + w) * 2 + h goes to (n = WORDS[bits])."""
    return torch.tensor(_table(bits, kind), dtype=torch.int64, device=device)


def _halves(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., P, n] -> [..., P // 32, 32 * n * 2] int64 halves (low half first), independent of byte
    order."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    h = torch.stack([w & 0xFFFF, w >> 16], dim=-1)                              # [..., P, n, 2]
    return h.reshape(*words.shape[:-2], words.shape[-2] // CHUNK, CHUNK * words.shape[-1] * 2)


def _words(halves: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    h = halves.reshape(*shape, 2)
    w = h[..., 0] | (h[..., 1] << 16)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def to_fragment_order(words: torch.Tensor, kind: str) -> torch.Tensor:
    """Row-order int3 / int2 words [..., P, 12 or 8] of page-heads -> the same words in fragment order."""
    dest = destinations(_bits(words), kind, words.device)
    halves = _halves(words)
    out = torch.empty_like(halves)
    out[..., dest] = halves
    return _words(out, words.shape)


def from_fragment_order(words: torch.Tensor, kind: str) -> torch.Tensor:
    """The inverse of to_fragment_order."""
    return _words(_halves(words)[..., destinations(_bits(words), kind, words.device)], words.shape)


def pack_page_codes(codes: torch.Tensor, spec) -> torch.Tensor:
    """Codes [..., P, D] of page-heads -> their stored words [..., P, W] (rows packed, then in the spec's
    code_order; spec: a core.lowbit_layout.QuantSpec)."""
    words = pack_codes(codes, spec.bits)
    return words if spec.code_order is None else to_fragment_order(words, spec.code_order)


def unpack_page_codes(words: torch.Tensor, spec, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """The inverse of pack_page_codes: stored words [..., P, W] -> codes [..., P, D] as `dtype`."""
    if spec.code_order is not None:
        words = from_fragment_order(words, spec.code_order)
    return unpack_codes(words, spec.bits, spec.head_dim, dtype)

"""Addresses of int3 codes stored in fragment order (core.lowbit_order, docs/kv-format.md section 2.1), for the
Triton quantizer's page store and the general attention kernel's code loads. The same maps as
core.lowbit_order.destination, per element.

A kernel computes its ORDER_* at compile time as
    (HEAD_DIM == 128) * (PAGE_SIZE % 32 == 0) * (2 - AXIS_CHANNEL)       (every code width: int4, int3, int2)
(core.lowbit_order.applies and kind_of; the quantizer tests compare the stored words with the reference's).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekv.core import lowbit_order

# (globals a kernel reads must be tl.constexpr instances, not annotated ints: triton 3.6 refuses the latter)
ORDER_ROWS = tl.constexpr(0)      # rows in token order (core.lowbit_pack)
ORDER_KEY = tl.constexpr(1)       # fragment order, "key" (arrays quantized along the channel axis)
ORDER_VALUE = tl.constexpr(2)     # fragment order, "value" (along the token axis)
_CHUNK_WORDS3 = tl.constexpr(lowbit_order.CHUNK * lowbit_order.WORDS[3])   # int3 words of a chunk
_CHUNK_WORDS2 = tl.constexpr(lowbit_order.CHUNK * lowbit_order.WORDS[2])   # int2
_CHUNK_WORDS4 = tl.constexpr(lowbit_order.CHUNK * lowbit_order.WORDS[4])   # int4


@triton.jit
def _tau(r):
    return r ^ ((r >> 2) & 1)


@triton.jit
def _chunk_word(lane, s):
    return (s // 4) * 128 + 4 * lane + s % 4


@triton.jit
def key_word(token, group, i):
    """Word of the page-head (key order) holding triplet word i of group `group` of token `token`."""
    t = token % 32
    u = t % 16
    lane = 4 * _tau(u % 8) + group
    return (token // 32) * _CHUNK_WORDS3 + _chunk_word(lane, 3 * (2 * (t // 16) + u // 8) + i)


@triton.jit
def value_half(token, group, i, half):
    """16-bit half of the page-head (value order) holding half `half` of triplet word i of group `group` of token
    `token`."""
    t = token % 32
    u = t % 16
    q = _tau(u % 8)                      # 2c + e: the pair's column c; e = 1 for the pair's second token
    lane = 4 * (2 * group + half) + q // 2
    return 2 * ((token // 32) * _CHUNK_WORDS3 + _chunk_word(lane, 6 * (t // 16) + 3 * (u // 8) + i)) + q % 2


@triton.jit
def key_word2(token, word):
    """int2, key order: word of the page-head holding row word `word` of token `token`."""
    t = token % 32
    u = t % 16
    lane = 4 * _tau(u % 8) + word // 2
    return (token // 32) * _CHUNK_WORDS2 + _chunk_word(lane, 2 * (2 * (t // 16) + u // 8) + word % 2)


@triton.jit
def value_half2(token, word, half):
    """int2, value order: 16-bit half of the page-head holding half `half` of row word `word` of token `token`."""
    t = token % 32
    u = t % 16
    q = _tau(u % 8)
    lane = 4 * word + q // 2
    return 2 * ((token // 32) * _CHUNK_WORDS2 + _chunk_word(lane, 4 * (t // 16) + 2 * (u // 8) + half)) + q % 2


@triton.jit
def key_word4(token, word):
    """int4, key order (tile token order: the identity): word of the page-head holding row word `word` of token
    `token`."""
    t = token % 32
    u = t % 16
    lane = 4 * (u % 8) + word // 4
    return (token // 32) * _CHUNK_WORDS4 + _chunk_word(lane, 4 * (2 * (t // 16) + u // 8) + word % 4)


@triton.jit
def value_half4(token, word, half):
    """int4, value order: 16-bit half of the page-head holding half `half` of row word `word` of token `token`."""
    t = token % 32
    u = t % 16
    lane = 4 * (word // 2) + (u % 8) // 2
    s = 8 * (t // 16) + 4 * (u // 8) + 2 * (word % 2) + half
    return 2 * ((token // 32) * _CHUNK_WORDS4 + _chunk_word(lane, s)) + u % 2


@triton.jit
def _plane_key_word(tokens, words, BITS: tl.constexpr):
    if BITS == 4:
        return key_word4(tokens, words)
    else:
        return key_word2(tokens, words)


@triton.jit
def _plane_value_half(tokens, words, half, BITS: tl.constexpr):
    if BITS == 4:
        return value_half4(tokens, words, half)
    else:
        return value_half2(tokens, words, half)


@triton.jit
def store_plane_words(page_ptr, words, tokens, offs_w, BITS: tl.constexpr, ORDER: tl.constexpr):
    """int2 / int4: store row words [P, W] int32 (tokens [P, 1], offs_w [1, W]) of a page-head at int32 `page_ptr`
    in fragment order ORDER_KEY or ORDER_VALUE."""
    if ORDER == ORDER_KEY:
        tl.store(page_ptr + _plane_key_word(tokens, offs_w, BITS), words)
    else:
        halves = page_ptr.to(tl.pointer_type(tl.int16))
        tl.store(halves + _plane_value_half(tokens, offs_w, 0, BITS), (words & 0xFFFF).to(tl.int16))
        tl.store(halves + _plane_value_half(tokens, offs_w, 1, BITS), ((words >> 16) & 0xFFFF).to(tl.int16))


@triton.jit
def load_plane_word(page_ptr, tokens, offs_d, mask, BITS: tl.constexpr, ORDER: tl.constexpr):
    """int2 / int4: the row word holding column offs_d (32 / BITS a word) of token `tokens` (broadcast shapes) from
    a page-head in fragment order; ORDER_VALUE reads only the half holding the column, in its place, the other
    half 0."""
    per_word: tl.constexpr = 32 // BITS
    word = offs_d // per_word
    if ORDER == ORDER_KEY:
        return tl.load(page_ptr + _plane_key_word(tokens, word, BITS), mask=mask, other=0)
    else:
        half = (offs_d % per_word) // (per_word // 2)
        halves = page_ptr.to(tl.pointer_type(tl.int16))
        h = tl.load(halves + _plane_value_half(tokens, word, half, BITS), mask=mask, other=0).to(tl.int32) & 0xFFFF
        return h << (16 * half)


@triton.jit
def store_triplet_word(page_ptr, word, tokens, groups, i, ORDER: tl.constexpr):
    """Store triplet word i [P, G] int32 of every token / group of a page-head at int32 `page_ptr` (fragment
    order ORDER_KEY or ORDER_VALUE); tokens [P, 1], groups [1, G]."""
    if ORDER == ORDER_KEY:
        tl.store(page_ptr + key_word(tokens, groups, i), word)
    else:
        halves = page_ptr.to(tl.pointer_type(tl.int16))
        tl.store(halves + value_half(tokens, groups, i, 0), (word & 0xFFFF).to(tl.int16))
        tl.store(halves + value_half(tokens, groups, i, 1), ((word >> 16) & 0xFFFF).to(tl.int16))


@triton.jit
def load_triplet_word(page_ptr, tokens, groups, halves_of, i, mask, ORDER: tl.constexpr):
    """Triplet word i of group `groups` of token `tokens` (broadcast shapes) from a page-head at int32 `page_ptr`.
    ORDER_VALUE reads only half `halves_of` (0 / 1, the half a column needs), in its place, the other half 0."""
    if ORDER == ORDER_KEY:
        return tl.load(page_ptr + key_word(tokens, groups, i), mask=mask, other=0)
    else:
        halves = page_ptr.to(tl.pointer_type(tl.int16))
        h = tl.load(halves + value_half(tokens, groups, i, halves_of), mask=mask, other=0).to(tl.int32) & 0xFFFF
        return h << (16 * halves_of)

"""Prefix caching: full KV pages found again by the tokens that produced them.

A full page is named by a digest of every token up to its end: `digest_i = sha256(digest_{i-1} ||
tokens of page i)`, starting from a salt digest of whatever else changes the page's keys and values
(model, dtypes, kv_cache_dtype, page size, the low-bit format's knobs; the engine builds it). The index
maps a digest to one cached page. A hit is never trusted to the hash: the cached page's own tokens must
equal the request's tokens of that page, and its parent must be the entry matched for the previous page
(entries carry serial numbers that are never reused), so by induction a chain of hits holds exactly the
request's tokens from position 0. A colliding digest is a miss, never a wrong page.

Only full pages whose tokens are all computed are registered (`register`, from the scheduler once the
step that computed them has committed); partly filled tail pages never are. A hit stops one token short
of the request's end (`match`): the last token is always recomputed for its logits, so a hit page is
never written again. Reference counts and the LRU of freed cached pages belong to the block pool
(kvcache/block_pool.py); this module only names pages. KVCacheManager ties the two together.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import struct
from dataclasses import dataclass
from typing import Callable

TokenSlice = Callable[[int, int], list[int]]    # (start, end) -> the sequence's token ids [start, end)


@dataclass(frozen=True, slots=True)
class CachedPage:
    """One registered page: which pool page holds it and what it holds."""

    page: int           # block-pool page id
    digest: bytes       # sha256 over the salt and every token up to the page's end
    parent: int         # serial of the entry for the previous page; 0 for a sequence's first page
    tokens: bytes       # this page's own token ids (int64), compared on every hit
    serial: int         # unique for the cache's lifetime (> 0)


def chain_digest(previous: bytes, tokens: bytes) -> bytes:
    """The digest of a page from the previous page's digest (or the salt) and its own tokens."""
    return hashlib.sha256(previous + tokens).digest()


def page_tokens(token_ids: TokenSlice, index: int, page_size: int) -> bytes:
    """The token ids of a sequence's page `index`, as bytes (int64, little-endian)."""
    return _page_struct(page_size).pack(*token_ids(index * page_size, (index + 1) * page_size))


@functools.lru_cache(maxsize=8)
def _page_struct(page_size: int) -> struct.Struct:
    return struct.Struct(f"<{page_size}q")


class PrefixCache:
    """The digest index of registered pages, and per sequence the digests and entries it stands on."""

    def __init__(self, page_size: int, salt: bytes = b""):
        self.page_size = page_size
        self.salt = hashlib.sha256(b"moekv-prefix-cache\0" + salt).digest()
        self._index: dict[bytes, CachedPage] = {}       # digest -> entry
        self._of_page: dict[int, CachedPage] = {}       # pool page -> its entry
        self._by_serial: dict[int, CachedPage] = {}     # live entries
        self._serials = itertools.count(1)
        self._digests: dict[str, list[tuple[bytes, bytes]]] = {}   # seq -> (digest, tokens) of its first pages
        # seq -> serial of the entry standing for each of its first full pages (its own page's entry, or an
        # equal page registered first by another sequence); None: unregistrable from here on (a collision)
        self._chains: dict[str, list[int | None]] = {}
        self.queries = 0        # tokens looked up at admission (vLLM: prefix_cache_queries)
        self.hits = 0           # ... of which found cached (vLLM: prefix_cache_hits)

    @property
    def num_cached_pages(self) -> int:
        return len(self._of_page)

    def is_cached(self, page: int) -> bool:
        return page in self._of_page

    def _page(self, seq_id: str, index: int, token_ids: TokenSlice) -> tuple[bytes, bytes]:
        """(digest, tokens) of the sequence's page `index` (memoised; computes the pages before it first)."""
        pages = self._digests.setdefault(seq_id, [])
        while len(pages) <= index:
            tokens = page_tokens(token_ids, len(pages), self.page_size)
            pages.append((chain_digest(pages[-1][0] if pages else self.salt, tokens), tokens))
        return pages[index]

    # -- lookup -------------------------------------------------------------------------------------
    def match(self, seq_id: str, num_tokens: int, token_ids: TokenSlice) -> list[CachedPage]:
        """The longest verified chain of cached pages for a sequence of `num_tokens` tokens, at most
        (num_tokens - 1) // page_size pages (its last token is always computed). Takes no references."""
        hits: list[CachedPage] = []
        parent = 0
        for index in range((num_tokens - 1) // self.page_size):
            digest, tokens = self._page(seq_id, index, token_ids)
            entry = self._index.get(digest)
            if entry is None or entry.parent != parent or entry.tokens != tokens:
                break
            hits.append(entry)
            parent = entry.serial
        return hits

    def digests(self, seq_id: str, first: int, end: int, token_ids: TokenSlice) -> list[bytes]:
        """Digests of the sequence's pages first..end-1 (memoised)."""
        return [self._page(seq_id, index, token_ids)[0] for index in range(first, end)]

    def adopt(self, seq_id: str, hits: list[CachedPage], num_tokens: int) -> None:
        """The sequence now holds `hits` as its first pages (the manager took the references)."""
        self._chains[seq_id] = [entry.serial for entry in hits]
        self.queries += num_tokens
        self.hits += len(hits) * self.page_size

    # -- registration -------------------------------------------------------------------------------
    def register(self, seq_id: str, table: list[int], num_computed: int, token_ids: TokenSlice) -> list[int]:
        """Register the sequence's full, computed pages not registered yet. Returns pages whose entries were
        dropped because their parent had been evicted (nothing could reach them any more)."""
        chain = self._chains.setdefault(seq_id, [])
        full = min(num_computed // self.page_size, len(table))
        if len(chain) >= full:                              # nothing new (most decode steps)
            return []
        dropped: list[int] = []
        for index in range(len(chain), full):
            parent = chain[-1] if chain else 0
            if parent is None:
                break
            digest, tokens = self._page(seq_id, index, token_ids)
            existing = self._index.get(digest)
            if existing is not None and existing.parent and existing.parent not in self._by_serial:
                self._drop(existing)                        # stale: its parent page was evicted
                dropped.append(existing.page)
                existing = None
            if existing is None:
                if table[index] in self._of_page:           # cannot happen: its own pages past the chain are new
                    raise RuntimeError(f"page {table[index]} is registered twice")
                entry = CachedPage(table[index], digest, parent, tokens, next(self._serials))
                self._index[digest] = self._of_page[entry.page] = self._by_serial[entry.serial] = entry
                chain.append(entry.serial)
            elif existing.parent == parent and existing.tokens == tokens:
                chain.append(existing.serial)               # computed twice (two sequences at once): keep one
            else:
                chain.append(None)                          # a digest collision: never cached, never confused
        return dropped

    # -- lifecycle ----------------------------------------------------------------------------------
    def release(self, seq_id: str) -> None:
        """The sequence gave its pages back (finished, aborted or preempted)."""
        self._chains.pop(seq_id, None)
        self._digests.pop(seq_id, None)

    def evicted(self, pages: list[int]) -> None:
        """The pool reused or freed these pages: their entries go."""
        for page in pages:
            entry = self._of_page.get(page)
            if entry is not None:
                self._drop(entry)

    def _drop(self, entry: CachedPage) -> None:
        del self._of_page[entry.page]
        del self._by_serial[entry.serial]
        if self._index.get(entry.digest) is entry:
            del self._index[entry.digest]

    def stats(self) -> dict[str, float]:
        return {"prefix_cache_queries": float(self.queries), "prefix_cache_hits": float(self.hits),
                "prefix_cached_pages": float(len(self._of_page))}

"""LowBitKVCache's step hooks (begin_step / attention / end_step) and its CUDA-graph-safe decode path
against the lazy path (no hooks, the plan built inside attention()), which the rest of the suite checks
against the oracle: the same attention outputs and the same cache contents, step after step, with
padding sequences on a scratch page as the graph runner adds them."""

from __future__ import annotations


import pytest
import torch

from moekv.config import CacheConfig
from moekv.errors import KVCacheCorruptionError
from moekv.kvcache import KVCacheManager
from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import KVCacheSpec
from moekv.kvcache.formats.lowbit import LowBitKVCache
from moekv.kvcache.formats.lowbit_plan import DecodePlan
from moekv.ops import dispatch
from moekv.ops.reference.lowbit import staged_page_rows
from tests.helpers import BACKENDS, ops_backend

PAGE, HEADS, Q_HEADS, DIM, LAYERS, SCALE = 16, 2, 4, 32, 2, 0.18
NUM_PAGES, STAGING_PAGES, MAX_BATCH, BUCKET = 24, 12, 8, 6
SCRATCH = "<scratch>"          # the runner's page for padding sequences, reserved for the cache's lifetime


@pytest.fixture(params=BACKENDS)
def backend(request):
    with ops_backend(request.param, cpu_tensors=True):
        yield request.param


class Pair:
    """Two caches fed the same tokens: `hooked` through begin_step/attention/end_step, decode steps padded
    to BUCKET with dummy sequences on a scratch page; `lazy` without hooks and without padding."""

    def __init__(self, seed=0, key_axis="channel", **staging):
        spec = KVCacheSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.float32)
        config = CacheConfig(kv_cache_dtype="int3", page_size=PAGE, staging_pages=STAGING_PAGES, outlier_fraction=0.02,
                             key_axis=key_axis, **staging)
        self.hooked = LowBitKVCache(spec, NUM_PAGES, "cpu", config)
        self.lazy = LowBitKVCache(spec, NUM_PAGES, "cpu", config)
        self.hooked.reserve_graph_decode(MAX_BATCH)
        self.managers = {id(c): KVCacheManager(NUM_PAGES, PAGE, on_pages_freed=c.pages_freed,
                                               staging_only_ids=c.staging_only_ids(), on_page_renamed=c.page_renamed)
                         for c in (self.hooked, self.lazy)}
        self.scratch_page: int | None = None     # reserved at the first padded step, after the first prefill:
        # not page 0, which a real sequence then fills (a skipped entry's clamped page id must not matter)
        self.lengths: dict[str, int] = {}
        self.same_counters = True               # until the hooked cache runs a step the lazy one does not
        self.buckets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # size -> a bucket's step bytes
        self.generator = torch.Generator().manual_seed(seed)
        self.fused = False                      # the hooked cache's decode steps through fused_write_target
        self.fused_layers = 0                   # layers that took it

    def hooked_layer(self, layer, query, key, value, meta):
        """One layer of the hooked cache: `attention`, or (fused, a target offered) what the attention layer
        does with a fused write target -- the rotary kernel's checked write (an identity rotation, exact), then
        `attention_prewritten`."""
        target = self.hooked.fused_write_target(layer, meta) if self.fused else None
        if target is None:
            return self.hooked.attention(layer, query, key, value, meta, SCALE)
        self.fused_layers += 1
        count = query.shape[0]
        cos, sin = torch.ones(count, DIM), torch.zeros(count, DIM)
        query, _ = dispatch.qk_norm_rotary_write(
            query, key, value, cos, sin, target.key_rows, target.value_rows, target.slots, flags=target.flags,
            key_copy=target.key_copy, value_copy=target.value_copy)
        return self.hooked.attention_prewritten(layer, query, meta, SCALE)

    def manager(self, cache) -> KVCacheManager:
        return self.managers[id(cache)]

    def tokens(self, count: int):
        """query, key, value for `count` tokens, per layer; keys with sparse spikes (outliers)."""
        out = []
        for _ in range(LAYERS):
            query = torch.randn(count, Q_HEADS, DIM, generator=self.generator)
            key = torch.randn(count, HEADS, DIM, generator=self.generator)
            spikes = torch.rand(count, HEADS, DIM, generator=self.generator) < 0.03
            key = torch.where(spikes, key * 30, key)
            value = torch.randn(count, HEADS, DIM, generator=self.generator)
            out.append((query, key, value))
        return out

    def meta(self, cache, new_tokens: dict[str, int], pad_to: int = 0) -> AttentionMetadata:
        seqs = list(new_tokens)
        manager = self.manager(cache)
        query_lens = [new_tokens[s] for s in seqs]
        context_lens = [self.lengths.get(s, 0) for s in seqs]
        tables = [manager.block_table(s) for s in seqs]
        ids = list(seqs)
        if pad_to > len(seqs) and self.scratch_page is None:
            for other in (self.hooked, self.lazy):    # same page ids in both; only the hooked cache uses it
                self.manager(other).grow(SCRATCH, 1)
            self.scratch_page = self.manager(self.hooked).block_table(SCRATCH)[0]
        for _ in range(pad_to - len(seqs)):      # padding: one token, no context, the scratch page
            query_lens.append(1)
            context_lens.append(0)
            tables.append([self.scratch_page])
            ids.append("")
        return AttentionMetadata.build(query_lens, context_lens, tables, PAGE, "cpu", request_ids=ids)

    def grow(self, new_tokens: dict[str, int]) -> None:
        for cache in (self.hooked, self.lazy):
            for seq, n in new_tokens.items():
                self.manager(cache).grow(seq, self.lengths.get(seq, 0) + n)

    def step(self, new_tokens: dict[str, int], pad_to: int = 0, decode_plan: bool | None = None,
             bucket: bool = False):
        """One step on both caches; returns the hooked outputs per layer (real rows only). bucket: the hooked
        step's rows live in a graph bucket's buffer (bind_graph_step), copied after begin_step as the runner's
        upload does."""
        self.grow(new_tokens)
        real = sum(new_tokens.values())
        data = self.tokens(real + max(pad_to - len(new_tokens), 0))
        meta = self.meta(self.hooked, new_tokens, pad_to)
        if bucket:
            size = self.hooked.graph_step_bytes(meta.num_seqs)
            host, device = self.buckets.setdefault(meta.num_seqs, (torch.zeros(size, dtype=torch.uint8),
                                                                   torch.zeros(size, dtype=torch.uint8)))
            self.hooked.bind_graph_step(meta, host, device)
            own, stale = self.hooked._rows.device_bytes.clone(), device.clone()
        self.hooked.begin_step(meta)
        if bucket:                               # begin_step wrote the bucket's host bytes, copied nothing
            assert torch.equal(self.hooked._rows.device_bytes, own) and torch.equal(device, stale)
            assert self.hooked._plan.rows is meta.step_state
            device.copy_(host)                   # the runner's one upload
        if decode_plan is not None:
            assert isinstance(self.hooked._plan, DecodePlan) == decode_plan
        hooked_out = [self.hooked_layer(layer, q, k, v, meta) for layer, (q, k, v) in enumerate(data)]
        self.hooked.end_step(meta)
        lazy_meta = self.meta(self.lazy, new_tokens)
        lazy_out = [self.lazy.attention(layer, q[:real], k[:real], v[:real], lazy_meta, SCALE)
                    for layer, (q, k, v) in enumerate(data)]
        for got, want in zip(hooked_out, lazy_out):
            assert torch.equal(got[:real], want)
        for seq, n in new_tokens.items():
            self.lengths[seq] = self.lengths.get(seq, 0) + n
        self.check_same_contents()
        return hooked_out

    def finish(self, seq: str) -> None:
        for cache in (self.hooked, self.lazy):
            self.manager(cache).free(seq)
        self.lengths.pop(seq)

    def check_same_contents(self) -> None:
        """Every real sequence's pages: quantized pages bit-equal, staged rows (its partial pages) equal."""
        hooked, lazy = self.hooked, self.lazy
        hooked_map, lazy_map = hooked.staging_block_map.tolist(), lazy.staging_block_map.tolist()
        assert hooked_map == hooked.slots.host_map() and lazy_map == lazy.slots.host_map()
        for seq, length in self.lengths.items():
            table = self.manager(hooked).block_table(seq)
            assert table == self.manager(lazy).block_table(seq)
            for index, page in enumerate(table[:-(-length // PAGE)]):
                rows = min(PAGE, length - index * PAGE)
                assert (hooked_map[page][0] >= 0) == (lazy_map[page][0] >= 0) == (rows < PAGE), (seq, index)
                for layer in range(LAYERS):
                    if rows == PAGE:
                        for mine, theirs in ((hooked.key_pages[layer], lazy.key_pages[layer]),
                                             (hooked.value_pages[layer], lazy.value_pages[layer])):
                            for name, t in mine.tensors().items():
                                assert torch.equal(t[page], theirs.tensors()[name][page]), (seq, index, name)
                    else:
                        for mine, theirs in ((hooked.staging_keys[layer], lazy.staging_keys[layer]),
                                             (hooked.staging_values[layer], lazy.staging_values[layer])):
                            mine_rows = staged_page_rows(mine, torch.tensor([hooked_map[page]]))[0, :rows]
                            theirs_rows = staged_page_rows(theirs, torch.tensor([lazy_map[page]]))[0, :rows]
                            assert torch.equal(mine_rows, theirs_rows)
        scratch = int(self.scratch_page is not None and hooked_map[self.scratch_page][0] >= 0)
        assert hooked.slots.num_used == lazy.slots.num_used + scratch
        if self.same_counters:
            assert torch.equal(hooked._counters, lazy._counters)  # masked device counters: same totals


STAGING = [dict(), dict(staging_block_size=4, lazy_partial_page=True)]   # whole pages; blocks + staging-only ids


@pytest.mark.parametrize("staging", STAGING)
def test_decode_steps_match_the_lazy_path(backend, staging):
    pair = Pair(key_axis="channel" if backend == "reference" else "token", **staging)
    pair.step({"a": 13, "b": 12, "c": 30, "d": 28}, decode_plan=False)      # ragged prefill: hooked, variable plan
    real = ["a", "b", "c", "d"]
    # pages fill in padded steps (c at step 1, a at 2, e at 4) and in an unpadded one (b and d together at 3)
    for step in range(6):
        if step == 4:
            pair.finish("b")                     # a sequence ends, a new one joins (a prefill step)
            real = ["a", "c", "d", "e"]
            pair.step({"e": 15, "a": 1}, decode_plan=False)
        pad = BUCKET if step % 3 else len(real)  # padded buckets and unpadded decode steps
        pair.step({s: 1 for s in real}, pad_to=pad, decode_plan=True)
    assert pair.lengths == {"a": 20, "c": 36, "d": 34, "e": 17}
    stats = pair.hooked.stats()
    assert stats["pages_quantized"] == sum(n // PAGE for n in pair.lengths.values()) + 1   # + b's first page
    assert stats["key_outliers_per_page_head"] > 0
    assert pair.hooked.staging_block_map[pair.scratch_page, 0] >= 0    # the scratch page keeps its one slot


@pytest.mark.parametrize("staging", STAGING)
def test_decode_steps_in_a_graph_bucket_buffer_match_the_lazy_path(backend, staging):
    """The graph runner's path: the decode rows and flags live in the bucket's buffer (bind_graph_step) and ride
    in its one copy; same outputs and cache contents as the lazy path, pages filling and quantizing, a
    non-finite key reported through the bucket's flags."""
    pair = Pair(**staging)
    pair.step({"a": 13, "b": 2, "c": 30}, decode_plan=False)
    for step in range(4):                        # c crosses 32 (padded step), a 16 (unpadded); padded to BUCKET
        pad = BUCKET if step % 2 else 3
        pair.step({s: 1 for s in "abc"}, pad_to=pad, decode_plan=True, bucket=True)
    assert pair.hooked.stats()["pages_quantized"] == 3       # c's first page at prefill, a's and c's after
    assert sorted(pair.buckets) == [3, BUCKET]
    meta = pair.meta(pair.hooked, {"a": 1, "b": 1, "c": 1}, pad_to=BUCKET)
    pair.grow({"a": 1, "b": 1, "c": 1})
    host, device = pair.buckets[BUCKET]
    device[-8:] = 1                              # flags left set by an earlier step: the copy clears them
    pair.hooked.bind_graph_step(meta, host, device)
    pair.hooked.begin_step(meta)
    device.copy_(host)
    data = pair.tokens(BUCKET)
    data[1][1][2, 1, 5] = float("nan")           # c's key, layer 1
    for layer, (q, k, v) in enumerate(data):
        pair.hooked.attention(layer, q, k, v, meta, SCALE)
    flags = pair.hooked.step_flags(meta)
    assert flags.data_ptr() == meta.step_state.flags.data_ptr() and flags.tolist() == [False, False, True] + [False] * 3
    with pytest.raises(KVCacheCorruptionError) as caught:
        pair.hooked.end_step(meta, flags.tolist())
    assert caught.value.request_ids == ["c"]


def test_bind_graph_step_checks_the_buffer():
    pair = Pair()
    pair.grow({"a": 1})
    meta = pair.meta(pair.hooked, {"a": 1})
    assert pair.hooked.graph_step_bytes(4) == 3 * 4 * 8 + 8 and pair.hooked.graph_step_bytes(MAX_BATCH + 1) == 0
    with pytest.raises(ValueError, match="needs two uint8 buffers of 32 bytes"):
        pair.hooked.bind_graph_step(meta, torch.zeros(32, dtype=torch.uint8), torch.zeros(31, dtype=torch.uint8))


def test_decode_larger_than_the_reservation_uses_the_variable_plan():
    pair = Pair()
    seqs = {f"s{i}": 15 for i in range(MAX_BATCH + 1)}
    pair.step(seqs, decode_plan=False)
    pair.step({s: 1 for s in seqs}, decode_plan=False)       # 9 > MAX_BATCH: hooked, but the variable plan
    pair.step({s: 1 for s in list(seqs)[:MAX_BATCH]}, decode_plan=True)


def test_without_reservation_or_hooks_nothing_changes():
    spec = KVCacheSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.float32)
    cache = LowBitKVCache(spec, 4, "cpu", CacheConfig(kv_cache_dtype="int3", page_size=PAGE, staging_pages=2))
    assert LowBitKVCache.supports_graph_decode
    meta = AttentionMetadata.build([1], [0], [[2]], PAGE, "cpu")
    cache.begin_step(meta)                       # not reserved: the variable plan, committed by end_step
    assert not isinstance(cache._plan, DecodePlan)
    for layer in range(LAYERS):
        cache.attention(layer, torch.randn(1, Q_HEADS, DIM), torch.randn(1, HEADS, DIM), torch.randn(1, HEADS, DIM),
                        meta, SCALE)
    assert cache._plan is not None               # the last layer does not commit a hooked plan
    cache.end_step(meta)
    assert cache._plan is None and cache.slots.num_used == 1
    cache.end_step(meta)                         # nothing pending: a no-op
    cache.reserve_graph_decode(4)
    cache.reserve_graph_decode(2)                # no more than reserved: a no-op
    buffers = cache._rows.index.data_ptr(), cache._rows.flags.data_ptr()
    with pytest.raises(RuntimeError, match="cannot grow"):
        cache.reserve_graph_decode(5)
    assert (cache._rows.index.data_ptr(), cache._rows.flags.data_ptr()) == buffers


def poisoned_step(pair):
    """a, b, c one token each after 15 / 15 / 6, with a NaN in b's key (layer 0; b fills its page this step) and an
    Inf in a padding sequence's value (never reported); begin_step done: (layer inputs, meta)."""
    new = {"a": 1, "b": 1, "c": 1}
    pair.grow(new)
    data = pair.tokens(BUCKET)
    data[0][1][1, 0, 3] = float("nan")
    data[1][2][4, 1, 0] = float("inf")
    meta = pair.meta(pair.hooked, new, pad_to=BUCKET)
    pair.hooked.begin_step(meta)
    return data, meta


def test_non_finite_decode_raises_at_end_step_and_commits_nothing(backend):
    pair = Pair()
    pair.step({"a": 15, "b": 15, "c": 6})
    hooked = pair.hooked
    before_map = hooked.staging_block_map.clone()
    before_used = hooked.slots.num_used
    data, meta = poisoned_step(pair)
    assert isinstance(hooked._plan, DecodePlan)
    for layer, (q, k, v) in enumerate(data):
        hooked.attention(layer, q, k, v, meta, SCALE)
    with pytest.raises(KVCacheCorruptionError, match="b") as caught:
        hooked.end_step(meta)
    assert caught.value.seq_indices == [1] and caught.value.request_ids == ["b"]
    assert hooked._plan is None
    pair.same_counters = False                   # statistics of the failed step stay counted
    # not committed: a's and b's filled pages keep their slots (read from staging, as before the step); only
    # the scratch page's slot, taken by begin_step for the padding, is new (it keeps it for good)
    after_map = hooked.staging_block_map.clone()
    assert before_map[pair.scratch_page] == -1 and after_map[pair.scratch_page] >= 0
    after_map[pair.scratch_page] = -1
    assert torch.equal(after_map, before_map) and hooked.slots.num_used == before_used + 1
    for layer in range(LAYERS):
        for store in (hooked.key_pages[layer], hooked.value_pages[layer]):
            assert all(torch.isfinite(t.float()).all() for t in store.tensors().values())
    assert torch.isfinite(hooked.staging_keys).all() and torch.isfinite(hooked.staging_values).all()
    # the engine ends b and re-runs the step for the others: both caches then agree (check in step())
    for cache in (pair.hooked, pair.lazy):
        pair.manager(cache).free("b")
    pair.lengths.pop("b")
    pair.step({"a": 1, "c": 1}, pad_to=BUCKET, decode_plan=True)
    pair.step({"a": 1, "c": 1}, pad_to=BUCKET, decode_plan=True)


def _run_layers(cache, meta, data):
    return [cache.attention(layer, q, k, v, meta, SCALE) for layer, (q, k, v) in enumerate(data)]


@pytest.mark.parametrize("freed_when", ["before_forward", "after_forward"])
@pytest.mark.parametrize("decode", [True, False])
def test_pages_freed_while_a_step_is_pending_keeps_the_others_commit(decode, freed_when):
    """A request aborted between begin_step and end_step (its pages freed): the step's plan stays, the other
    sequences' filled pages return their slots at end_step, and the freed one holds no slot."""
    pair = Pair()
    pair.step({"a": 15, "b": 5, "c": 9})
    cache = pair.hooked
    new = {"a": 1, "b": 1, "c": 1} if decode else {"a": 1, "b": 2, "c": 3}
    pair.grow(new)
    data = pair.tokens(sum(new.values()))
    data[0][1][1, 0, 0] = float("nan")          # b (the aborted one) has a non-finite key: not reported
    meta = pair.meta(cache, new)
    cache.begin_step(meta)
    assert isinstance(cache._plan, DecodePlan) == decode
    if freed_when == "before_forward":
        pair.manager(cache).free("b")
        _run_layers(cache, meta, data)
    else:
        _run_layers(cache, meta, data)
        pair.manager(cache).free("b")
    cache.end_step(meta)                        # commits a's filled page; b is gone
    assert cache._plan is None
    a_pages = pair.manager(cache).block_table("a")
    c_pages = pair.manager(cache).block_table("c")
    assert cache.slots.blocks(a_pages[0])[0] == -1          # a's page filled: its slot returned
    assert cache.slots.blocks(c_pages[0])[0] >= 0           # c's page is still partial
    live = {p for p, s in enumerate(cache.slots.host_map()) if s[0] >= 0}
    assert live == {c_pages[0]} and cache.slots.num_used == 1
    assert cache.staging_block_map.tolist() == cache.slots.host_map()


def test_padding_on_the_scratch_page_is_never_quantized_or_counted_page_size_1():
    """With P = 1 every decode token fills its page, the padding sequences' scratch page too: the padding
    must not quantize it (and add to the statistics) once per padding row; it keeps its one slot."""
    spec = KVCacheSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=1, dtype=torch.float32)
    cache = LowBitKVCache(spec, 16, "cpu", CacheConfig(kv_cache_dtype="int3", page_size=1, staging_pages=4))
    cache.reserve_graph_decode(4)
    scratch, real = 15, [3, 4]
    gen = torch.Generator().manual_seed(0)
    for context in (0, 1):
        meta = AttentionMetadata.build([1] * 4, [context, 0, 0, 0], [real, [scratch], [scratch], [scratch]], 1,
                                       "cpu", request_ids=["a", "", "", ""])
        cache.begin_step(meta)
        assert isinstance(cache._plan, DecodePlan)
        for layer in range(LAYERS):
            cache.attention(layer, torch.randn(4, Q_HEADS, DIM, generator=gen), torch.randn(4, HEADS, DIM, generator=gen),
                            torch.randn(4, HEADS, DIM, generator=gen), meta, SCALE)
        cache.end_step(meta)
    assert cache.stats()["pages_quantized"] == 2                 # a's two pages, not the scratch page 6 times
    assert cache.slots.blocks(real[0])[0] == cache.slots.blocks(real[1])[0] == -1
    assert cache.slots.blocks(scratch)[0] >= 0 and cache.slots.num_used == 1

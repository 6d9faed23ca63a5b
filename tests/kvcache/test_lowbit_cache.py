"""LowBitKVCache through attention() against the reference semantics, page lifecycle, robustness."""

import pytest
import torch

from moekv.config import CacheConfig
from moekv.errors import ConfigError, KVCacheCorruptionError, OutOfKVCacheError
from moekv.kvcache import KVCacheManager, accounting, create_kv_cache
from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import KVCacheSpec
from moekv.ops.reference.attention import causal_attention_reference
from moekv.kvcache.formats.lowbit import LowBitKVCache
from moekv.ops.reference.lowbit import dequantize_pages, quantize_pages

PAGE, HEADS, Q_HEADS, DIM, LAYERS, SCALE = 8, 2, 4, 32, 2, 0.18


class Harness:
    """Drives a cache with a real block manager and checks every output against an oracle that keeps
    all tokens in full precision and quantizes a page (reference op) once it is full and not a sink page."""

    def __init__(self, dtype=torch.float32, num_pages=40, staging_pages=12, seed=0, **config):
        self.spec = KVCacheSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=dtype)
        config = CacheConfig(kv_cache_dtype=config.pop("kv_cache_dtype", "int3"), page_size=PAGE,
                             staging_pages=staging_pages, **config)
        self.cache = create_kv_cache(config, self.spec, num_pages, "cpu")
        self.manager = KVCacheManager(num_pages, PAGE, on_pages_freed=self.cache.pages_freed,
                                      staging_only_ids=self.cache.staging_only_ids(),
                                      on_page_renamed=self.cache.page_renamed)
        self.lengths: dict[str, int] = {}
        self.history: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.generator = torch.Generator().manual_seed(seed)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.generator)

    def expected_context(self, layer, seq, context_len):
        keys, values = self.history.get((layer, seq), (torch.zeros(0, HEADS, DIM), torch.zeros(0, HEADS, DIM)))
        parts = []
        for rows, spec in ((keys, self.cache.key_spec), (values, self.cache.value_spec)):
            pages = []
            for index in range(-(-context_len // PAGE)):
                page = rows[index * PAGE:(index + 1) * PAGE].to(self.spec.dtype)
                if (index + 1) * PAGE <= context_len and index >= self.cache.config.fp_sink_pages:
                    packed, _ = quantize_pages(page.transpose(0, 1).unsqueeze(0), spec)
                    page = dequantize_pages(packed, spec)[0].transpose(0, 1)
                pages.append(page.float())
            parts.append(torch.cat(pages)[:context_len] if pages else torch.zeros(0, HEADS, DIM))
        return parts

    def step(self, new_tokens: dict[str, int], poison: dict[str, int] | None = None, check=True):
        """One engine step: `new_tokens` per sequence id; `poison` puts a NaN into that seq's keys at a layer."""
        seqs = list(new_tokens)
        for seq in seqs:
            self.manager.grow(seq, self.lengths.get(seq, 0) + new_tokens[seq])
        meta = AttentionMetadata.build([new_tokens[s] for s in seqs], [self.lengths.get(s, 0) for s in seqs],
                                       [self.manager.block_table(s) for s in seqs], PAGE, "cpu", request_ids=seqs)
        total = meta.num_tokens
        written = []
        for layer in range(LAYERS):
            query, key, value = (self.randn(total, heads, DIM).to(self.spec.dtype)
                                 for heads in (Q_HEADS, HEADS, HEADS))
            start = 0
            for seq in seqs:
                if poison and poison.get(seq) == layer:
                    key[start + new_tokens[seq] - 1, 0, 3] = float("nan")
                start += new_tokens[seq]
            out = self.cache.attention(layer, query, key, value, meta, SCALE)     # may raise after the last layer
            assert out.shape == query.shape and out.dtype == query.dtype
            start = 0
            for seq in seqs:
                rows = slice(start, start + new_tokens[seq])
                context_len = self.lengths.get(seq, 0)
                if check and not (poison and seq in poison):
                    ctx_keys, ctx_values = self.expected_context(layer, seq, context_len)
                    expected = causal_attention_reference(
                        query[rows], torch.cat([ctx_keys, key[rows].float()]),
                        torch.cat([ctx_values, value[rows].float()]), context_len, SCALE)
                    tolerance = 1e-5 if self.spec.dtype == torch.float32 else 2e-2
                    torch.testing.assert_close(out[rows].float(), expected, atol=tolerance, rtol=tolerance)
                written.append((layer, seq, key[rows], value[rows]))
                start += new_tokens[seq]
        for layer, seq, key, value in written:          # the step committed: extend the oracle's history
            old = self.history.get((layer, seq), (torch.zeros(0, HEADS, DIM), torch.zeros(0, HEADS, DIM)))
            self.history[(layer, seq)] = (torch.cat([old[0], key.float()]), torch.cat([old[1], value.float()]))
        for seq in seqs:
            self.lengths[seq] = self.lengths.get(seq, 0) + new_tokens[seq]
        return meta

    def finish(self, seq):
        self.manager.free(seq)
        self.lengths.pop(seq)
        for layer in range(LAYERS):
            self.history.pop((layer, seq), None)

    def partial_sequences(self):
        return sum(1 for n in self.lengths.values() if n % PAGE)

    def staging_blocks_held(self):
        config = self.cache.config
        return sum(accounting.pages_held(n, PAGE, config.fp_sink_pages, config.resolved_staging_block)[1]
                   for n in self.lengths.values())


STAGING = [dict(), dict(staging_block_size=2), dict(staging_block_size=4, lazy_partial_page=True),
           dict(staging_block_size=1, lazy_partial_page=True), dict(lazy_partial_page=True)]


@pytest.mark.parametrize("kv_cache_dtype", ["int4", "int3", "int2"])
@pytest.mark.parametrize("key_axis", ["channel", "token"])
def test_ragged_prefill_then_decode_across_pages(kv_cache_dtype, key_axis):
    h = Harness(kv_cache_dtype=kv_cache_dtype, key_axis=key_axis, outlier_fraction=0.02)
    h.step({"a": 13, "b": 1, "c": 8, "d": 21})          # ragged prefill: partial, single token, exact page, 2.6 pages
    for _ in range(4):                                   # decode: a crosses 16, d crosses 24
        h.step({"a": 1, "b": 1, "c": 1, "d": 1})
    h.step({"a": 5, "b": 17, "c": 1, "d": 3})            # a mixed chunked-prefill step
    assert h.cache.slots.num_used == h.partial_sequences()
    stats = h.cache.stats()
    assert stats["pages_quantized"] == sum(n // PAGE for n in h.lengths.values())


def test_bf16_model_dtype():
    h = Harness(dtype=torch.bfloat16)
    h.step({"a": 19, "b": 3})
    h.step({"a": 1, "b": 6})
    assert h.cache.staging_keys.dtype == torch.bfloat16


def test_pages_freed_and_reused_return_staging_slots():
    h = Harness(num_pages=6, staging_pages=3)
    h.step({"a": 20, "b": 5})                            # a: 3 pages (last partial), b: 1 partial page
    assert h.cache.slots.num_used == 2
    h.finish("a")                                        # its pages and its staging slot come back
    assert h.cache.slots.num_used == 1 and h.manager.num_free_pages == 5
    h.step({"c": 17, "b": 1})                            # c reuses a's pages (quantized ones and the staged one)
    h.step({"c": 7, "b": 2})                             # c's third page fills exactly: quantized, slot returns
    assert h.lengths == {"b": 8, "c": 24}
    assert h.cache.slots.num_used == 0 and int((h.cache.staging_block_map[:, 0] >= 0).sum()) == 0
    h.step({"c": 1, "b": 1})
    assert h.cache.slots.num_used == 2
    h.finish("b")
    h.finish("c")
    assert h.cache.slots.num_used == 0 and h.manager.num_free_pages == 6


def test_single_token_sequences():
    h = Harness()
    h.step({"a": 1})
    for _ in range(PAGE + 1):
        h.step({"a": 1})
    assert h.lengths["a"] == PAGE + 2 and h.cache.slots.num_used == 1


def test_fp_sink_pages_stay_full_precision():
    h = Harness(fp_sink_pages=1)
    h.step({"a": 20, "b": 4})
    h.step({"a": 1, "b": 5})
    # a (21 tokens) keeps page 0 (sink) and its partial page 2 in staging; b (9) its full sink page 0 and page 1
    assert h.cache.slots.num_used == 4
    slots = h.cache.staging_block_map[:, 0]
    assert slots[h.manager.block_table("a")[0]] >= 0 and slots[h.manager.block_table("a")[1]] < 0
    assert h.cache.bits_per_value([21, 9]) == pytest.approx(accounting.cache_bits_per_value(
        h.cache.key_spec, h.cache.value_spec, HEADS, 4, [21, 9], fp_sink_pages=1))


def test_non_finite_tokens_raise_name_the_request_and_do_not_commit():
    h = Harness()
    h.step({"a": 12, "b": 7, "c": 3})
    with pytest.raises(KVCacheCorruptionError, match="b") as caught:
        h.step({"a": 4, "b": 2, "c": 5}, poison={"b": 0}, check=True)
    assert caught.value.seq_indices == [1] and caught.value.request_ids == ["b"]
    for layer in range(LAYERS):                          # nothing non-finite was stored, in any page
        for store in (h.cache.key_pages[layer], h.cache.value_pages[layer]):
            assert all(torch.isfinite(t.float()).all() for t in store.tensors().values())
    assert torch.isfinite(h.cache.staging_keys).all() and torch.isfinite(h.cache.staging_values).all()
    # the engine ends b and re-runs the step for the others: the cache reads as if the failed step never ran
    h.lengths.pop("b")
    h.manager.free("b")
    h.step({"a": 4, "c": 5})
    h.step({"a": 1, "c": 1})
    assert h.cache.slots.num_used == h.partial_sequences()


def test_non_finite_in_the_last_layer_values_is_caught():
    h = Harness()
    h.step({"a": 3, "b": 3})
    meta = AttentionMetadata.build([2, 2], [3, 3], [h.manager.block_table("a"), h.manager.block_table("b")],
                                   PAGE, "cpu", request_ids=["a", "b"])
    q, k, v = torch.randn(4, Q_HEADS, DIM), torch.randn(4, HEADS, DIM), torch.randn(4, HEADS, DIM)
    h.cache.attention(0, q, k, v, meta, SCALE)
    v[0, 1, 0] = float("inf")
    v[3, 0, 0] = float("-inf")
    with pytest.raises(KVCacheCorruptionError) as caught:
        h.cache.attention(1, q, k, v, meta, SCALE)
    assert caught.value.seq_indices == [0, 1] and caught.value.request_ids == ["a", "b"]


def test_out_of_staging_pages_is_a_clear_error():
    h = Harness(staging_pages=2)
    h.step({"a": 3, "b": 3})
    with pytest.raises(OutOfKVCacheError, match="staging_pages"):
        h.step({"c": 3}, check=False)


def test_capacity_accounting_matches_the_tensors():
    h = Harness(num_pages=10, staging_pages=4)
    cache = h.cache
    per_page = sum(store.nbytes for store in cache.key_pages + cache.value_pages) // 10
    assert per_page == accounting.lowbit_page_bytes(cache.key_spec, cache.value_spec, HEADS, LAYERS)
    staging = (cache.staging_keys.numel() + cache.staging_values.numel()) * 4
    assert staging == 4 * LowBitKVCache.staging_page_bytes(h.spec)
    assert LowBitKVCache.bytes_per_page(h.spec, cache.config) == per_page
    assert LowBitKVCache.fixed_bytes(h.spec, cache.config) == staging
    default = CacheConfig(kv_cache_dtype="int3", page_size=PAGE)
    assert LowBitKVCache.bytes_per_page(h.spec, default) == per_page + LowBitKVCache.staging_page_bytes(h.spec) // 8
    assert LowBitKVCache.fixed_bytes(h.spec, default) == 0
    assert create_kv_cache(default, h.spec, 1024, "cpu").slots.num_blocks == 128


def test_budget_hits_are_counted_in_stats():
    h = Harness(key_axis="token", outlier_fraction=0.01)
    spec = h.spec
    meta = AttentionMetadata.build([PAGE], [0], [h.manager.grow("a", PAGE)], PAGE, "cpu")
    key = torch.randn(PAGE, HEADS, DIM)
    key[:, :, 7] += 50                                  # one per-token outlier in every token: 8 > capacity 3
    for layer in range(spec.num_layers):
        h.cache.attention(layer, torch.randn(PAGE, Q_HEADS, DIM), key, torch.randn(PAGE, HEADS, DIM), meta, SCALE)
    stats = h.cache.stats()
    assert stats["key_budget_hit_rate"] == 1.0 and stats["key_outliers_per_page_head"] == 3
    assert stats["key_qualifying_per_page_head"] == PAGE


def test_configuration_errors():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, page_size=2048, dtype=torch.float16)
    with pytest.raises(ConfigError, match="16-bit"):
        LowBitKVCache(spec, 4, "cpu", CacheConfig(kv_cache_dtype="int3"))
    with pytest.raises(ConfigError, match="int4, int3 or int2"):
        LowBitKVCache(spec, 4, "cpu", CacheConfig(kv_cache_dtype="bf16"))


def test_out_of_staging_pages_returns_the_slots_the_failed_step_took():
    h = Harness(staging_pages=3)
    h.step({"a": 3, "b": 3})
    with pytest.raises(OutOfKVCacheError):
        h.step({"c": 3, "d": 3}, check=False)             # c takes the last slot, then d finds none
    assert h.cache.slots.num_used == 2
    h.manager.free("d")                                   # the engine drops d and re-runs the step for c
    h.step({"c": 3})
    for _ in range(3):                                    # c's staged context is read back from its slot
        h.step({"a": 1, "b": 1, "c": 1})
    assert h.cache.slots.num_used == 3


@pytest.mark.parametrize("sinks, lengths, staged", [
    (0, [PAGE * 2 + 2, PAGE // 2], 2 + PAGE // 2),   # tails only
    (0, [PAGE * 3], 0),                              # full pages: all low-bit
    (1, [PAGE + 3], PAGE + 3),                       # sink page + tail
    (1, [PAGE // 2], PAGE // 2),                     # the partial page is the sink page: counted once
    (2, [PAGE * 5 + 1, PAGE], 2 * PAGE + 1 + PAGE),
])
def test_full_precision_token_share_and_page_bits(sinks, lengths, staged):
    h = Harness(fp_sink_pages=sinks)
    assert h.cache.full_precision_token_share(lengths) == pytest.approx(staged / sum(lengths))
    assert h.cache.full_precision_token_share([]) == 0.0
    page_bits = h.cache.page_bits_per_value()
    assert page_bits == accounting.format_bits_per_value(h.cache.key_spec, h.cache.value_spec)
    assert 3.0 < page_bits < 6.0                     # int3 codes + per-page metadata, never the fp tail's 32
    fp = create_kv_cache(CacheConfig(kv_cache_dtype="fp32", page_size=PAGE), h.spec, 8, "cpu")
    assert fp.page_bits_per_value() == 32.0 and fp.full_precision_token_share(lengths) == 1.0


@pytest.mark.parametrize("staging,sinks", [(STAGING[1], 0), (STAGING[2], 1), (STAGING[3], 0), (STAGING[4], 1)])
def test_staging_blocks_and_lazy_partial_pages_match_the_oracle(staging, sinks):
    # every output against the full-precision oracle through prefill, decode across pages, mixed chunks,
    # sequences ending and new ones reusing their pages; the staging held is ceil(rows / block) per partial page
    h = Harness(outlier_fraction=0.02, fp_sink_pages=sinks, **staging)
    h.step({"a": 13, "b": 1, "c": 8, "d": 21})
    for _ in range(PAGE + 1):
        h.step({"a": 1, "b": 1, "c": 1, "d": 1})
        assert h.cache.slots.num_used == h.staging_blocks_held()
    h.step({"a": 5, "b": 17, "c": 1, "d": 3})
    h.finish("b")
    h.step({"e": 30, "a": 2})
    for _ in range(3):
        h.step({"a": 1, "c": 1, "d": 1, "e": 1})
    assert h.cache.slots.num_used == h.staging_blocks_held()
    finished_b = 27 // PAGE - sinks                              # b (27 tokens) ended with its pages quantized
    assert h.cache.stats()["pages_quantized"] == sum(max(n // PAGE - sinks, 0) for n in h.lengths.values()) + finished_b
    lazy = staging.get("lazy_partial_page", False)
    for seq, n in h.lengths.items():
        table = h.manager.block_table(seq)
        assert len(table) == -(-n // PAGE)
        staging_only = [page >= 40 for page in table]               # Harness: 40 pool pages
        assert staging_only == [lazy and n % PAGE != 0 and i == len(table) - 1 for i in range(len(table))]
    used = h.manager.pool.num_pages - h.manager.num_free_pages
    assert used == sum(n // PAGE + (0 if lazy else int(n % PAGE != 0)) for n in h.lengths.values())
    assert h.cache.bits_per_value(list(h.lengths.values())) == pytest.approx(accounting.cache_bits_per_value(
        h.cache.key_spec, h.cache.value_spec, HEADS, 4, list(h.lengths.values()), sinks,
        h.cache.config.resolved_staging_block, lazy))
    for seq in list(h.lengths):
        h.finish(seq)
    assert h.cache.slots.num_used == 0 and h.manager.num_free_pages == 40
    assert int((h.cache.staging_block_map >= 0).sum()) == 0


def test_lazy_partial_pages_hold_no_pool_page_and_run_out_of_ids_cleanly():
    h = Harness(num_pages=6, staging_pages=2, staging_block_size=4, lazy_partial_page=True)
    h.step({"a": 20, "b": 5})          # a: 2 pool pages + a staging-only page; b: a staging-only page
    assert h.manager.num_free_pages == 4 and h.manager.num_free_tails == 0
    assert not h.manager.can_grow("c", 3)                       # no staging-only id left for a third sequence
    with pytest.raises(OutOfKVCacheError, match="staging-only page ids"):
        h.manager.grow("c", 3)
    assert not h.manager.has("c") or h.manager.block_table("c") == []
    assert h.manager.can_grow("c", 8)                           # a whole page needs no staging-only id
    h.step({"a": 4, "b": 3})                                    # both fill their pages: the ids come back
    assert h.manager.num_free_tails == 2 and h.manager.num_free_pages == 2
    assert h.cache.slots.num_used == 0


def test_lazy_partial_page_bits_at_16k():
    # the issue-23 target by the accounting, on the decode bench's shape (8 KV heads, head_dim 128, P = 128, bf16)
    from moekv.kvcache.formats.lowbit_capacity import quant_specs
    spec = KVCacheSpec(num_layers=1, num_kv_heads=8, head_dim=128, page_size=128, dtype=torch.bfloat16)
    key_spec, value_spec = quant_specs(spec, CacheConfig(kv_cache_dtype="int3"))
    cycle = [accounting.page_cycle_bits(key_spec, value_spec, 8, 2, 16384, staging_block=block, lazy_partial_page=lazy)
             for block, lazy in ((None, False), (32, False), (None, True), (32, True))]
    assert cycle[0] == pytest.approx(3.3650, abs=1e-4)                 # whole staging pages (the old default)
    assert cycle[0] > cycle[1] > cycle[3] and cycle[0] > cycle[2] > cycle[3]
    assert cycle[3] == pytest.approx(3.2933, abs=1e-4) and cycle[3] <= 3.30

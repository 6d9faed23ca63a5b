"""A prepared (CUDA-graph) decode step of the low-bit cache makes two op calls a layer -- the fused staging
write, the attention -- plus one call of the all-layers key+value quantizer after the last layer (none per
layer), and no elementwise torch ops."""

from __future__ import annotations

import collections

import torch

from moekv.ops import dispatch
from tests.kvcache.test_lowbit_graph_decode import BUCKET, LAYERS, Pair


def test_prepared_decode_step_is_two_ops_a_layer_and_one_quantizer(monkeypatch):
    pair = Pair()
    pair.step({"a": 15, "b": 3})
    calls: collections.Counter = collections.Counter()
    active = [False]
    for name in ("stage_decode_tokens", "paged_attention_lowbit", "quantize_staged_kv_counted",
                 "quantize_staged_kv_counted_layers"):
        original = getattr(dispatch, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += active[0]               # the hooked cache's calls only (not the lazy twin's)
            active[0], before = False, active[0]
            try:
                return _original(*args, **kwargs)
            finally:
                active[0] = before
        monkeypatch.setattr(dispatch, name, counted)
    for owner, name in ((torch, "isfinite"), (torch, "where"), (torch.Tensor, "index_copy_"),
                        (torch.Tensor, "logical_or_"), (torch.Tensor, "index_select")):
        original = getattr(owner, name)

        def forbidden(*args, _name=name, _original=original, **kwargs):
            assert not active[0], f"{_name} in the cache's own decode-step code"
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, name, forbidden)
    cache = pair.hooked
    original_attention = cache.attention

    def attention(*args, **kwargs):
        active[0] = True
        try:
            return original_attention(*args, **kwargs)
        finally:
            active[0] = False
    monkeypatch.setattr(cache, "attention", attention)
    before = cache.stats()["pages_quantized"]
    pair.step({"a": 1, "b": 1}, pad_to=BUCKET, decode_plan=True)      # a fills its page: quantized
    assert LAYERS > 1 and calls == collections.Counter({      # and quantize_staged_kv_counted (per layer): 0
        "stage_decode_tokens": LAYERS, "paged_attention_lowbit": LAYERS, "quantize_staged_kv_counted_layers": 1})
    assert cache.stats()["pages_quantized"] == before + 1           # a's page, in every layer


def test_filled_page_is_quantized_after_the_last_layer_only(monkeypatch):
    """A prepared step that fills a page leaves every layer's low-bit page as it was until the last layer's
    attention has run; then all layers' pages are written at once (equal to the lazy path's, which Pair.step
    checks, with the same counters)."""
    pair = Pair()
    pair.step({"a": 15, "b": 3})
    cache = pair.hooked
    page = pair.manager(cache).block_table("a")[0]
    before = [[t[page].clone() for t in pages.tensors().values()] for pages in cache.key_pages + cache.value_pages]
    seen = []
    original_attention = cache.attention

    def attention(layer, *args, **kwargs):
        out = original_attention(layer, *args, **kwargs)
        now = [[t[page] for t in pages.tensors().values()] for pages in cache.key_pages + cache.value_pages]
        seen.append([all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(now, before)])
        return out
    monkeypatch.setattr(cache, "attention", attention)
    quantized = cache.stats()["pages_quantized"]
    pair.step({"a": 1, "b": 1}, pad_to=BUCKET, decode_plan=True)      # a's first page fills
    assert len(seen) == LAYERS
    assert all(seen[layer] == [True] * (2 * LAYERS) for layer in range(LAYERS - 1))   # untouched until the last
    assert seen[-1] == [False] * (2 * LAYERS)                          # then every layer's key and value page
    assert cache.stats()["pages_quantized"] == quantized + 1
    assert cache.slots.slot_of_page[page] < 0                          # end_step returned its staging slot

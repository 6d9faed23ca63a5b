"""A prepared (CUDA-graph) decode step of the low-bit cache makes two op calls a layer -- the fused staging
write, the attention -- plus one call of the all-layers key+value quantizer after the last layer (none per
layer), and no elementwise torch ops; with the staging write folded into the layer's rotary launch
(fused_write_target, attention_prewritten) one a layer, the attention, the rotary launch the layer's one op
before it, and the same one quantizer call after the last layer."""

from __future__ import annotations

import collections

import pytest
import torch

from moekv.ops import dispatch
from tests.kvcache.test_lowbit_graph_decode import BUCKET, LAYERS, Pair


def _active_layers(monkeypatch, pair: Pair, active: list) -> None:
    """Mark the hooked cache's layers (from the rotary launch on, through the cache's own code) as active."""
    original_layer = pair.hooked_layer

    def layer(*args, **kwargs):
        active[0] = True
        try:
            return original_layer(*args, **kwargs)
        finally:
            active[0] = False
    monkeypatch.setattr(pair, "hooked_layer", layer)


@pytest.mark.parametrize("fused", [False, True])
def test_prepared_decode_step_is_two_ops_a_layer_one_fused_and_one_quantizer(monkeypatch, fused):
    pair = Pair()
    pair.fused = fused
    pair.step({"a": 15, "b": 3})
    calls: collections.Counter = collections.Counter()
    active = [False]
    for name in ("stage_decode_tokens", "paged_attention_lowbit", "quantize_staged_kv_counted",
                 "quantize_staged_kv_counted_layers", "qk_norm_rotary_write"):
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
    _active_layers(monkeypatch, pair, active)
    cache = pair.hooked
    before = cache.stats()["pages_quantized"]
    pair.step({"a": 1, "b": 1}, pad_to=BUCKET, decode_plan=True)      # a fills its page: quantized
    assert pair.fused_layers == (LAYERS if fused else 0)
    # the staging write is the rotary launch's when fused: one op fewer a layer; quantize_staged_kv_counted
    # (per layer): 0 either way, the all-layers quantizer once
    stage = "qk_norm_rotary_write" if fused else "stage_decode_tokens"
    assert LAYERS > 1 and calls == collections.Counter({
        stage: LAYERS, "paged_attention_lowbit": LAYERS, "quantize_staged_kv_counted_layers": 1})
    cache_ops = sum(n for name, n in calls.items() if name != "qk_norm_rotary_write")
    assert cache_ops == (1 if fused else 2) * LAYERS + 1
    assert cache.stats()["pages_quantized"] == before + 1           # a's page, in every layer


@pytest.mark.parametrize("fused", [False, True])
def test_filled_page_is_quantized_after_the_last_layer_only(monkeypatch, fused):
    """A prepared step that fills a page leaves every layer's low-bit page as it was until the last layer's
    attention has run; then all layers' pages are written at once (equal to the lazy path's, which Pair.step
    checks, with the same counters) -- with the staging write in the cache's stage launch or in the rotary
    launch alike."""
    pair = Pair()
    pair.fused = fused
    pair.step({"a": 15, "b": 3})
    cache = pair.hooked
    page = pair.manager(cache).block_table("a")[0]
    before = [[t[page].clone() for t in pages.tensors().values()] for pages in cache.key_pages + cache.value_pages]
    seen = []
    original_layer = pair.hooked_layer

    def layer(index, *args, **kwargs):
        out = original_layer(index, *args, **kwargs)
        now = [[t[page] for t in pages.tensors().values()] for pages in cache.key_pages + cache.value_pages]
        seen.append([all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(now, before)])
        return out
    monkeypatch.setattr(pair, "hooked_layer", layer)
    quantized = cache.stats()["pages_quantized"]
    pair.step({"a": 1, "b": 1}, pad_to=BUCKET, decode_plan=True)      # a's first page fills
    assert len(seen) == LAYERS
    assert pair.fused_layers == (LAYERS if fused else 0)
    assert all(seen[layer] == [True] * (2 * LAYERS) for layer in range(LAYERS - 1))   # untouched until the last
    assert seen[-1] == [False] * (2 * LAYERS)                          # then every layer's key and value page
    assert cache.stats()["pages_quantized"] == quantized + 1
    assert cache.slots.blocks(page)[0] < 0                          # end_step returned its staging slot

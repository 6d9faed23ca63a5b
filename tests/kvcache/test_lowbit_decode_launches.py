"""A prepared (CUDA-graph) decode step of the low-bit cache makes three op calls a layer -- the fused
staging write, the attention, the one-launch key+value quantizer -- and no elementwise torch ops; with the
staging write folded into the layer's rotary launch (fused_write_target, attention_prewritten) two: the
attention and the quantizer, the rotary launch the layer's one op before them."""

from __future__ import annotations

import collections

import pytest
import torch

from moekv.ops import dispatch
from tests.kvcache.test_lowbit_graph_decode import BUCKET, LAYERS, Pair


@pytest.mark.parametrize("fused", [False, True])
def test_prepared_decode_step_is_three_ops_a_layer_two_fused(monkeypatch, fused):
    pair = Pair()
    pair.fused = fused
    pair.step({"a": 15, "b": 3})
    calls: collections.Counter = collections.Counter()
    active = [False]
    for name in ("stage_decode_tokens", "paged_attention_lowbit", "quantize_staged_kv_counted",
                 "qk_norm_rotary_write"):
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
    original_layer = pair.hooked_layer

    def layer(*args, **kwargs):                  # the layer's ops from the rotary launch on, the cache's own
        active[0] = True
        try:
            return original_layer(*args, **kwargs)
        finally:
            active[0] = False
    monkeypatch.setattr(pair, "hooked_layer", layer)
    pair.step({"a": 1, "b": 1}, pad_to=BUCKET, decode_plan=True)      # a fills its page: quantized
    assert pair.fused_layers == (LAYERS if fused else 0)
    if fused:                                    # the staging write is the rotary launch's: one op fewer a layer
        assert calls == {"qk_norm_rotary_write": LAYERS, "paged_attention_lowbit": LAYERS,
                         "quantize_staged_kv_counted": LAYERS}
    else:
        assert calls == {"stage_decode_tokens": LAYERS, "paged_attention_lowbit": LAYERS,
                         "quantize_staged_kv_counted": LAYERS}
    cache_ops = sum(n for name, n in calls.items() if name != "qk_norm_rotary_write")
    assert cache_ops == (2 if fused else 3) * LAYERS

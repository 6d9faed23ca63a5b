"""A prepared (CUDA-graph) decode step of LowBitKVCache reads nothing back to the host and builds no tensor from
host data inside the cache's own code (`attention`, or with the fused decode layer `attention_prewritten`): the
step could be captured and replayed after each begin_step."""

from __future__ import annotations

import pytest
import torch

from moekv.ops import dispatch
from tests.helpers import BACKENDS, ops_backend
from tests.kvcache.test_lowbit_graph_decode import BUCKET, DIM, HEADS, LAYERS, Q_HEADS, SCALE, Pair


@pytest.fixture(params=BACKENDS)
def backend(request):
    with ops_backend(request.param, cpu_tensors=True):
        yield request.param


class HostDataGuard:
    """While active, anything that reads a tensor back to the host or builds one from host data raises."""

    def __init__(self, monkeypatch):
        self.active = False
        self.monkeypatch = monkeypatch
        for owner, name in ((torch, "tensor"), (torch, "as_tensor"), (torch, "from_numpy"), (torch, "nonzero"),
                            (torch, "masked_select"), (torch.Tensor, "tolist"), (torch.Tensor, "item"),
                            (torch.Tensor, "__bool__"), (torch.Tensor, "__int__"), (torch.Tensor, "__float__"),
                            (torch.Tensor, "__index__"), (torch.Tensor, "cpu"), (torch.Tensor, "numpy"),
                            (torch.Tensor, "nonzero"), (torch.Tensor, "masked_select")):
            self.forbid(owner, name)
        original_getitem = torch.Tensor.__getitem__

        def getitem(tensor, index):
            parts = index if isinstance(index, tuple) else (index,)
            if self.active and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                raise AssertionError("boolean-mask indexing (a data-dependent shape) inside attention()")
            return original_getitem(tensor, index)

        monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)

    def forbid(self, owner, name):
        original = getattr(owner, name)

        def guarded(*args, **kwargs):
            if self.active:
                raise AssertionError(f"{name} inside attention() of a prepared decode step")
            return original(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, guarded)

    def exempt(self, owner, name):
        """Let `owner.name` (a kernel not owned by the cache) do what it likes."""
        original = getattr(owner, name)
        guard = self

        def call(*args, **kwargs):
            active, guard.active = guard.active, False
            try:
                return original(*args, **kwargs)
            finally:
                guard.active = active

        self.monkeypatch.setattr(owner, name, call)


@pytest.mark.parametrize("fused", [False, True])
def test_prepared_decode_attention_reads_nothing_from_the_host(backend, monkeypatch, fused):
    """Unfused: `attention` (the stage launch, the attention, after the last layer the quantizer); fused: the
    rotary kernel's checked write is the layer's (outside the guard), `attention_prewritten` the cache's."""
    pair = Pair()
    pair.fused = fused
    pair.step({"a": 15, "b": 3, "c": 16})
    cache = pair.hooked
    guard = HostDataGuard(monkeypatch)
    # the attention kernels are other code (made graph-safe elsewhere); the reference quantizer runs on the CPU
    guard.exempt(dispatch, "paged_attention_lowbit")
    if backend == "reference":
        from moekv.ops.reference import lowbit as reference
        guard.exempt(reference, "quantize_staged_pages")
    else:
        from moekv.ops.triton.lowbit import quantize as lowbit_quantize
        guard.exempt(lowbit_quantize, "_launch")       # the launch itself (the interpreter copies to the host)
    original = cache.attention
    for name in ("attention", "attention_prewritten"):
        def guarded(*args, _original=getattr(cache, name), **kwargs):
            guard.active = True
            try:
                return _original(*args, **kwargs)
            finally:
                guard.active = False
        monkeypatch.setattr(cache, name, guarded)
    pair.step({"a": 1, "b": 1, "c": 1}, pad_to=BUCKET, decode_plan=True)     # a fills its page: quantized
    pair.step({"a": 1, "b": 1, "c": 1}, pad_to=BUCKET, decode_plan=True)
    assert pair.hooked.stats()["pages_quantized"] == 2      # c (prefill) and a
    assert pair.fused_layers == (2 * LAYERS if fused else 0)       # 2 steps, every layer
    # the guard works: the lazy path (built inside attention()) trips it
    meta = pair.meta(cache, {"a": 1})
    guard.active = True
    with pytest.raises(AssertionError, match="inside attention"):
        original(0, torch.zeros(1, Q_HEADS, DIM), torch.zeros(1, HEADS, DIM), torch.zeros(1, HEADS, DIM), meta, SCALE)
    guard.active = False

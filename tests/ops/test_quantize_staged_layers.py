"""The all-layers key+value staged quantizer (the decode step's one launch after the last layer): Triton vs the
reference, bit-exact on the CPU interpreter, vs the per-layer op called once per layer, with skipped (-1) entries,
a page repeated, outlier-heavy data, untouched pages and the int64 counters."""

from __future__ import annotations

import functools

import pytest
import torch

from moekv.core.lowbit_layout import LAYER_ALIGN, PackedPages, QuantSpec
from moekv.ops import dispatch
from moekv.ops.reference import lowbit as reference
from moekv.ops.triton.lowbit import quantize_layers as lowbit_quantize
from tests.ops.test_quantize_staged import spiky

LAYERS, NUM_PAGES, SLOTS, HEADS, PAGE, DIM = 3, 6, 4, 2, 16, 32
INDICES = ((1, 3, 5, 0), (2, 4, 6, -1))      # (budget, outliers, qualifying, pages) of keys, then values
PAGES = [-1, 4, -1, 1, 4]                    # page 4 twice (same slot): quantized and counted twice
SLOT_OF = [0, 3, -1, 2, 3]                   # a skipped entry's slot may be anything


def specs(key_axis: str) -> tuple[QuantSpec, QuantSpec]:
    return (QuantSpec(bits=3, axis=key_axis, head_dim=DIM, page_size=PAGE, outlier_capacity=8),
            QuantSpec(bits=2, axis="token", head_dim=DIM, page_size=PAGE, outlier_capacity=10, clip_steps=2,
                      clip_refine=1))


def junk_stack(spec: QuantSpec, device, seed: int) -> PackedPages:
    """Stacked [L, N, ...] pages of random bits (a stray or missing write shows)."""
    gen = torch.Generator().manual_seed(seed)
    packed = PackedPages.empty(spec, NUM_PAGES, HEADS, "cpu", LAYERS)
    for t in packed.tensors().values():
        if t.dtype == torch.float16:
            t.copy_(torch.randn(t.shape, generator=gen))
        else:
            t.copy_(torch.randint(0, 256 if t.dtype == torch.uint8 else 1 << 15, t.shape, generator=gen))
    return PackedPages(**{n: t.to(device) for n, t in packed.tensors().items()},
                       **({"scale_base": None} if packed.scale_base is None else {}))


def staging(device, seed: int, kind: str) -> torch.Tensor:
    shape = (LAYERS, SLOTS, PAGE, HEADS, DIM)
    if kind == "spiky":
        return spiky(shape, torch.float32, seed).to(device)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def run(fn, keys, values, device, key_spec, value_spec, slots=SLOT_OF, pages=PAGES):
    outs = [junk_stack(key_spec, device, 11), junk_stack(value_spec, device, 12)]
    counters = torch.zeros(7, dtype=torch.int64, device=device)
    fn(keys, values, torch.tensor(slots, device=device), torch.tensor(pages, device=device), key_spec, value_spec,
       *outs, counters, *INDICES)
    return outs, counters


def assert_same(got, want):
    for mine, theirs in zip(got, want):
        for name, t in theirs.tensors().items():
            assert torch.equal(mine.tensors()[name].cpu(), t.cpu()), name


@functools.cache
def all_layers_kernel(device: str, key_axis: str, kind: str):
    """The all-layers kernel on the staging data of seeds 1 and 2: (keys, values, pages out, counters), launched
    once for the tests that compare it (they only read it)."""
    key_spec, value_spec = specs(key_axis)
    keys, values = staging(device, 1, kind), staging(device, 2, kind)
    got, counters = run(lowbit_quantize.quantize_staged_kv_counted_layers, keys, values, device, key_spec, value_spec)
    return keys, values, got, counters


@pytest.mark.parametrize("key_axis,kind", [("channel", "spiky"), ("token", "random")])
def test_all_layers_kernel_matches_reference(device, key_axis, kind):
    key_spec, value_spec = specs(key_axis)
    keys, values, got, got_counters = all_layers_kernel(device, key_axis, kind)
    want, want_counters = run(reference.quantize_staged_kv_counted_layers, keys.cpu(), values.cpu(), "cpu",
                              key_spec, value_spec)
    assert torch.equal(got_counters.cpu(), want_counters)
    filled = 3 * HEADS * LAYERS                        # entries 1, 3, 4 (page 4 twice), every head and layer
    assert want_counters[0] == filled and want_counters[3] > 0 and want_counters[4] > 0
    if kind == "spiky":
        assert want_counters[1] > 0                    # the key budget binds somewhere
    if device == "cpu" or key_axis == "channel":       # token axis on a GPU: last-ulp exp2/log2 (see quantize.py)
        assert_same(got, want)
    start = [junk_stack(key_spec, "cpu", 11), junk_stack(value_spec, "cpu", 12)]
    untouched = [p for p in range(NUM_PAGES) if p not in (1, 4)]
    for mine, before in zip(got, start):
        for name, t in before.tensors().items():
            assert torch.equal(mine.tensors()[name].cpu()[:, untouched], t[:, untouched]), name
    # layer l's pages are quantize_pages of layer l's staging slots (3 -> page 4, 2 -> page 1)
    for layer in range(LAYERS):
        expected, _ = reference.quantize_pages(keys.cpu()[layer, [2, 3]].transpose(1, 2), key_spec)
        for name, t in expected.tensors().items():
            assert torch.equal(want[0].tensors()[name][layer, [1, 4]], t), name


def test_all_layers_equals_per_layer_calls(device):
    """One launch for all layers == the one-layer kernel called per layer on the per-layer views."""
    key_spec, value_spec = specs("channel")
    keys, values, got, got_counters = all_layers_kernel(device, "channel", "spiky")

    def per_layer(k, v, slots, pages, ks, vs, k_out, v_out, counters, *indices):
        for layer in range(LAYERS):
            lowbit_quantize.quantize_staged_kv_counted(k[layer], v[layer], slots, pages, ks, vs, k_out.layer(layer),
                                                       v_out.layer(layer), counters, *indices)
    want, want_counters = run(per_layer, keys, values, device, key_spec, value_spec)
    assert torch.equal(got_counters, want_counters) and want_counters[0] == 3 * HEADS * LAYERS
    assert_same(got, want)


def test_all_skipped_writes_nothing_and_adds_nothing(device):
    key_spec, value_spec = specs("token")
    keys, values = staging(device, 5, "random"), staging(device, 6, "random")
    got, counters = run(lowbit_quantize.quantize_staged_kv_counted_layers, keys, values, device, key_spec,
                        value_spec, slots=[-1, 0, 7], pages=[-1, -1, -1])
    assert not counters.any()
    assert_same(got, [junk_stack(key_spec, "cpu", 11), junk_stack(value_spec, "cpu", 12)])


def test_dispatch_is_one_launch_and_matches_the_reference_backend(device, triton_backend, monkeypatch):
    key_spec, value_spec = specs("channel")
    keys, values = staging(device, 7, "spiky"), staging(device, 8, "spiky")
    launches = []
    original = lowbit_quantize._launch_kv
    monkeypatch.setattr(lowbit_quantize, "_launch_kv", lambda *a: (launches.append(a[0].shape[0]), original(*a)))
    got, got_counters = run(dispatch.quantize_staged_kv_counted_layers, keys, values, device, key_spec, value_spec)
    assert launches == [LAYERS]                        # one launch, all layers
    with dispatch.override(backend="reference"):
        want, want_counters = run(dispatch.quantize_staged_kv_counted_layers, keys, values, device, key_spec,
                                  value_spec)
    assert torch.equal(got_counters, want_counters)
    if device == "cpu":
        assert_same(got, want)


def test_bad_shapes_raise(device):
    key_spec, value_spec = specs("channel")
    keys = staging(device, 9, "random")
    outs = [junk_stack(key_spec, device, 1), junk_stack(value_spec, device, 2)]
    counters = torch.zeros(7, dtype=torch.int64, device=device)
    slots, pages = torch.zeros(2, dtype=torch.long, device=device), torch.zeros(2, dtype=torch.long, device=device)
    for module in (lowbit_quantize, reference):
        with pytest.raises(ValueError, match=r"\[L, num_blocks, SB, H, D\]"):
            module.quantize_staged_kv_counted_layers(keys[0], keys[0], slots, pages, key_spec, value_spec, *outs,
                                                     counters, *INDICES)
        with pytest.raises(ValueError, match="layers|expected"):
            module.quantize_staged_kv_counted_layers(keys[:2], keys[:2], slots, pages, key_spec, value_spec, *outs,
                                                     counters, *INDICES)
    with pytest.raises(ValueError, match="counter index"):
        lowbit_quantize.quantize_staged_kv_counted_layers(keys, keys, slots, pages, key_spec, value_spec, *outs,
                                                          counters, (1, 3, 5, 9), INDICES[1])


@pytest.mark.parametrize("num_pages,heads", [(NUM_PAGES, HEADS), (7, 1)])
def test_stacked_pages_are_dense_aligned_layer_views(num_pages, heads):
    key_spec, _ = specs("token")
    stacked = PackedPages.empty(key_spec, num_pages, heads, "cpu", LAYERS)
    single = PackedPages.empty(key_spec, num_pages, heads, "cpu")
    assert stacked.nbytes == LAYERS * single.nbytes
    padded = 0
    for name, t in stacked.tensors().items():        # layer stride: the layer's elements, rounded up to 16 bytes
        per_layer = single.tensors()[name].numel()
        assert 0 <= (t.stride(0) - per_layer) * t.element_size() < LAYER_ALIGN, name
        padded += t.stride(0) > per_layer
    assert padded > 0                                  # scale_base, outlier_count: [N, H] int16/fp16, N * H odd-ish
    for layer in range(LAYERS):
        view = stacked.layer(layer)
        assert view.nbytes == single.nbytes and view.num_pages == num_pages
        for name, t in view.tensors().items():
            assert t.is_contiguous() and t.shape == single.tensors()[name].shape, name
            assert t.data_ptr() == stacked.tensors()[name][layer].data_ptr(), name
            assert t.data_ptr() % LAYER_ALIGN == 0, name
    stacked.layer(1).codes.fill_(7)                    # a write through a view lands in that layer only
    assert (stacked.codes[1] == 7).all() and not stacked.codes[0].any() and not stacked.codes[2].any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bounds checker patches Triton's CPU interpreter")
def test_no_access_outside_the_buffers():
    """Padded layer strides (N * H odd: scale_base, outlier_count rounded up to 16 bytes a layer): every load,
    store and atomic of the all-layers launch stays inside its tensor."""
    from tests.ops.interp_bounds import bounds_checked

    key_spec, value_spec = specs("token")
    shape = (LAYERS, 2, PAGE, 1, DIM)
    keys, values = spiky(shape, torch.float32, 13), spiky(shape, torch.float32, 14)
    outs = [PackedPages.empty(spec, 3, 1, "cpu", LAYERS) for spec in (key_spec, value_spec)]
    assert outs[1].scale_base.stride(0) > 3                     # padded
    counters = torch.zeros(7, dtype=torch.int64)
    with bounds_checked() as checker:
        lowbit_quantize.quantize_staged_kv_counted_layers(keys, values, torch.tensor([1, 0, 0]),
                                                          torch.tensor([2, -1, 0]), key_spec, value_spec, *outs,
                                                          counters, *INDICES)
    assert checker.launches == 1 and checker.checked_ops > 0 and not checker.violations
    assert counters[0] == 2 * LAYERS                             # 2 pages x 1 head x L layers
    for layer in range(LAYERS):                                 # the last layer's pages were written too
        assert outs[1].layer(layer).scale_base[[0, 2]].all() and not outs[1].layer(layer).scale_base[1].any()

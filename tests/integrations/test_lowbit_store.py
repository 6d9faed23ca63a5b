"""LowBitCache's layer state on synthetic keys/values: what is quantized when, exactness against moekv.kv,
crop / batch edits against DynamicCache, and the byte accounting."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from moekv import kv  # noqa: E402
from moekv.integrations.hf_accounting import stored_bytes  # noqa: E402
from moekv.integrations.settings import LowBitCacheSettings  # noqa: E402
from moekv.integrations.transformers import CROP_TAKES_COUNT, LowBitCache  # noqa: E402

B, H, D, PAGE = 2, 2, 32, 16


def _chunks(total: int, sizes=(21, 1, 5, 16, 3, 1, 1, 40, 7)):
    """Random keys/values [B, H, n, D] in uneven chunks adding up to `total` tokens."""
    gen = torch.Generator().manual_seed(0)
    out, done, i = [], 0, 0
    while done < total:
        n = min(sizes[i % len(sizes)], total - done)
        keys = torch.randn(B, H, n, D, generator=gen) + torch.linspace(-3, 3, D)        # channel offsets
        values = torch.randn(B, H, n, D, generator=gen)
        out.append((keys, values))
        done, i = done + n, i + 1
    return out


def _cache(**kwargs) -> LowBitCache:
    kwargs.setdefault("page_size", PAGE)
    kwargs.setdefault("residual_length", PAGE)
    return LowBitCache(None, **kwargs)


def _quantize(x, kind, bits, **settings):
    """What the cache stores for x [tokens, H, D]: moekv.kv.quantize with LowBitCache's defaults."""
    options = dict(page_size=PAGE, outlier_fraction=0.0035, outlier_tau=2.0, group_size=32 if kind == "value" else None)
    if kind == "value":     # LowBitCache's own width default: int4 values min/max (issue 23)
        options["clip_steps"] = LowBitCacheSettings(bits=bits).resolved_value_clip_steps
    options.update(settings)
    return kv.quantize(x, kind=kind, bits=bits, **options)


def _feed(cache, chunks, layer: int = 0):
    outputs = [cache.update(k, v, layer) for k, v in chunks]
    return outputs[-1]


def test_import_moekv_does_not_import_transformers():
    code = "import moekv, moekv.integrations, moekv.kv, sys; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("bad", [dict(bits=5), dict(residual_length=-1), dict(page_size=0),
                                 dict(outlier_fraction=0.9), dict(outlier_tau=0.0)])
def test_settings_are_validated(bad):
    with pytest.raises(ValueError):
        LowBitCache(None, **bad)


def test_width_defaults():
    # issue 23 (docs/kv-fidelity.md): int4 keeps values min/max and fills the outlier slots by range; int3 / int2
    # search the value ranges and fill the slots by deviation; explicit settings win
    resolved = {bits: (LowBitCacheSettings(bits=bits).resolved_value_clip_steps,
                       LowBitCacheSettings(bits=bits).resolved_outlier_select) for bits in (2, 3, 4)}
    assert resolved == {2: (8, "deviation"), 3: (8, "deviation"), 4: (0, "range")}
    chosen = LowBitCacheSettings(bits=4, value_clip_steps=8, outlier_select="deviation")
    assert (chosen.resolved_value_clip_steps, chosen.resolved_outlier_select) == (8, "deviation")
    with pytest.raises(ValueError, match="outlier_select"):
        LowBitCache(None, outlier_select="magnitude")


@pytest.mark.parametrize("dequantized_copy", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantized_part_is_exactly_moekv_kv(bits, dequantized_copy):
    chunks = _chunks(95)
    cache = _cache(bits=bits, dequantized_copy=dequantized_copy)
    _feed(cache, chunks)
    keys_all, values_all = _feed(cache, [(torch.zeros(B, H, 0, D), torch.zeros(B, H, 0, D))])  # commits
    keys = torch.cat([k for k, _ in chunks], dim=-2)
    values = torch.cat([v for _, v in chunks], dim=-2)
    store = cache.layers[0].store
    assert store.length == 95 and store.quantized == 80 and store.window_length == 15
    for b in range(B):
        expected_k = _quantize(keys[b, :, :80].transpose(0, 1), "key", bits)
        expected_v = _quantize(values[b, :, :80].transpose(0, 1), "value", bits)
        torch.testing.assert_close(keys_all[b, :, :80], expected_k.dequantize().transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(values_all[b, :, :80], expected_v.dequantize().transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(keys_all[:, :, 80:95], keys[:, :, 80:], rtol=0, atol=0)      # the window: exact
    torch.testing.assert_close(values_all[:, :, 80:95], values[:, :, 80:], rtol=0, atol=0)


def test_both_modes_return_the_same_cache_every_step():
    copy, nocopy = _cache(bits=3), _cache(bits=3, dequantized_copy=False)
    for k, v in _chunks(150):
        a, b = copy.update(k, v, 0), nocopy.update(k, v, 0)
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    assert copy.working_nbytes > 0 and nocopy.working_nbytes == 0
    assert copy.nbytes == nocopy.nbytes


def test_a_step_attends_to_its_own_tokens_in_full_precision():
    cache = _cache(bits=2)
    keys = torch.randn(B, H, 40, D)
    returned, _ = cache.update(keys, keys, 0)        # quantizes two pages, but this step sees them exact
    torch.testing.assert_close(returned, keys, rtol=0, atol=0)
    assert cache.layers[0].store.quantized == 32
    later, _ = cache.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), 0)
    assert not torch.equal(later[:, :, :32], keys[:, :, :32])
    torch.testing.assert_close(later[:, :, 32:40], keys[:, :, 32:40], rtol=0, atol=0)


@pytest.mark.parametrize("residual_length, window_range", [(0, (0, 15)), (16, (0, 15)), (40, (8, 39))])
def test_window_bounds(residual_length, window_range):
    cache = _cache(residual_length=residual_length)
    for k, v in _chunks(200, sizes=(1,)):
        cache.update(k, v, 0)
        window = cache.layers[0].store.window_length
        if cache.get_seq_length() >= window_range[1] + 1:
            assert window_range[0] <= window <= window_range[1]


@pytest.mark.parametrize("dequantized_copy", [True, False])
@pytest.mark.parametrize("remove", [1, 7, 30, 64, 95])
def test_seq_length_and_crop_follow_dynamic_cache(remove, dequantized_copy):
    ours, theirs = _cache(bits=4, dequantized_copy=dequantized_copy), DynamicCache()
    chunks = _chunks(95)
    for layer in range(2):
        _feed(ours, chunks, layer)
        _feed(theirs, chunks, layer)
    assert ours.get_seq_length() == theirs.get_seq_length() == 95
    before = [t.clone() for t in ours.update(torch.zeros(B, H, 0, D), torch.zeros(B, H, 0, D), 0)]
    ours.crop(-remove)
    theirs.crop(-remove)
    assert ours.get_seq_length() == theirs.get_seq_length() == 95 - remove
    assert ours.get_mask_sizes(3, 0) == (95 - remove + 3, 0)
    after = ours.update(torch.zeros(B, H, 0, D), torch.zeros(B, H, 0, D), 0)
    torch.testing.assert_close(after[0], before[0][:, :, :95 - remove], rtol=0, atol=0)
    # the cache keeps working after a crop: quantization resumes at the right place
    _feed(ours, _chunks(60), 0)
    assert ours.get_seq_length(0) == 155 - remove
    store = ours.layers[0].store
    assert store.quantized % PAGE == 0 and store.window_length < PAGE


def test_crop_right_after_a_step_is_an_exact_rollback():
    """Assisted decoding: rejected draft tokens are cropped; a page they completed must come back exact."""
    chunks = _chunks(60)
    rolled, clean = _cache(bits=2), _cache(bits=2)
    _feed(rolled, chunks)
    _feed(clean, chunks)
    draft = torch.randn(B, H, 10, D)
    rolled.update(draft, draft, 0)              # completes a page (64 -> quantized) ...
    assert rolled.layers[0].store.quantized == 64
    rolled.crop(-10)                            # ... which the crop takes back
    nxt = torch.randn(B, H, 3, D)
    torch.testing.assert_close(rolled.update(nxt, nxt, 0)[0], clean.update(nxt, nxt, 0)[0], rtol=0, atol=0)


def test_positive_crop_follows_the_installed_transformers():
    cache = _cache()
    _feed(cache, _chunks(50))
    if CROP_TAKES_COUNT:                        # transformers 5: like DynamicCache, a positive value raises
        with pytest.raises(ValueError):
            cache.crop(20)
    else:                                       # 4.x: the length to keep
        cache.crop(20)
        assert cache.get_seq_length() == 20


@pytest.mark.parametrize("dequantized_copy", [True, False])
def test_batch_edits_move_whole_sequences(dequantized_copy):
    cache = _cache(bits=3, dequantized_copy=dequantized_copy)
    full = _feed(cache, _chunks(70))
    full = [t.clone() for t in full]
    reference = cache.update(torch.zeros(B, H, 0, D), torch.zeros(B, H, 0, D), 0)[0].clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    swapped = cache.update(torch.zeros(B, H, 0, D), torch.zeros(B, H, 0, D), 0)[0]
    torch.testing.assert_close(swapped, reference[[1, 0]], rtol=0, atol=0)
    cache.batch_repeat_interleave(2)
    assert cache.update(torch.zeros(4, H, 0, D), torch.zeros(4, H, 0, D), 0)[0].shape[0] == 4
    cache.batch_select_indices(torch.tensor([3]))
    one = cache.update(torch.zeros(1, H, 0, D), torch.zeros(1, H, 0, D), 0)[0]
    torch.testing.assert_close(one[0], reference[0], rtol=0, atol=0)
    one_more = cache.update(torch.randn(1, H, 40, D), torch.randn(1, H, 40, D), 0)[0]
    assert one_more.shape == (1, H, 110, D)


def test_reset_empties_the_cache():
    cache = _cache()
    _feed(cache, _chunks(50))
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes == 0
    _feed(cache, _chunks(20))
    assert cache.get_seq_length() == 20


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bytes_and_bits_per_value(bits):
    cache = _cache(bits=bits)
    chunks = _chunks(100)
    _feed(cache, chunks)
    _feed(cache, [(torch.zeros(B, H, 1, D), torch.zeros(B, H, 1, D))])
    keys = torch.cat([k for k, _ in chunks], dim=-2)
    values = torch.cat([v for _, v in chunks], dim=-2)
    quantized = 96
    lowbit = sum(_quantize(keys[b, :, :quantized].transpose(0, 1), "key", bits).nbytes
                 + _quantize(values[b, :, :quantized].transpose(0, 1), "value", bits).nbytes
                 for b in range(B))
    window = 2 * B * H * (101 - quantized) * D * 4                                # fp32 window rows
    assert cache.lowbit_nbytes == lowbit
    assert cache.nbytes == lowbit + window
    assert cache.num_values == 2 * B * H * 101 * D
    assert cache.bits_per_value == pytest.approx(8 * (lowbit + window) / cache.num_values)
    counted = stored_bytes(cache)
    assert counted.total == cache.nbytes and counted.lowbit == lowbit


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bits_per_value_at_the_default_geometry(bits):
    """page 128, head_dim 64: codes + 0.125 (key scale/zero) + 0.25 (value scale/zero codes, groups of 32)
    + 0.113 (0.35% fp16 outliers with 16-bit indices) + scale_base and counts = bits + 0.491."""
    cache = LowBitCache(None, bits=bits)
    x = torch.randn(1, 2, 300, 64, dtype=torch.bfloat16)
    cache.update(x, x.clone(), 0)
    assert cache.layers[0].store.quantized == 256
    expected = cache.settings.expected_lowbit_bits_per_value(head_dim=64)
    assert expected == pytest.approx(bits + 0.491, abs=0.001)
    assert cache.lowbit_bits_per_value == pytest.approx(expected, rel=1e-9)
    window_bits = 16 * 44 / 300                                  # 44 bf16 rows in the window, of 300
    assert cache.bits_per_value == pytest.approx(expected * 256 / 300 + window_bits, rel=1e-9)


def test_expected_bits_per_value_counts_padded_code_words():
    """head_dim 80: an int3 row takes 5 + 3 words (256 bits for 80 codes), not 3 bits per code."""
    cache = LowBitCache(None, bits=3)
    x = torch.randn(1, 2, 300, 80)
    cache.update(x, x.clone(), 0)
    assert cache.lowbit_bits_per_value == pytest.approx(cache.settings.expected_lowbit_bits_per_value(80), rel=1e-9)


def test_value_groups_fall_back_to_head_dim():
    cache = LowBitCache(None, bits=3, page_size=16)
    x = torch.randn(1, 1, 16, 48)                                # 32 does not divide 48
    cache.update(x, x, 0)
    assert cache.settings.resolved_value_group_size(48) == 48
    with pytest.raises(ValueError, match="must divide head_dim"):
        LowBitCache(None, value_group_size=32).settings.resolved_value_group_size(48)


def test_stored_bytes_of_dynamic_and_quantized_caches():
    dynamic = DynamicCache()
    k = torch.randn(1, 2, 300, 64, dtype=torch.bfloat16)
    dynamic.update(k, k, 0)
    assert stored_bytes(dynamic).bits_per_value == 16.0
    pytest.importorskip("optimum.quanto", reason="optimum-quanto not installed (moekv[bench])")
    from transformers import MixtralConfig, QuantizedCache

    config = MixtralConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                           intermediate_size=32, vocab_size=32, num_local_experts=2, head_dim=64)
    cache = QuantizedCache(backend="quanto", config=config, nbits=2)
    cache.update(k, k, 0)                                    # prefill: all quantized
    for _ in range(5):
        cache.update(k[:, :, :1], k[:, :, :1], 0)            # 5 rows in the residual window
    counted = stored_bytes(cache)
    values = 2 * 2 * 300 * 64
    codes = values // 4                                      # 2-bit codes
    scale_and_shift = 2 * (values // 64) * 2                 # bf16 scale + bf16 shift per group of 64
    assert counted.lowbit == codes + scale_and_shift
    assert counted.full_precision == 2 * 2 * 5 * 64 * 2
    assert counted.num_values == 2 * 2 * 305 * 64
    assert counted.lowbit_bits_per_value == pytest.approx(2.5)

"""LowBitCache inside transformers' `generate`: tiny random Mixtral / Qwen3-MoE models built from configs,
and the bundled trained checkpoint (skipped when absent)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from moekv.integrations.transformers import LowBitCache  # noqa: E402
from tests.hf_fixtures import build_hf_model, hf_config  # noqa: E402

PAD = 0
TINY = dict(hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=2, vocab_size=160)
SMALL_PAGES = dict(page_size=8, residual_length=8)          # quantization starts after 8 tokens


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def tiny_model(request):
    return build_hf_model(hf_config(request.param, **TINY), seed=0)


def _left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, max(lengths)], left padding with PAD."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, 160, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def _generate(model, cache, ids, mask, **kwargs):
    kwargs.setdefault("max_new_tokens", 10)
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                          pad_token_id=PAD, **kwargs)


def test_cache_has_one_layer_per_attention_layer(tiny_model):
    cache = LowBitCache(tiny_model.config, bits=3)
    assert len(cache.layers) == tiny_model.config.num_hidden_layers
    assert cache.get_seq_length() == 0 and cache.bits_per_value == 0.0


def test_unsupported_layer_types_are_refused(tiny_model):
    config = tiny_model.config.__class__(**tiny_model.config.to_dict())
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="attention layers only"):
        LowBitCache(config)


def test_batched_left_padded_generate_matches_dynamic_cache_before_quantization(tiny_model):
    """With a window longer than the run nothing is quantized: the output must equal DynamicCache's exactly
    (batch of 3, left padding, attention mask)."""
    ids, mask = _left_padded([5, 17, 11])
    ours = _generate(tiny_model, LowBitCache(tiny_model.config, bits=2, residual_length=1024), ids, mask)
    theirs = _generate(tiny_model, DynamicCache(config=tiny_model.config), ids, mask)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("bits", [2, 4])
def test_batched_left_padded_generate_with_quantized_pages(tiny_model, bits):
    ids, mask = _left_padded([6, 23, 14])
    cache = LowBitCache(tiny_model.config, bits=bits, **SMALL_PAGES)
    out = _generate(tiny_model, cache, ids, mask, max_new_tokens=12)
    reference = _generate(tiny_model, DynamicCache(config=tiny_model.config), ids, mask, max_new_tokens=12)
    assert out.shape == reference.shape == (3, 23 + 12)
    assert torch.equal(out[:, 23], reference[:, 23])      # the prefill attends in full precision
    assert cache.get_seq_length() == 23 + 12 - 1          # the last token is sampled, not cached
    store = cache.layers[0].store
    assert store.quantized == 32 and store.batch_size == 3
    expected = cache.settings.expected_lowbit_bits_per_value(head_dim=16)    # pages of 8: large overheads
    assert cache.lowbit_bits_per_value == pytest.approx(expected, rel=1e-9)
    assert bits + 2.0 < expected < bits + 3.5


def test_beam_search_reorders_the_cache(tiny_model):
    ids, mask = _left_padded([9, 12])
    kwargs = dict(num_beams=2, max_new_tokens=8)
    exact = _generate(tiny_model, LowBitCache(tiny_model.config, residual_length=1024), ids, mask, **kwargs)
    theirs = _generate(tiny_model, DynamicCache(config=tiny_model.config), ids, mask, **kwargs)
    assert torch.equal(exact, theirs)
    quantized = _generate(tiny_model, LowBitCache(tiny_model.config, bits=4, **SMALL_PAGES), ids, mask, **kwargs)
    assert quantized.shape == theirs.shape


def test_no_dequantized_copy_gives_the_same_tokens(tiny_model):
    ids, mask = _left_padded([7, 19])
    copy = _generate(tiny_model, LowBitCache(tiny_model.config, bits=3, **SMALL_PAGES), ids, mask)
    nocopy = _generate(tiny_model, LowBitCache(tiny_model.config, bits=3, dequantized_copy=False, **SMALL_PAGES),
                       ids, mask)
    assert torch.equal(copy, nocopy)

"""Incremental detokenization on the bundled tokenizer: deltas add up to the full decode."""

from __future__ import annotations

import random

import pytest

from moekv.datasets import validation_slice
from moekv.paths import default_model_dir
from moekv.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model_dir())


def stream(tokenizer, token_ids):
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in token_ids]
    return "".join(deltas), detok


def test_deltas_add_up_to_the_full_decode(tokenizer):
    ids = tokenizer.encode(validation_slice()[:20000], add_special_tokens=False)
    rng = random.Random(0)
    for trial in range(10):
        start = rng.randrange(0, len(ids) - 300)
        seq = ids[start:start + 300]
        if trial % 2:
            seq = seq[:50] + [tokenizer.eos_token_id] + seq[50:]       # a special token is skipped
        streamed, detok = stream(tokenizer, seq)
        assert streamed == detok.text == tokenizer.decode(seq)


def test_multibyte_characters_are_not_split(tokenizer):
    text = "ROMEO: café — naïve ✓ 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    streamed, _ = stream(tokenizer, ids)
    assert streamed == tokenizer.decode(ids) == text
    assert "\ufffd" not in streamed

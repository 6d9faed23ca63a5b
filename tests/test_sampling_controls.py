"""The sampling controls (penalties, min_tokens, logit_bias, grammar bitmask, batched top-k/top-p, best_of's
sampled log-probability): the batched tensor version against a per-row reference in plain Python."""

from __future__ import annotations

import math
import random

import pytest
import torch

from moekv.errors import InvalidRequestError
from moekv.sampling import (SamplingInputs, SamplingParams, filter_logits, filter_logits_batch, process_logits,
                            process_logits_reference, sample, unpack_bitmask)

VOCAB = 70


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["presence", "frequency", "repetition", "bias", "min_tokens", "all", "none"])
    kw = {}
    if kind in ("presence", "all"):
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if kind in ("frequency", "all"):
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if kind in ("repetition", "all"):
        kw["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    if kind in ("bias", "all"):
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(3)}
    if kind in ("min_tokens", "all"):
        kw["min_tokens"] = rng.randrange(1, 8)
        kw["stop_token_ids"] = [rng.randrange(VOCAB)]
    return SamplingParams(max_tokens=16, temperature=rng.choice([0.0, 0.7]), **kw)


def random_bitmask(rows: int, allowed: list[list[int] | None]) -> torch.Tensor:
    words = (VOCAB + 31) // 32
    mask = torch.full((rows, words), -1, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        if tokens is None:
            continue
        bits = [0] * (words * 32)
        for t in tokens:
            bits[t] = 1
        for w in range(words):
            value = sum(bits[w * 32 + j] << j for j in range(32))
            mask[row, w] = value - (1 << 32) if value >= 1 << 31 else value
    return mask


@pytest.mark.parametrize("seed", range(6))
def test_process_logits_matches_the_reference(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = 9
    logits = torch.randn(rows, VOCAB) * 3
    logits[0, :5] = 0.0                          # adversarial: zeros (repetition penalty's sign split)
    params = [random_params(rng) for _ in range(rows)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    outputs = [[rng.randrange(8) for _ in range(rng.randrange(0, 10))] for _ in range(rows)]   # repeats
    eos = (1, 2)
    allowed = [None if rng.random() < 0.4 else rng.sample(range(VOCAB), rng.randrange(1, 6)) for _ in range(rows)]
    allowed[1] = [1]                             # the grammar allows only EOS: a min_tokens ban must yield
    params[1] = SamplingParams(max_tokens=16, min_tokens=5)
    outputs[1] = []
    bitmask = random_bitmask(rows, allowed)
    got = process_logits(logits, params, SamplingInputs(prompts, outputs, eos, bitmask))
    for row in range(rows):
        want = process_logits_reference(logits[row], params[row], prompts[row], outputs[row], eos, allowed[row])
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got[1, 1]) and int(torch.isfinite(got[1]).sum()) == 1


def test_each_control_changes_what_it_should():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    out = [4, 4, 1]
    inputs = SamplingInputs([[3]], [out], (0,))
    freq = process_logits(logits, [SamplingParams(frequency_penalty=0.5)], inputs)[0]
    assert freq.tolist() == pytest.approx([1.0, 1.5, -1.0, 0.5, 2.0])
    pres = process_logits(logits, [SamplingParams(presence_penalty=0.5)], inputs)[0]
    assert pres.tolist() == pytest.approx([1.0, 1.5, -1.0, 0.5, 2.5])
    rep = process_logits(logits, [SamplingParams(repetition_penalty=2.0)], inputs)[0]
    assert rep.tolist() == pytest.approx([1.0, 1.0, -1.0, 0.25, 1.5])     # prompt token 3 counts too
    bias = process_logits(logits, [SamplingParams(logit_bias={2: 10.0, "0": -5})], inputs)[0]
    assert bias.tolist() == pytest.approx([-4.0, 2.0, 9.0, 0.5, 3.0])
    ban = process_logits(logits, [SamplingParams(min_tokens=4, stop_token_ids=[4])], inputs)[0]
    assert math.isinf(ban[0]) and math.isinf(ban[4]) and ban[1:4].tolist() == [2.0, -1.0, 0.5]
    done = process_logits(logits, [SamplingParams(min_tokens=3, stop_token_ids=[4])], inputs)[0]
    assert done.tolist() == logits[0].tolist()                             # 3 generated: no ban left


@pytest.mark.parametrize("seed", range(5))
def test_filter_logits_batch_matches_per_row(seed):
    torch.manual_seed(seed)
    rows = 12
    logits = torch.randn(rows, VOCAB)
    logits[0] = 1.0                              # all ties
    logits[1, 10:] = float("-inf")               # a masked row
    top_k = torch.randint(-1, VOCAB + 3, (rows,))
    top_p = torch.rand(rows).clamp(min=0.05)
    top_p[::3] = 1.0
    got = filter_logits_batch(logits, top_k, top_p)
    for row in range(rows):
        want = filter_logits(logits[row], int(top_k[row]), float(top_p[row]))
        assert torch.equal(torch.isfinite(got[row]), torch.isfinite(want)), row
        torch.testing.assert_close(got[row][torch.isfinite(want)], want[torch.isfinite(want)])


def test_unpack_bitmask_matches_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    torch.manual_seed(0)
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (4, 3), dtype=torch.int32)
    logits = torch.randn(4, VOCAB)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=VOCAB)
    got = logits.masked_fill(~unpack_bitmask(bitmask, VOCAB), float("-inf"))
    assert torch.equal(got, want)


def test_sample_greedy_follows_bias_and_ban():
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0]])
    inputs = SamplingInputs([[9]], [[]], (0,))
    assert sample(logits, [SamplingParams(temperature=0)], [None], inputs).token_ids == [0]
    assert sample(logits, [SamplingParams(temperature=0, min_tokens=1)], [None], inputs).token_ids == [1]
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={3: 6.0})], [None], inputs).token_ids == [3]


def test_sampling_respects_the_grammar_mask_and_best_of_logprob():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    allowed = [[3, 40, 65], None, [7]]
    inputs = SamplingInputs([[], [], []], [[], [], []], (), random_bitmask(3, allowed))
    params = [SamplingParams(temperature=1.0, n=1, best_of=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_k=3)]
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    for _ in range(50):
        result = sample(logits, params, gens, inputs)
        assert result.token_ids[0] in allowed[0] and result.token_ids[2] == 7
        assert result.token_ids[1] == int(logits[1].argmax())
        want = float(torch.log_softmax(logits[0], -1)[result.token_ids[0]])
        assert result.sampled_logprobs[0] == pytest.approx(want) and result.sampled_logprobs[1] is None


def test_penalties_follow_the_distribution():
    """frequency_penalty reweights probabilities by exp(-penalty * count): the draw follows it."""
    logits = torch.zeros(1, 3)
    inputs = SamplingInputs([[]], [[0, 0]], ())
    params = SamplingParams(temperature=1.0, frequency_penalty=1.0)
    gen = torch.Generator().manual_seed(3)
    draws = [sample(logits, [params], [gen], inputs).token_ids[0] for _ in range(3000)]
    expected = math.exp(-2) / (math.exp(-2) + 2)
    assert abs(draws.count(0) / 3000 - expected) < 0.02


@pytest.mark.parametrize("kwargs, param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias={3: 101}), "logit_bias"),
    (dict(n=0), "n"), (dict(n=3, best_of=2), "best_of"), (dict(best_of=2, temperature=0), "best_of"),
])
def test_new_controls_are_validated(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_incremental_penalty_counts_match_the_lists():
    """engine/sampling_step.py keeps the counts on the device and adds only new tokens: same as rebuilding."""
    from moekv.core.request import Request
    from moekv.engine.sampling_step import SamplingStep
    from moekv.sampling import penalty_counts

    rng = random.Random(0)
    step = SamplingStep(None, VOCAB, {1})
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(frequency_penalty=0.5),
              SamplingParams(presence_penalty=1.0, repetition_penalty=0.8)]
    requests = [Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(5 + i)], p, detokenizer=None)
                for i, p in enumerate(params)]
    for turn in range(6):
        for request in requests:
            request.output_token_ids += [rng.randrange(6) for _ in range(rng.randrange(0, 3))]
        batch = requests if turn % 2 == 0 else requests[::2]       # a row may sit out a step
        seen, counts = step.penalty_counts(batch, torch.device("cpu"))
        want_seen, want_counts = penalty_counts([r.params for r in batch], [r.prompt_token_ids for r in batch],
                                                [r.output_token_ids for r in batch], VOCAB, "cpu")
        assert torch.equal(seen, want_seen) and torch.equal(counts, want_counts)

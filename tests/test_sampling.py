"""SamplingParams validation and the sampler: filtering keeps exactly the right tokens, seeds reproduce."""

from __future__ import annotations

import math

import pytest
import torch

from moekv.errors import InvalidRequestError
from moekv.sampling import SamplingParams, filter_logits, sample, top_logprobs


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(logprobs=-1), "logprobs must be an integer >= 0"),
    (dict(top_k=-2), "top_k must be -1"),
    (dict(stop=[""]), "stop must be"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
    assert info.value.param == next(iter(kwargs))


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.0, 2.5, 0.0])
    kept = torch.isfinite(filter_logits(logits, top_k=3, top_p=1.0)).nonzero().flatten().tolist()
    assert kept == [1, 3, 4]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # 0.5 < 0.7 -> the token at 0.3 crosses 0.7 and is kept; the rest dropped
    kept = torch.isfinite(filter_logits(logits, top_k=-1, top_p=0.7)).nonzero().flatten().tolist()
    assert kept == [0, 1]
    kept = torch.isfinite(filter_logits(logits, top_k=-1, top_p=0.5)).nonzero().flatten().tolist()
    assert kept == [0]
    kept = torch.isfinite(filter_logits(logits, top_k=-1, top_p=0.96)).nonzero().flatten().tolist()
    assert kept == [0, 1, 2, 3]


def test_top_k_then_top_p():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=0.6)).nonzero().flatten().tolist()
    # after top-2 the renormalised probs are 4/7 and 3/7: 4/7 < 0.6, so both stay
    assert kept == [0, 1]


def test_sampled_tokens_stay_inside_the_filter():
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, top_k=5)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert sample(logits, [params], [gen]).token_ids[0] in allowed


def test_seeded_generators_reproduce_and_differ_by_seed():
    logits = torch.randn(1, 1000)
    params = SamplingParams(temperature=1.0)

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return [sample(logits, [params], [gen]).token_ids[0] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().unsqueeze(0)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams()], [gen]).token_ids[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_greedy_and_logprobs():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=2)], [None])
    assert out.token_ids == [1]
    expected = torch.log_softmax(logits[0], -1)
    assert set(out.logprobs[0]) == {1, 3}
    assert math.isclose(out.logprobs[0][3], float(expected[3]), rel_tol=1e-6)
    # the sampled token is always included even when outside the top-n
    assert set(top_logprobs(logits[0], 0, 1)) == {1, 0}

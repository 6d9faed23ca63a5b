"""The offline API end to end on tiny random transformers checkpoints: greedy tokens and
log-probabilities agree with transformers; ragged batches; boundary errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from moekv import LLM, SamplingParams  # noqa: E402
from moekv.errors import InvalidRequestError, ModelLoadError  # noqa: E402
from tests.hf_fixtures import hf_greedy, make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    folder, hf_model = make_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral")
    return folder, hf_model


def test_greedy_ragged_batch_matches_transformers(mixtral):
    folder, hf_model = mixtral
    llm = LLM(model=str(folder), dtype="fp32", device="cpu", page_size=4)
    prompts = [[5, 17, 33, 9, 100, 3, 44], [7], [12, 13, 14]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)
        assert out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == prompt
    assert llm.engine.kv_manager.usage == 0.0


def test_logprobs_match_transformers(mixtral):
    folder, hf_model = mixtral
    llm = LLM(model=str(folder), dtype="fp32", device="cpu")
    prompt = [3, 30, 60, 90]
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=4, ignore_eos=True))[0]
    tokens = out.outputs[0].token_ids
    assert len(out.outputs[0].logprobs) == 3
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].float()
    for step, entry in enumerate(out.outputs[0].logprobs):
        expected = torch.log_softmax(logits[len(prompt) - 1 + step], dim=-1)
        top = torch.topk(expected, 4).indices.tolist()
        assert set(entry) == set(top) | {tokens[step]}
        for token, value in entry.items():
            assert abs(value - float(expected[token])) < 1e-4


def test_sampled_generation_is_seeded(mixtral):
    folder, _ = mixtral
    llm = LLM(model=str(folder), dtype="fp32", device="cpu", seed=3)
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    first = llm.generate([[4, 5, 6]], params)[0].outputs[0].token_ids
    second = llm.generate([[4, 5, 6]], params)[0].outputs[0].token_ids
    assert first == second and len(first) == 6


def test_prompt_longer_than_max_model_len(mixtral):
    folder, _ = mixtral
    llm = LLM(model=str(folder), dtype="fp32", device="cpu", max_model_len=16)
    with pytest.raises(InvalidRequestError, match="the prompt is 20 tokens; max_model_len=16"):
        llm.generate([[1] * 20])
    # a bad prompt in a batch queues nothing: the good one is not left behind
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2], [1] * 20])
    assert not llm.engine.has_unfinished() and llm.engine.requests == {}


def test_empty_prompt_and_string_without_tokenizer(mixtral):
    folder, _ = mixtral
    llm = LLM(model=str(folder), dtype="fp32", device="cpu")
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        llm.generate([[]])
    with pytest.raises(InvalidRequestError, match="no tokenizer.json"):
        llm.generate(["hello"])


def test_unknown_keyword_and_missing_model(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        LLM(model=str(tmp_path), bogus=1)
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"), device="cpu")

"""The sampling controls through the offline API on a mock model (next token = token + 1, logit 10 against
-10 for every other token): n and best_of fan-out, min_tokens, logit_bias, penalties, LLM.chat."""

from __future__ import annotations

import math

import pytest

from moekv.engine.engine import Engine
from moekv.entrypoints.llm import LLM
from moekv.errors import InvalidRequestError
from moekv.sampling import SamplingParams
from tests.mock_model import MockModel, mock_arch, mock_engine_config

VOCAB, EOS = 64, 5


def mock_llm(tokenizer=None, vocab: int = VOCAB) -> LLM:
    config = mock_engine_config(max_model_len=64, num_pages=128, max_num_seqs=16, max_num_batched_tokens=128)
    llm = LLM.__new__(LLM)
    llm.engine = Engine(config, model=MockModel(mock_arch(vocab_size=vocab, eos_token_ids=(EOS,))),
                        tokenizer=tokenizer)
    return llm


def mock_logprob(prev: int, token: int, temperature_free: bool = True) -> float:
    """log-softmax of the mock's raw logits (10 at prev + 1, -10 elsewhere) at `token`."""
    norm = math.log(math.exp(10) + (VOCAB - 1) * math.exp(-10))
    return (10.0 if token == (prev + 1) % VOCAB else -10.0) - norm


def test_n_returns_n_sequences_and_seeds_them_apart():
    llm = mock_llm()
    out = llm.generate([[10]], SamplingParams(max_tokens=6, temperature=30.0, n=3, seed=7))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    again = llm.generate([[10]], SamplingParams(max_tokens=6, temperature=30.0, seed=8))[0]
    assert again.outputs[0].token_ids == out.outputs[1].token_ids      # sequence j uses seed + j
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    assert llm.engine.requests == {}


def test_best_of_keeps_the_n_most_likely():
    llm = mock_llm()
    params = dict(max_tokens=5, temperature=30.0, seed=3, ignore_eos=True)
    every = llm.generate([[10]], SamplingParams(n=4, **params))[0].outputs
    best = llm.generate([[10]], SamplingParams(n=2, best_of=4, **params))[0].outputs

    def score(tokens):
        prev, total = 10, 0.0
        for token in tokens:
            total, prev = total + mock_logprob(prev, token), token
        return total

    ranked = sorted(every, key=lambda o: -score(o.token_ids))[:2]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked]
    for o in best:
        assert o.cumulative_logprob == pytest.approx(score(o.token_ids), rel=1e-5)


def test_min_tokens_bans_eos_until_reached():
    llm = mock_llm()
    plain = llm.generate([[EOS - 1]], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert plain.token_ids == [EOS] and plain.finish_reason == "stop"
    held = llm.generate([[EOS - 1]], SamplingParams(max_tokens=8, temperature=0, min_tokens=3))[0].outputs[0]
    assert len(held.token_ids) >= 3 and EOS not in held.token_ids[:3]


def test_logit_bias_and_presence_penalty_reach_the_sampler():
    llm = mock_llm()
    biased = SamplingParams(max_tokens=4, temperature=0, logit_bias={9: 21.0})
    assert llm.generate([[20]], biased)[0].outputs[0].token_ids == [9, 9, 9, 9]    # 11 beats the peak's 10
    penalised = SamplingParams(max_tokens=4, temperature=0, logit_bias={9: 21.0}, presence_penalty=2.0)
    assert llm.generate([[20]], penalised)[0].outputs[0].token_ids == [9, 10, 11, 12]
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[20]], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert llm.engine.requests == {}


def test_chat_renders_with_the_template(tmp_path):
    from moekv.tokenizer import Tokenizer
    from tests.entrypoints.openai.helpers import write_char_tokenizer

    tokenizer = Tokenizer(write_char_tokenizer(tmp_path))
    llm = mock_llm(tokenizer, vocab=tokenizer.vocab_size)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0))
    assert out[0].prompt == "<user>hi\n<assistant>"
    assert out[0].outputs[0].text == "?@A"                      # '>' + 1, + 2, + 3
    two = llm.chat([[{"role": "user", "content": "a"}], [{"role": "system", "content": "b"}]],
                   SamplingParams(max_tokens=1, temperature=0))
    assert [o.prompt for o in two] == ["<user>a\n<assistant>", "<system>b\n<assistant>"]


def test_chat_passes_tools_to_the_template(tmp_path):
    from moekv.tokenizer import Tokenizer
    from tests.entrypoints.openai.helpers import write_char_tokenizer

    template = ("{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    tokenizer = Tokenizer(write_char_tokenizer(tmp_path, chat_template=template))
    llm = mock_llm(tokenizer, vocab=tokenizer.vocab_size)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "get_time"}}]
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), tools=tools)
    assert out[0].prompt == "[get_weather,get_time]<user>hi<assistant>"
    assert tokenizer.template_renders_tools() and not Tokenizer(
        write_char_tokenizer(tmp_path / "plain")).template_renders_tools()


def test_structured_outputs_without_xgrammar_is_the_requests_error(monkeypatch, tmp_path):
    import moekv.structured
    from moekv.sampling import StructuredOutputParams
    from moekv.tokenizer import Tokenizer
    from tests.entrypoints.openai.helpers import write_char_tokenizer

    monkeypatch.setattr(moekv.structured, "xgrammar_available", lambda: False)
    tokenizer = Tokenizer(write_char_tokenizer(tmp_path))
    llm = mock_llm(tokenizer, vocab=tokenizer.vocab_size)
    with pytest.raises(InvalidRequestError, match="xgrammar") as info:
        llm.generate(["a"], SamplingParams(structured_outputs=StructuredOutputParams(json_object=True)))
    assert info.value.param == "structured_outputs" and llm.engine.requests == {}

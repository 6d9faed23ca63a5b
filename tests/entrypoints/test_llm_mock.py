"""LLM.generate around an engine with a mock model (no checkpoint)."""

from __future__ import annotations

import pytest

from moekv.engine.engine import Engine
from moekv.entrypoints.llm import LLM
from moekv.sampling import SamplingParams
from tests.mock_model import MockModel, mock_engine_config


def mock_llm() -> LLM:
    llm = LLM.__new__(LLM)
    llm.engine = Engine(mock_engine_config(max_model_len=64, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64),
                        model=MockModel())
    return llm


def test_generate_that_fails_mid_run_leaves_no_request_behind():
    llm = mock_llm()
    engine = llm.engine
    execute = engine.runner.execute
    calls = []

    def failing(sched):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return execute(sched)

    engine.runner.execute = failing
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2], [10]], params)
    assert engine.requests == {} and not engine.has_unfinished()
    assert engine.kv_manager.usage == 0.0
    # The next call runs only its own prompts.
    out = llm.generate([[20]], params)
    assert out[0].outputs[0].token_ids == list(range(21, 29))
    assert len(calls) == 2 + 1 + 8

"""Scheduler limits at the boundary: a token budget smaller than the number of running sequences is a
config error (each running sequence decodes one token per step; with fewer tokens the last admitted ones
would wait while the first ones decode); at budget == max_num_seqs every running sequence decodes every
step, also while a long prompt waits to be chunked in."""

from __future__ import annotations

import pytest

from moekv import LLM
from moekv.config import SchedulerConfig
from moekv.errors import ConfigError
from moekv.paths import default_model_dir
from moekv.sampling import SamplingParams
from tests.engine.test_engine_mock import GREEDY, make_engine


def test_budget_below_max_num_seqs_is_rejected():
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ConfigError, match="must be >= max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=128)              # default max_num_seqs 256
    assert SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8).max_num_batched_tokens == 8


def test_llm_rejects_the_starving_config_before_loading():
    with pytest.raises(ConfigError, match="must be >= max_num_seqs"):
        LLM(model=default_model_dir(), dtype="fp32", device="cpu", max_model_len=64, max_num_seqs=4,
            max_num_batched_tokens=2, cuda_graphs=False)


def test_every_running_sequence_decodes_every_step_at_the_smallest_budget():
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=4, num_pages=128)
    ids = [engine.add_request([i + 1], SamplingParams(max_tokens=12, **GREEDY)) for i in range(4)]
    engine.step()                                                 # the four 1-token prompts
    long_prompt = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=2, **GREEDY))
    for _ in range(6):
        outs = {o.request_id: o for o in engine.step()}
        assert set(ids) <= set(outs), "a running sequence did not decode this step"
        assert all(len(outs[i].new_token_ids) == 1 for i in ids)
    assert engine.requests[long_prompt].num_computed_tokens == 0  # waits for a free sequence slot

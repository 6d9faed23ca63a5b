"""benchmarks/decode_steps.py: step kinds from the running sequences' positions, and timed steps on the CPU
(no graphs: no replay time; the kinds and the step count still hold)."""

from __future__ import annotations

import types

import torch

from benchmarks.decode_steps import step_kinds, time_steps
from moekv import LLM, SamplingParams
from moekv.paths import default_model_dir


def _engine(positions, page):
    running = [types.SimpleNamespace(num_computed_tokens=p) for p in positions]
    return types.SimpleNamespace(kv_manager=types.SimpleNamespace(page_size=page),
                                 scheduler=types.SimpleNamespace(running=running))


def test_step_kinds():
    # a token at offset page-1 fills its page, one at offset 0 opens one; fill wins when both happen
    assert step_kinds(_engine([5], 8), 5) == ["ordinary", "ordinary", "fill", "start", "ordinary"]
    assert step_kinds(_engine([7, 3], 4), 3) == ["fill", "start", "ordinary"]
    kinds = step_kinds(_engine([0], 128), 300)
    assert kinds.count("fill") == 2 and kinds.count("start") == 3 and kinds[127] == "fill"


def test_time_steps_on_the_cpu():
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype="int3", device="cpu", page_size=8,
              max_model_len=128, max_num_seqs=2, cuda_graphs=False)
    engine = llm.engine
    assert engine.runner.enable_graphs(capture=False)
    for prompt in ([5, 17, 33], [7, 8, 9, 10, 11]):
        engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()
    row = time_steps(engine, 12, torch.device("cpu"))
    assert row["graph_replay_ms"] is None and row["outside_graph_ms"] is None and row["graph_replays"] == 0
    assert row["tpot_ms"] > 0 and row["step_ms_median"] > 0
    kinds = row["by_kind"]
    assert sum(k["steps"] for k in kinds.values()) == 12
    assert kinds["fill"]["steps"] == 3 and kinds["start"]["steps"] == 3 and kinds["ordinary"]["steps"] == 6

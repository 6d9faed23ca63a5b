"""benchmarks/decode_steps.py: step kinds from the running sequences' positions, and timed steps on the CPU
(no graphs: no replay time; the kinds and the step count still hold, with overlapped steps too); bench_decode's
--overlap rows."""

from __future__ import annotations

import json
import types

import pytest
import torch

from benchmarks import bench_decode
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


@pytest.mark.parametrize("overlap", [False, True])
def test_time_steps_on_the_cpu(overlap):
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype="int3", device="cpu", page_size=8,
              max_model_len=128, max_num_seqs=2, cuda_graphs=False)
    engine = llm.engine
    assert engine.runner.enable_graphs(capture=False)
    assert not overlap or engine.enable_overlap()
    for prompt in ([5, 17, 33], [7, 8, 9, 10, 11]):
        engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()
    row = time_steps(engine, 12, torch.device("cpu"))
    assert row["graph_replay_ms"] is None and row["outside_graph_ms"] is None and row["graph_replays"] == 0
    assert row["tpot_ms"] > 0 and row["step_ms_median"] > 0
    kinds = row["by_kind"]
    assert sum(k["steps"] for k in kinds.values()) == 12
    assert kinds["fill"]["steps"] == 3 and kinds["start"]["steps"] == 3 and kinds["ordinary"]["steps"] == 6
    if overlap:        # the first timed step builds bucket 2 (synchronous), the second is launched, then 10 behind it
        stats = engine.overlap.stats
        assert stats["launched"] == 11 and stats["overlapped"] == 10 and stats["idle_waits"] == 0


def test_bench_decode_overlap_rows(tmp_path):
    """--overlap on,off: one row each, tagged; on the CPU no step runs through a graph, so the "on" row says it ran
    synchronously. Each row's engine takes its routing hook off the shared model (a later row's engine would
    run it eagerly before every replay)."""
    from benchmarks import decode_moekv

    built = []
    make_engine = decode_moekv.make_engine

    def tracked(model, *args, **kwargs):
        built.append(model)
        return make_engine(model, *args, **kwargs)
    decode_moekv.make_engine = tracked
    try:
        assert bench_decode.main(["--tiny", "--no-hf", "--scenarios", "1x32:bf16", "--moe-tokens", "", "--steps", "1",
                                  "--warmup", "0", "--profile-steps", "1", "--overlap", "on,off",
                                  "--out", str(tmp_path)]) == 0
    finally:
        decode_moekv.make_engine = make_engine
    result = json.loads(next(tmp_path.glob("decode-bench-*.json")).read_text())
    assert [(r["system"], r["overlap"]) for r in result["decode"]] == [("moekv", "off (no graph steps)"),
                                                                       ("moekv", "off")]
    assert not result["errors"] and len(built) == 2 and not built[0]._forward_pre_hooks
    md = next(tmp_path.glob("decode-bench-*.md")).read_text()
    assert "| off (no graph steps) |" in md and "| off |" in md and "overlap |" in md
    with pytest.raises(SystemExit):
        bench_decode.main(["--tiny", "--overlap", "yes"])


def test_a_row_refuses_to_start_beside_an_earlier_rows_cache():
    """bench_decode rows: a KV cache still alive from an earlier row (session 20: the "off" row's 28.9 GiB beside the
    B=64 "on" row's, an out-of-memory blamed on overlap) stops the next row with a clear error; once it is gone the
    row starts."""
    from benchmarks import decode_moekv

    class Cache:
        num_pages = 8385

    cache = Cache()
    decode_moekv._ROW_CACHES.add(cache)
    with pytest.raises(RuntimeError, match=r"earlier row's KV cache\(s\) \(8385 pages\) still alive"):
        decode_moekv.check_rows_freed(torch.device("cpu"))
    del cache
    decode_moekv.check_rows_freed(torch.device("cpu"))

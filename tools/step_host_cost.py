"""Host cost of a graph decode step outside its forward, on any device: the engine in static graph mode with
each bucket's forward replaced by a no-op "replay" (the captured graph's place), synthetic KV at a long
context, wall time per step by perf_counter and the cache hooks' share (begin_step, end_step).

    PYTHONPATH=src:. python3 tools/step_host_cost.py --kv bf16,int3 --context 16384 --batch 1,64 --steps 400

The numbers are this machine's host time, not the GPU's: on a GPU they add to the graph replay at B=1 (the step
waits for its one host read, so nothing overlaps). tests/engine/test_graph_step_work.py counts the same step's
device ops, copies, host reads and event waits.
"""
import argparse
import statistics
import time
import types

import torch

from benchmarks import bench_decode
from benchmarks.decode_moekv import make_engine
from benchmarks.synthetic_kv import admit_with_context
from moekv.models.loader import build_random_model
from moekv.models.registry import named_arch


class _NoReplay:
    def replay(self) -> None:
        pass


def measure(model, kv: str, batch: int, context: int, steps: int) -> dict:
    args = types.SimpleNamespace(page_size=None, model="mixtral-8x7b", prefill_chunk=max(context, batch))
    engine = make_engine(model, batch, context, kv, steps + 16, args, graphs=False)
    runner, cache = engine.runner, engine.kv_cache
    assert runner.enable_graphs(capture=False), runner.graph_fallback_reason
    admit_with_context(engine, batch, context, steps + 16, model.arch.vocab_size, seed=0)
    engine.step()                                # builds the bucket (one static forward)
    for bucket in runner._buckets.values():
        bucket.logits = torch.zeros(bucket.size, model.arch.vocab_size)
        bucket.graph = _NoReplay()
    hooks = {"begin_step": 0.0, "end_step": 0.0}
    for name in hooks:
        original = getattr(cache, name)

        def timed(*a, _original=original, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                hooks[_name] += time.perf_counter() - t0
        setattr(cache, name, timed)
    for _ in range(8):
        engine.step()
    for name in hooks:
        hooks[name] = 0.0
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    return {"kv": kv, "batch": batch, "page": engine.kv_manager.page_size, "mean_us": 1e6 * sum(walls) / steps,
            "median_us": 1e6 * statistics.median(walls),
            **{f"{k}_us": 1e6 * v / steps for k, v in hooks.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv", default="bf16,int3")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", default="1")
    p.add_argument("--steps", type=int, default=400)
    a = p.parse_args()
    arch = named_arch("mixtral-8x7b", **{**bench_decode.TINY_ARCH, "head_dim": 128, "hidden_size": 256,
                                          "max_position_embeddings": max(4096, 2 * a.context)})
    model = build_random_model(arch, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0)
    print("| KV | B | page | step us (mean) | step us (median) | begin_step us | end_step us |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in a.batch.split(",")):
        for kv in a.kv.split(","):
            r = measure(model, kv, batch, a.context, a.steps)
            print(f"| {r['kv']} | {r['batch']} | {r['page']} | {r['mean_us']:.1f} | {r['median_us']:.1f} | "
                  f"{r['begin_step_us']:.1f} | {r['end_step_us']:.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""Host cost of a graph decode step outside its forward, on any device: the engine in static graph mode with
each bucket's forward replaced by a no-op "replay" (the captured graph's place), synthetic KV at a long
context, wall time per step by perf_counter and the cache hooks' share (begin_step, end_step), with and
without overlapped decode steps (DeviceConfig.overlap_decode, engine/overlap.py).

    PYTHONPATH=src:. python3 tools/step_host_cost.py --kv bf16,int3 --context 16384 --batch 1,64 --steps 400
    PYTHONPATH=src:. python3 tools/step_host_cost.py --kv bf16,int3 --batch 1,64 --overlap off,on

The numbers are this machine's host time, not the GPU's. Synchronously they add to the graph replay at B=1:
the step waits for its one host read, so nothing overlaps; "exposed" is the host time from a step's read-back
to the next step's replay, all of which the GPU would idle. Overlapped, the next step's replay is launched
before the read-back, so no host time is exposed while a step's host work (the mean) stays below the GPU's
step time; "idle waits" counts read-backs with no later step queued (the GPU idles after them).
tests/engine/test_graph_step_work.py counts the same step's device ops, copies, host reads and event waits.
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
    def __init__(self, marks: list[float]):
        self.marks = marks

    def replay(self) -> None:
        self.marks.append(time.perf_counter())


def measure(model, kv: str, batch: int, context: int, steps: int, overlap: bool = False) -> dict:
    args = types.SimpleNamespace(page_size=None, model="mixtral-8x7b", prefill_chunk=max(context, batch))
    engine = make_engine(model, batch, context, kv, steps + 16, args, graphs=False)
    runner, cache = engine.runner, engine.kv_cache
    assert runner.enable_graphs(capture=False), runner.graph_fallback_reason
    assert not overlap or engine.enable_overlap()
    admit_with_context(engine, batch, context, steps + 16, model.arch.vocab_size, seed=0)
    engine.step()                                # builds the bucket (one static forward)
    replays, reads, idle = [], [], [0]
    for bucket in runner._buckets.values():
        bucket.logits = torch.zeros(bucket.size, model.arch.vocab_size)
        bucket.graph = _NoReplay(replays)
    collect = runner.collect_graph

    def collected(step):
        idle[0] += not [s for s in runner._in_flight if s is not step]
        try:
            return collect(step)
        finally:
            reads.append(time.perf_counter())
    runner.collect_graph = collected
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
    replays.clear()
    reads.clear()
    idle[0] = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    # the read-back of each step and the replay of the step after it: synchronously the next call's, overlapped
    # the same call's, launched before the read (the first timed read is of the step launched before the loop)
    gaps = [r - t for t, r in zip(reads, replays if overlap else replays[1:])]
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.routing.remove_hooks()            # the model is shared: the next engine must not run this one's hook
    return {"kv": kv, "batch": batch, "page": engine.kv_manager.page_size, "overlap": overlap,
            "mean_us": 1e6 * sum(walls) / steps, "median_us": 1e6 * statistics.median(walls),
            "exposed_us": 1e6 * statistics.median(max(g, 0.0) for g in gaps), "idle_waits": idle[0] / steps,
            **{f"{k}_us": 1e6 * v / steps for k, v in hooks.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv", default="bf16,int3")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", default="1")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--overlap", default="off", help="off, on or off,on: overlapped decode steps")
    a = p.parse_args()
    arch = named_arch("mixtral-8x7b", **{**bench_decode.TINY_ARCH, "head_dim": 128, "hidden_size": 256,
                                          "max_position_embeddings": max(4096, 2 * a.context)})
    model = build_random_model(arch, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0)
    overlaps = [o.strip() == "on" for o in a.overlap.split(",")]
    print("| KV | B | page | overlap | step us (mean) | step us (median) | exposed us (median) | idle waits / step "
          "| begin_step us | end_step us |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in a.batch.split(",")):
        for kv in a.kv.split(","):
            for overlap in overlaps:
                r = measure(model, kv, batch, a.context, a.steps, overlap)
                print(f"| {r['kv']} | {r['batch']} | {r['page']} | {'on' if overlap else 'off'} | {r['mean_us']:.1f} | "
                      f"{r['median_us']:.1f} | {r['exposed_us']:.1f} | {r['idle_waits']:.2f} | "
                      f"{r['begin_step_us']:.1f} | {r['end_step_us']:.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""Where a CUDA-graph decode step's wall time goes, per phase (host perf_counter marks around the engine's
methods) against the graph replay (CUDA events), with synthetic KV (no prefill).

    PYTHONPATH=src:. python3 tools/phase_timer.py --kv bf16,int3 --context 16384 --steps 64   # GPU
    PYTHONPATH=src:. python3 tools/phase_timer.py --tiny --context 64 --steps 4              # CPU check
"""
import argparse, collections, time

import torch

from benchmarks import bench_decode  # noqa: E402
from benchmarks.decode_moekv import make_engine  # noqa: E402
from benchmarks.synthetic_kv import admit_with_context, fill_kv_synthetic  # noqa: E402
from moekv.models.loader import build_random_model  # noqa: E402
from moekv.models.registry import named_arch  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--kv", default="bf16,int3"); p.add_argument("--context", type=int, default=16384)
p.add_argument("--batch", type=int, default=1); p.add_argument("--steps", type=int, default=64)
p.add_argument("--model", default="mixtral-8x7b"); p.add_argument("--tiny", action="store_true")
args = p.parse_args()
cuda = torch.cuda.is_available() and not args.tiny
device = torch.device("cuda" if cuda else "cpu")
arch = named_arch(args.model, **(bench_decode.TINY_ARCH if args.tiny else {}))
model = build_random_model(arch, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0)

def sync():
    if cuda: torch.cuda.synchronize()

for kv in args.kv.split(","):
    ns = argparse.Namespace(page_size=None if not args.tiny else 16, prefill_chunk=max(args.context, 256, args.batch), model=args.model)
    new_tokens = args.steps + 40
    engine = make_engine(model, args.batch, args.context, kv, new_tokens, ns, graphs=cuda)
    runner, cache = engine.runner, engine.kv_cache
    if not cuda: assert runner.enable_graphs(capture=False)
    admit_with_context(engine, args.batch, args.context, new_tokens, arch.vocab_size, seed=0)
    fill_kv_synthetic(cache)
    for _ in range(8): engine.step()
    sync()
    marks = []
    def mark(name): marks.append((name, time.perf_counter()))
    def wrap(obj, name):
        orig = getattr(obj, name)
        def f(*a, **k):
            mark(name + ">")
            try: return orig(*a, **k)
            finally: mark(name + "<")
        setattr(obj, name, f)
    targets = [(engine.scheduler, "schedule"), (runner, "execute"), (cache, "begin_step"), (runner, "_run_pre_hooks"),
               (cache, "end_step"), (runner, "_static_forward")]
    targets += [(bucket, name) for bucket in runner._buckets.values() for name in ("fill", "upload")]
    for obj, name in targets:
        wrap(obj, name)
    gpu = []
    for bucket in runner._buckets.values():
        if bucket.graph is not None:
            graph = bucket.graph
            class Timed:
                def replay(self, _g=graph):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    mark("replay>"); s.record(); _g.replay(); e.record(); mark("replay<"); gpu.append((s, e))
            bucket.graph = Timed()
    phases = collections.defaultdict(float)
    sync(); t0 = time.perf_counter()
    for _ in range(args.steps):
        marks.clear(); mark("step>"); engine.step(); mark("step<")
        for (a, ta), (b, tb) in zip(marks, marks[1:]):
            phases[f"{a} -> {b}"] += tb - ta
    sync(); wall = (time.perf_counter() - t0) * 1e3 / args.steps
    replay = sum(s.elapsed_time(e) for s, e in gpu) / args.steps if gpu else float("nan")
    print(f"== {kv}: wall {wall:.3f} ms/step, graph replay (GPU) {replay:.3f} ms, outside {wall - replay:.3f} ms")
    for k, v in sorted(phases.items(), key=lambda kv_: -kv_[1]):
        if v * 1e3 / args.steps >= 0.005:
            print(f"   {v * 1e3 / args.steps:8.3f} ms  {k}")
    for r in list(engine.requests): engine.abort(r)
    engine.routing.remove_hooks()   # the model is shared: the next engine must not run this one's pre-hook too
    del engine

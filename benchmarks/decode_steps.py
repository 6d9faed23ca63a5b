"""Engine decode steps timed one by one, for bench_decode and tools/phase_timer.py, and the GPU-busy share
of profiled steps (`busy_fraction`, also bench_offload's).

`time_steps(engine, n, device)` runs n engine steps and reports, from the same steps: the wall time per
step (mean = time per output token; every decode step ends in its one host read, so a step's wall time
holds its GPU work), the CUDA-event time of each step's graph replay, and their difference, the time a step
spends outside its replay (host work, the step's copies, eager launches). Measuring both in one loop
matters: the replay time of other steps (e.g. right after a profiler session) is no baseline for this
loop's wall time (docs/decode-results.md, "Outside the graph").

Each step is also classified by what it does to the KV pages (all running sequences decode one token a
step): "fill" (a token completes a page: the low-bit cache quantizes it inside that step's graph and
returns its staging slot), "start" (a token opens a page: a staging slot is taken, a map update), else
"ordinary". A run of >= page_size steps holds at least one fill step per sequence.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch


class TimedGraph:
    """Stands in for a captured CUDA graph: replays it between two timing events, tagged with the step."""

    def __init__(self, graph, events: list, step: list[int]):
        self.graph, self.events, self.step = graph, events, step

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.events.append((self.step[0], start, end))


def step_kinds(engine, num_steps: int) -> list[str]:
    """The kind ("fill", "start", "ordinary") of each of the next num_steps decode steps, from the running
    sequences' positions (each advances by one token a step)."""
    page = engine.kv_manager.page_size
    offsets = [r.num_computed_tokens for r in engine.scheduler.running]
    kinds = []
    for i in range(num_steps):
        at = [(o + i) % page for o in offsets]
        kinds.append("fill" if page - 1 in at else "start" if 0 in at else "ordinary")
    return kinds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps(engine, num_steps: int, device: torch.device) -> dict:
    """Run num_steps engine steps; wall and replay times per step and per kind (see the module docstring).

    Returns tpot_ms (mean wall per step, from one clock around the loop), step_ms_median, graph_replay_ms (mean
    CUDA-event time of a replay, None without captured graphs), graph_replays (how many steps replayed),
    outside_graph_ms (tpot_ms - graph_replay_ms), and by_kind {kind: {steps, wall_ms, wall_ms_median,
    replay_ms}} (None when a sequence did not decode every step, e.g. one finished)."""
    runner = engine.runner
    events: list = []
    step = [0]
    buckets = [b for b in runner._buckets.values() if b.graph is not None] if device.type == "cuda" else []
    for bucket in buckets:
        bucket.graph = TimedGraph(bucket.graph, events, step)
    kinds = step_kinds(engine, num_steps)
    before = {id(r): r.num_computed_tokens for r in engine.scheduler.running}
    walls = []
    try:
        sync(device)
        start = time.perf_counter()
        for i in range(num_steps):
            step[0] = i
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
        sync(device)
        total = time.perf_counter() - start
    finally:
        for bucket in buckets:
            bucket.graph = bucket.graph.graph
    replay = {i: s.elapsed_time(e) for i, s, e in events}                      # step -> ms
    tpot = total * 1e3 / num_steps
    replay_ms = sum(replay.values()) / len(replay) if replay else None
    row = {"tpot_ms": tpot, "step_ms_median": statistics.median(walls) * 1e3, "graph_replay_ms": replay_ms,
           "graph_replays": len(replay), "outside_graph_ms": None if replay_ms is None else tpot - replay_ms,
           "by_kind": None}
    after = {id(r): r.num_computed_tokens for r in engine.scheduler.running}
    if before and after == {k: v + num_steps for k, v in before.items()}:
        row["by_kind"] = {}
        for kind in sorted(set(kinds)):
            steps = [i for i, k in enumerate(kinds) if k == kind]
            ms = [walls[i] * 1e3 for i in steps]
            replays = [replay[i] for i in steps if i in replay]
            row["by_kind"][kind] = {"steps": len(steps), "wall_ms": sum(ms) / len(ms),
                                    "wall_ms_median": statistics.median(ms),
                                    "replay_ms": sum(replays) / len(replays) if replays else None}
    return row


# ---------------------------------------------------------------- GPU busy (torch.profiler)
KERNEL_GROUPS = (("attention (low-bit)", ("lowbit", "moekv_v7::decode_kernel")), ("attention (bf16 paged)", ("_paged_decode", "attention")),
                 ("experts (fused MoE)", ("moe", "expert")), ("GEMM (projections, logits)", ("gemm", "sm90", "cutlass", "nvjet")),
                 ("norm / rotary / routing", ("norm", "rotary", "route", "topk", "softmax")),
                 ("copies / fills", ("copy", "memcpy", "memset", "fill")))


def kernel_group(name: str) -> str:
    lowered = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(key in lowered for key in keys):
            return group
    return "other"


def busy_fraction(step, num_steps: int, device: torch.device, breakdown: dict | None = None) -> float | None:
    """Union of GPU activity intervals (kernels, memcpy, memset) / wall time of `num_steps` calls of
    step(), read from the profiler's exported Chrome trace (a documented, stable format). With
    `breakdown` (a dict), fill it with per-step GPU ms and launch counts per kernel name and per group
    (exact for eager steps; a replayed graph's kernels are undercounted by the trace)."""
    if num_steps <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            with record_function("bench_decode_step"):
                step()
                sync(device)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "bench_decode_step"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, cursor = 0.0, -math.inf
    for start, end in gpu:                                        # union of possibly overlapping intervals
        start = max(start, cursor)
        if end > start:
            busy += end - start
            cursor = end
    wall = sum(end - start for start, end in windows)
    if device.type != "cuda" or wall <= 0:
        return None
    if breakdown is not None:
        kernels, groups = {}, {}
        for e in events:
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                ms, count = kernels.get(e["name"], (0.0, 0))
                kernels[e["name"]] = (ms + e["dur"] / 1e3 / num_steps, count + 1)
        for name, (ms, count) in kernels.items():
            g_ms, g_count = groups.get(kernel_group(name), (0.0, 0))
            groups[kernel_group(name)] = (g_ms + ms, g_count + count)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
        breakdown["kernels"] = [{"name": n[:90], "ms_per_step": ms, "launches_per_step": c / num_steps}
                                for n, (ms, c) in top]
        breakdown["groups"] = {g: {"ms_per_step": ms, "launches_per_step": c / num_steps}
                               for g, (ms, c) in sorted(groups.items(), key=lambda kv: -kv[1][0])}
        breakdown["wall_ms_per_step"] = wall / 1e3 / num_steps
    return busy / wall

"""`bench_offload.py speed`: batch-1 decode with offloaded experts, every mode side by side in one run.

The model has Mixtral-8x7B's shape and random weights; its routers replay a trace recorded from the bundled
trained model (moe.prefetch.trace: layer l replays trace layer l mod 6, shifted by (l div 6) * 997 tokens),
and the guesses are the ones recorded with the trace (with their router probability margins). Runs, per
expert cache size (25 / 50 / 75% of each layer's experts):

    on-demand          host staging (one host read per layer), misses only, eager   -- today's baseline
    prefetch           ... + every top-k guess copied into the slot it evicts        -- today's prefetch
    staged             ... + the staged policy (prefetch_threshold, default auto, top-k+1 guesses), its guess
                       budgets measured (prefetch_gate "measured", moe.prefetch.gate)
    staged-estimate    the same with session 19's host-estimated budgets (prefetch_gate "estimate")
    on-demand-fp8      on-demand with FP8 host experts (half the bytes per copy)
    staged-fp8         staged with FP8 host experts (staged-fp8-estimate: with the estimate)
    device-graph       device staging (slot table + copies on the device), decode replayed as a CUDA graph
    device-graph-fp8   the same with FP8 host experts
    prefetch-guard     prefetch (and staged-guard, staged-fp8-guard: staged, staged-fp8) under the prefetch guard
                       (moe.prefetch.guard, OffloadConfig.prefetch_guard, the engine's default): windows of steps
                       with and without the predictor alternate and the faster side is kept; its exploration
                       (2 x rounds x window steps) runs in the warm-up, so the timed steps show the kept side
                       (with a guarded mode in the run every mode warms up that much longer: the same timed tokens)
    cpu-split-25/50/75 on-demand with CPU-split misses (cpu_compute_fraction 0.25 / 0.5 / 0.75, moe.prefetch.cpu_split:
                       the CPU computes that share of a missed expert while the rest is copied; not made resident)
next to all experts resident, eagerly (the bench's own loop; "compute") and as a CUDA graph (the engine).
Eager modes run the bench's decode loop; graph modes run the engine (its CUDA-graph decode step). Per run:
ms / token, speed-up against on-demand at the same cache size, GPU busy share of the step (torch.profiler
for eager steps, graph replay time / wall time of the same steps for graph steps), hit rate, copies, misses and bytes moved per token,
copy-stream busy time (eager host modes), the staged policy's counters (decisions, overruns, guesses issued /
used / dropped, the learned budget per layer, its host time); then the issue's targets with the numbers, and
what the timeline simulator predicts from this run's copy and compute times. Counters cover the timed steps
only (the GPU-busy profile steps run after them). Harnesses: benchmarks/offload_speed_harness.py; markdown:
benchmarks/offload_speed_report.py.

Correctness: with per-layer host copies every 16-bit run must generate the greedy tokens of the resident
run of the same harness (eager or graph); staged-fp8 those of on-demand-fp8 (FP8 compute is the same in
both). A mismatch is reported and makes the command exit non-zero after writing the report. The cpu-split rows
change the summation of split experts (close to, not bit-identical with, the resident experts): their first
token differing from the resident run is recorded (`differs_from_resident_at`), not counted as a mismatch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from benchmarks.offload_common import bundled_tokens, provenance, write
from benchmarks.offload_speed_harness import run_eager, run_graph, sync
from benchmarks.offload_speed_report import speed_markdown
from moekv.models.loader import build_random_model, load_model
from moekv.models.registry import named_arch
from moekv.moe.prefetch.guard import PrefetchGuard
from moekv.moe.prefetch.manager import ExpertOffload, expert_bytes, resolve_cache_slots
from moekv.moe.prefetch.pool import HostExperts
from moekv.moe.prefetch.predictor import moe_layer_ids
from moekv.moe.prefetch.runtime import RoutingRuntime
from moekv.moe.prefetch.timeline import simulate_decode
from moekv.moe.prefetch.trace import TracePredictor, record_trace, replay_trace

TOKEN_STRIDE = 997
# name: (harness, prefetch policy, host format)
MODES = {"on-demand": ("eager", None, "native"), "prefetch": ("eager", "fifo", "native"),
         "staged": ("eager", "staged", "native"), "staged-estimate": ("eager", "staged-estimate", "native"),
         "on-demand-fp8": ("eager", None, "fp8"), "staged-fp8": ("eager", "staged", "fp8"),
         "staged-fp8-estimate": ("eager", "staged-estimate", "fp8"), "device-graph": ("graph", None, "native"),
         "device-graph-fp8": ("graph", None, "fp8"), "cpu-split-25": ("eager", None, "native"),
         "cpu-split-50": ("eager", None, "native"), "cpu-split-75": ("eager", None, "native"),
         "prefetch-guard": ("eager", "fifo", "native"), "staged-guard": ("eager", "staged", "native"),
         "staged-fp8-guard": ("eager", "staged", "fp8")}
GUARDED = {"prefetch-guard", "staged-guard", "staged-fp8-guard"}          # run under PrefetchGuard
CPU_FRACTION = {"cpu-split-25": 0.25, "cpu-split-50": 0.5, "cpu-split-75": 0.75}   # OffloadConfig.cpu_compute_fraction
IDENTITY_BASE = {"on-demand": "resident", "prefetch": "resident", "staged": "resident",
                 "staged-estimate": "resident", "staged-fp8": "on-demand-fp8", "staged-fp8-estimate": "on-demand-fp8",
                 "device-graph": "resident-graph", "prefetch-guard": "resident", "staged-guard": "resident",
                 "staged-fp8-guard": "on-demand-fp8"}


def host_copies(model, formats: set[str], shared: bool) -> dict[str, dict[int, HostExperts]]:
    """Host copies of every MoE layer's experts per host format (quantized on the device for FP8)."""
    layers = moe_layer_ids(model)
    out = {}
    for fmt in sorted(formats):
        copies = {}
        for index in layers:
            if shared and copies:
                copies[index] = next(iter(copies.values()))
                continue
            copies[index] = HostExperts.from_weights(*model.layers[index].mlp.experts.weights(), fmt)
        out[fmt] = copies
    return out


def divergence(tokens: list[int], reference: list[int]) -> dict | None:
    if tokens == reference:
        return None
    step = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return {"token_step": step}


def cmd_speed(args) -> None:
    device = torch.device(args.device)
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    assert not unknown, f"unknown modes {unknown}; choose from {list(MODES)}"
    if GUARDED & set(modes):    # the guard explores in the warm-up; every run warms up as long (same timed tokens)
        probe = PrefetchGuard()
        args.warmup += 2 * probe.rounds * probe.window
    arch = named_arch("mixtral-8x7b", num_layers=8, hidden_size=128, expert_intermediate_size=256, num_heads=4,
                      num_kv_heads=2, head_dim=32, vocab_size=512) if args.tiny else \
        named_arch("mixtral-8x7b", **({"num_layers": args.num_layers} if args.num_layers else {}))
    began_all = time.perf_counter()
    model_dir, ids = bundled_tokens(args.trace_tokens)
    trace = record_trace(load_model(model_dir, dtype=torch.float32, device=device), ids, window=512,
                         extra_candidates=1)
    model = build_random_model(arch, dtype, device, seed=0)
    mapping = replay_trace(model, trace, TOKEN_STRIDE)
    routers = [model.layers[i].mlp.router for i in moe_layer_ids(model)]
    prompt = torch.randint(0, arch.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    per_expert = expert_bytes(arch, dtype)
    num_moe = len(routers)
    host_needed = per_expert * arch.num_experts * num_moe * (1.5 if any(MODES[m][2] == "fp8" for m in modes) else 1)
    shared = args.host_experts == "shared" or (args.host_experts == "auto" and host_needed > 0.5 * host_memory_bytes())

    def reset_cursors():
        for router in routers:
            router.cursor = 0

    runs, results = [], {}
    reset_cursors()
    resident = run_eager(model, prompt, args, device, lambda: None)
    compute_ms = 1e3 * resident["seconds_per_token"]
    results["resident"] = resident
    runs.append({"mode": "resident", "cache_percent": 100, "slots": arch.num_experts, "ms_per_token": compute_ms,
                 "gpu_busy": resident["gpu_busy"], "copies_per_token": 0.0})
    reset_cursors()
    resident_graph = run_graph(model, prompt, args, device, args.dtype, lambda: None, routers)
    results["resident-graph"] = resident_graph
    runs.append({"mode": "resident-graph", "cache_percent": 100, "slots": arch.num_experts,
                 "ms_per_token": 1e3 * resident_graph["seconds_per_token"], "gpu_busy": resident_graph["gpu_busy"],
                 "graph_replay_ms": resident_graph["graph_replay_ms"], "copies_per_token": 0.0})
    for run in runs:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in run.items()}, flush=True)
    bandwidth = h2d_bandwidth(per_expert, device)
    hosts = host_copies(model, {MODES[m][2] for m in modes}, shared)
    mismatches, failures, offload = [], [], None
    caches = [int(p) for p in args.cache.split(",")]
    for percent in caches:
        slots = resolve_cache_slots(f"{percent}%", arch.num_experts, per_expert, num_moe)
        for mode in modes:
            harness, policy, fmt = MODES[mode]
            if offload is not None:                     # let the previous pool go before the next one
                offload.close()
                offload.layers.clear()
                offload.pool = offload.split = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            offload = ExpertOffload(model, slots, args.eviction, device=device, time_copies=harness == "eager",
                                    host_weights=hosts[fmt].__getitem__, host_format=fmt,
                                    prefetch_threshold=args.threshold if "staged" in (policy or "") else None,
                                    staging="device" if harness == "graph" else "host",
                                    prefetch_gate="estimate" if policy == "staged-estimate" else "measured",
                                    cpu_compute_fraction=CPU_FRACTION.get(mode, 0.0), cpu_threads=args.cpu_threads)
            predictor = guard = runtime = None
            if policy is not None:
                predictor = TracePredictor(model, 1, 0 if policy == "fifo" else 1, source="attn")
                offload.attach_predictor(predictor)
            if mode in GUARDED:                         # the engine's per-step hook: guard + offload.begin_step
                guard = PrefetchGuard()
                runtime = RoutingRuntime(model, None, predictor, offload, guard)

            def on_warm(offload=offload, predictor=predictor):      # counters cover the timed steps only
                sync(device)
                offload.reset_stats()
                if predictor is not None:
                    predictor.reset()

            def on_timed(offload=offload, predictor=predictor):     # what the timed steps did
                sync(device)
                copy_s = offload.copier.copy_seconds() if offload.staging_mode == "host" else None
                return offload.stats(), copy_s, predictor.recall() if predictor is not None else None

            reset_cursors()
            try:
                result = run_eager(model, prompt, args, device, on_warm, on_timed) if harness == "eager" else \
                    run_graph(model, prompt, args, device, args.dtype, on_warm, routers)
            except Exception as exc:  # noqa: BLE001 - one GPU call: report the mode's failure, run the others
                import traceback

                traceback.print_exc()
                failures.append({"mode": mode, "cache_percent": percent, "error": f"{type(exc).__name__}: {exc}"[:400]})
                if runtime is not None:
                    runtime.remove_hooks()
                elif predictor is not None:
                    predictor.remove()
                continue
            results[(mode, percent)] = result
            runs.append(describe(mode, percent, slots, result, result.get("snapshot") or on_timed(), args.tokens,
                                 compute_ms))
            if guard is not None:
                runs[-1]["guard"] = guard.stats()["regimes"].get("1")
            if runtime is not None:
                runtime.remove_hooks()
            elif predictor is not None:
                predictor.remove()
            if mode in CPU_FRACTION and not shared:
                why = divergence(result["tokens"], results["resident"]["tokens"])
                runs[-1]["differs_from_resident_at"] = None if why is None else why["token_step"]
            base = IDENTITY_BASE.get(mode)
            base_result = results.get(base) if base in ("resident", "resident-graph") else results.get((base, percent))
            if base is not None and not shared and base_result is not None:
                why = divergence(result["tokens"], base_result["tokens"])
                runs[-1]["matches"] = base if why is None else None
                if why is not None:
                    runs[-1]["divergence"] = why
                    mismatches.append({"mode": mode, "cache_percent": percent, "against": base, **why})
                    print(f"!!! {mode} {percent}%: greedy tokens differ from {base}: {why}", flush=True)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in runs[-1].items()
                   if not isinstance(v, dict)}, flush=True)
    for run in runs[2:]:
        base = next((r for r in runs if r["mode"] == "on-demand" and r["cache_percent"] == run["cache_percent"]), None)
        if base is not None:
            run["speedup_vs_on_demand"] = base["ms_per_token"] / run["ms_per_token"]
    report = {**provenance(sys.argv), "arch": "mixtral-8x7b" + (" (tiny)" if args.tiny else ""),
              "num_layers": arch.num_layers, "dtype": args.dtype, "device": str(device), "expert_bytes": per_expert,
              "h2d_gb_per_s": bandwidth, "copy_ms_one_expert": 1e3 * per_expert / (bandwidth * 1e9),
              "host_experts": "shared" if shared else "per-layer", "threshold": args.threshold,
              "eviction": args.eviction, "trace": {"tokens": trace.num_tokens, "layers": trace.num_layers,
                                                   "layer_map": mapping},
              "prompt_len": args.prompt_len, "warmup": args.warmup, "tokens": args.tokens, "runs": runs,
              "mismatches": mismatches, "failures": failures, "seconds": round(time.perf_counter() - began_all, 1)}
    report["simulated"] = simulated(trace, report, caches, arch, compute_ms, num_moe)
    if any(m in CPU_FRACTION for m in modes):
        report["cpu_split"] = cpu_split_model(hosts["native"], bandwidth, args.cpu_threads)
    markdown = speed_markdown(report)
    print(markdown)
    if args.out:
        write(args.out, report, markdown)
    if mismatches or failures:
        sys.exit(f"{len(mismatches)} run(s) generated other greedy tokens than their reference (see 'mismatches'), "
                 f"{len(failures)} failed (see 'failures')")


def describe(mode, percent, slots, result, snapshot, steps, compute_ms) -> dict:
    stats, copy_s, recall = snapshot
    run = {"mode": mode, "cache_percent": percent, "slots": slots, "ms_per_token": 1e3 * result["seconds_per_token"],
           "gpu_busy": result["gpu_busy"], "graph_replay_ms": result.get("graph_replay_ms"),
           "hit_rate": stats["hit_rate"], "copies_per_token": stats["copies"] / steps,
           "misses_per_token": stats["misses"] / steps, "mb_moved_per_token": stats["bytes_copied"] / steps / 2**20,
           "expert_mib": stats["expert_bytes"] / 2**20, "compute_ms_per_token": compute_ms,
           "copy_ms_per_token": 1e3 * copy_s / steps if copy_s else None,
           "h2d_gb_per_s_measured": stats["bytes_copied"] / copy_s / 1e9 if copy_s else None}
    split = stats.get("cpu_split")
    if split:
        run["cpu_split"] = {"fraction": split["fraction"], "split_per_token": split["split_experts"] / steps,
                            "cpu_ms_per_token": split["cpu_ms"] / steps, "wait_ms_per_token": split["wait_ms"] / steps,
                            "part_mib": split["part_bytes"] / 2**20}
    staged = stats.get("staged")
    if staged:
        run["staged"] = {key: staged[key] for key in ("gate", "measuring", "decisions", "overruns", "guesses", "issued",
                                                       "used", "promoted", "promoted_chunks", "dropped", "wasted",
                                                       "chunks", "dropped_chunks", "margin_threshold_now", "copy_ms",
                                                       "host_ms", "learned")}
        run["staged"]["budget"] = learned_budget(staged["learned"], stats["expert_bytes"], staged["chunks_per_expert"])
        run["promoted_per_token"] = staged["promoted"] / steps
        run["staging_host_ms_per_token"] = staged["host_ms"] / steps
    if recall is not None:
        run["recall_1_ahead"], run["precision_1_ahead"] = recall["overall"][1], recall["precision"][1]
    return run


def learned_budget(learned: dict | None, expert_bytes: int, chunks: int) -> dict | None:
    """The measured gate's final state in a row's units: one chunk's measured ms, and per layer the budget in
    ms and in chunks (mean over layers, and the smallest and largest)."""
    if not learned or not learned["layers"]:
        return None
    rate = learned["ms_per_byte"] or learned["miss_ms_per_byte"] or learned["prior_ms_per_byte"]
    chunk_ms = rate * expert_bytes / chunks if rate else None
    budgets = [layer["budget_ms"] for layer in learned["layers"].values()]
    in_chunks = [b / chunk_ms for b in budgets] if chunk_ms else []
    return {"chunk_ms": chunk_ms, "chunk_ms_source": "guesses" if learned["ms_per_byte"] else
            "misses" if learned["miss_ms_per_byte"] else "estimate",
            "budget_ms_mean": sum(budgets) / len(budgets), "budget_chunks_mean": sum(in_chunks) / len(in_chunks)
            if in_chunks else None, "budget_chunks_min": min(in_chunks, default=None),
            "budget_chunks_max": max(in_chunks, default=None),
            "scale_mean": sum(layer["scale"] for layer in learned["layers"].values()) / len(budgets)}


def simulated(trace, report, caches, arch, compute_ms, num_moe) -> list[dict]:
    """What the timeline simulator predicts from this run's one-expert copy time and resident compute time."""
    per_layer = compute_ms / num_moe
    out = []
    for percent in caches:
        slots = resolve_cache_slots(f"{percent}%", arch.num_experts, report["expert_bytes"], num_moe)
        for copy_ms, fmt in ((report["copy_ms_one_expert"], "native"), (report["copy_ms_one_expert"] / 2, "fp8")):
            for mode in ("on-demand", "prefetch", "staged"):
                if mode == "prefetch" and fmt == "fp8":
                    continue
                sim = simulate_decode(trace, slots, mode, copy_ms, per_layer / 2, per_layer / 2, num_tokens=1024,
                                      width=arch.top_k + (mode == "staged"), threshold=report["threshold"])
                out.append({"cache_percent": percent, "mode": mode, "host_format": fmt,
                            "ms_per_token_per_trace_layer": sim["ms_per_token"] / trace.num_layers,
                            "ms_per_token": sim["ms_per_token"] * num_moe / trace.num_layers})
    return out


def cpu_split_model(hosts: dict, link_gb_per_s: float, threads: int | None, reps: int = 5) -> dict:
    """The CPU half's GEMV bandwidth on this host (one token, half of one expert's channels, the worker's threads)
    and the fraction that balances it with the link: f* = cpu / (cpu + link) (docs/expert-offload.md)."""
    from concurrent.futures import ThreadPoolExecutor

    from moekv.moe.prefetch.cpu_split import cpu_part, split_channels

    host = next(iter(hosts.values()))
    inter = host.down.shape[2]
    channels = split_channels(inter, 0.5)
    x = torch.randn(1, host.down.shape[1], dtype=host.dtype)

    def run() -> float:
        if threads is not None:
            torch.set_num_threads(threads)
        with torch.inference_mode():
            cpu_part(x, host.gate_up[0], host.down[0], channels)
            began = time.perf_counter()
            for rep in range(reps):
                cpu_part(x, host.gate_up[rep % host.num_experts], host.down[rep % host.num_experts], channels)
            return (time.perf_counter() - began) / reps
    with ThreadPoolExecutor(1) as pool:                 # a worker thread, as CpuSplit runs it
        seconds = pool.submit(run).result()
    cpu = host.expert_bytes * channels / inter / seconds / 1e9
    return {"cpu_gb_per_s": cpu, "cpu_ms_half_expert": 1e3 * seconds, "threads": threads or torch.get_num_threads(),
            "balanced_fraction": cpu / (cpu + link_gb_per_s)}


def h2d_bandwidth(nbytes: int, device: torch.device, reps: int = 10) -> float:
    """GB/s of host (pinned on CUDA) -> device copies of `nbytes` (one expert)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    sync(device)
    began = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return nbytes * reps / (time.perf_counter() - began) / 1e9


def host_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def add_arguments(speed) -> None:
    speed.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    speed.add_argument("--dtype", default=None, help="default bf16 (fp32 with --tiny)")
    speed.add_argument("--tiny", action="store_true", help="a tiny Mixtral-like shape (CPU plumbing check)")
    speed.add_argument("--num-layers", type=int, default=None, help="override Mixtral's 32 layers")
    speed.add_argument("--cache", default="25,50,75", help="expert cache sizes, percent of each layer's experts")
    speed.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    speed.add_argument("--threshold", default="auto", help="the staged modes' prefetch_threshold (auto or a margin)")
    speed.add_argument("--eviction", default="lru", choices=("lru", "lfu"))
    speed.add_argument("--prompt-len", type=int, default=16)
    speed.add_argument("--warmup", type=int, default=4)
    speed.add_argument("--tokens", type=int, default=32)
    speed.add_argument("--profile-steps", type=int, default=4, help="steps profiled for the GPU busy share")
    speed.add_argument("--trace-tokens", type=int, default=8192)
    speed.add_argument("--host-experts", default="auto", choices=("auto", "per-layer", "shared"))
    speed.add_argument("--cpu-threads", type=int, default=None, help="cpu-split rows: torch threads of the CPU "
                       "worker (default: torch's)")
    speed.add_argument("--out", default=None)


def finish_arguments(args) -> None:
    args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")
    if args.threshold != "auto":
        args.threshold = float(args.threshold)

"""Expert-parallel decode: Mixtral-8x7B shape, random bf16 weights, int3 KV, 128 sequences at 16k context.

    # 2 GPUs (one process per GPU):
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_expert_parallel.py --out benchmarks/results
    # CPU plumbing check with gloo, tiny shapes (timings meaningless as speed, except the dispatch sweep):
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_expert_parallel.py --tiny

Each rank builds only its own experts (distributed.sharding.build_random_model) and its share of
the sequences (data-parallel attention). KV pages are filled synthetically (random pages
quantized once and copied into every page; context lengths set directly), not by a 2M-token
prefill. Measured, on rank 0:

1. decode with `--seqs` sequences at `--context` tokens: time per output token (median step time
   over `--steps` steps after warm-up), tokens/s, and the share of the step inside the
   dispatch/combine collectives (CUDA events around each collective);
2. batch 1 (one sequence on rank 0; the other ranks join each step with 0 tokens);
3. batch 1 on one device with the whole model (rank 0, after the expert-parallel engine is freed);
4. a dispatch sweep: one MoE layer (dispatch + experts + combine) per tokens-per-rank count, for
   all_to_all and allgather, to place `allgather_max_tokens`.
Writes expert-parallel-<tag>.json and .md; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from moekv.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from moekv.distributed.expert_parallel import ExpertParallelExperts
from moekv.distributed.groups import init_expert_parallel, shutdown
from moekv.distributed.lockstep import LockstepEngine
from moekv.distributed.placement import ExpertPlacement
from moekv.distributed.sharding import build_random_model
from moekv.entrypoints.ep_runner import initial_placements, make_runtime
from moekv.models.registry import named_arch
from moekv.provenance import git_commit
from synthetic_kv import admit_with_context, fill_kv_synthetic  # noqa: E402  (benchmarks/synthetic_kv.py)

TINY = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            expert_intermediate_size=128, max_position_embeddings=4096)
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- set-up
def kv_dtype_available(name: str, arch, page_size: int, device) -> str | None:
    """None if the KV format `name` builds here, else why not."""
    from moekv.kvcache import KVCacheSpec, create_kv_cache

    try:
        spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, page_size, torch.bfloat16)
        create_kv_cache(CacheConfig(kv_cache_dtype=name, page_size=page_size, staging_pages=1), spec, 2, device)
    except Exception as exc:  # noqa: BLE001 - any failure means: fall back and say why
        return f"{type(exc).__name__}: {exc}"
    return None


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- measurements
def time_decode(engine, steps: int, warmup: int, device) -> dict:
    """Median step time over `steps` decode steps (every running sequence gains one token per step)."""
    runtime = getattr(engine, "runtime", None)
    times, comm = [], []
    for index in range(warmup + steps):
        synchronize(device)
        began = time.perf_counter()
        engine.step()
        synchronize(device)
        elapsed = time.perf_counter() - began
        spent = sum(runtime.timer.read().values()) if runtime is not None else 0.0
        if index >= warmup:
            times.append(elapsed)
            comm.append(spent)
    median = statistics.median(times)
    return {"steps": steps, "step_ms_median": 1e3 * median, "step_ms_p10": 1e3 * sorted(times)[len(times) // 10],
            "step_ms_p90": 1e3 * sorted(times)[(9 * len(times)) // 10],
            "comm_ms_median": 1e3 * statistics.median(comm), "comm_share": statistics.median(comm) / median}


def abort_all(engine) -> None:
    for request_id in list(engine.requests):
        engine.abort(request_id)
        engine.release(request_id)


def dispatch_sweep(runtime, arch, tokens_list: list[int], reps: int, dtype, device) -> list[dict]:
    """One MoE layer (dispatch + local experts + combine) per exchange and tokens-per-rank count."""
    placement = ExpertPlacement.contiguous(arch.num_experts, runtime.world_size)
    experts = ExpertParallelExperts(runtime, placement, layer_idx=-1, hidden_size=arch.hidden_size,
                                    intermediate_size=arch.expert_intermediate_size, top_k=arch.top_k,
                                    dtype=dtype, device=device)
    with torch.no_grad():
        experts.w_gate_up.normal_(0, 0.02)
        experts.w_down.normal_(0, 0.02)
    runtime.layers = [experts] + [m for m in runtime.layers if m is not experts]
    rows = []
    saved = runtime.dispatch_mode
    for tokens in tokens_list:
        generator = torch.Generator(device=device).manual_seed(1000 * runtime.rank + tokens)
        hidden = torch.randn(tokens, arch.hidden_size, generator=generator, device=device).to(dtype)
        logits = torch.randn(tokens, arch.num_experts, generator=generator, device=device)
        weights, ids = torch.topk(torch.softmax(logits, -1), arch.top_k, dim=-1)
        row = {"tokens_per_rank": tokens}
        samples = {mode: [] for mode in ("all_to_all", "allgather")}
        comm = {mode: [] for mode in samples}
        for rep in range(reps + 2):                 # modes interleaved: both see the same background load
            for mode in samples:
                runtime.dispatch_mode = mode
                runtime.begin_step(tokens)
                synchronize(device)
                runtime.timer.read()
                began = time.perf_counter()
                with torch.no_grad():
                    experts(hidden, ids, weights)
                synchronize(device)
                elapsed = time.perf_counter() - began
                runtime.end_step()
                spent = sum(runtime.timer.read().values())
                if rep >= 2:
                    samples[mode].append(elapsed)
                    comm[mode].append(spent)
        for mode in samples:
            row[f"{mode}_ms"] = 1e3 * statistics.median(samples[mode])
            row[f"{mode}_comm_ms"] = 1e3 * statistics.median(comm[mode])
        row["winner"] = min(("all_to_all", "allgather"), key=lambda m: row[f"{m}_ms"])
        rows.append(row)
    runtime.dispatch_mode = saved
    runtime.layers.remove(experts)
    return rows


# ---------------------------------------------------------------- engines
def engine_config(args, arch, kv_dtype: str, seqs_per_rank: int, ep_size: int, device) -> EngineConfig:
    page = args.page_size
    pages_per_seq = -(-(args.context + args.steps + args.warmup + 2) // page)
    return EngineConfig(
        model=ModelConfig(model=args.shape, dtype="bf16", max_model_len=args.context + args.steps + args.warmup + 8),
        cache=CacheConfig(kv_cache_dtype=kv_dtype, page_size=page, num_pages=max(1, seqs_per_rank) * pages_per_seq + 4,
                          staging_pages=max(1, seqs_per_rank) + 8 if kv_dtype.startswith("int") else None),
        scheduler=SchedulerConfig(max_num_seqs=max(1, seqs_per_rank), max_num_batched_tokens=max(256, seqs_per_rank)),
        parallel=ParallelConfig(expert_parallel_size=ep_size, expert_dispatch=args.dispatch,
                                allgather_max_tokens=args.allgather_max_tokens),
        device=DeviceConfig(str(device)))


def run_decode(engine, args, arch, num_seqs: int, device) -> dict:
    admit_with_context(engine, num_seqs, args.context, args.steps + args.warmup + 2, arch.vocab_size,
                       seed=17 + getattr(engine, "rank", 0))
    fill_kv_synthetic(engine.kv_cache)
    result = time_decode(engine, args.steps, args.warmup, device)
    abort_all(engine)
    return result


def single_device_batch1(args, arch, kv_dtype: str, device) -> dict:
    """Rank 0 alone, the whole model on its device (no expert parallelism)."""
    from moekv.engine.engine import Engine
    from moekv.models.loader import build_random_model as build_full_model

    config = engine_config(args, arch, kv_dtype, 1, 1, device)
    model = build_full_model(arch, dtype=torch.bfloat16, device=device, seed=1)
    engine = Engine(config, model=model)
    result = run_decode(engine, args, arch, 1, device)
    del engine, model
    return result


# ---------------------------------------------------------------- outputs
def environment(argv: list[str], device, world_size: int) -> dict:
    commit = git_commit() or "unknown"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu (gloo, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})"
    return {"gpu": f"{world_size} x {gpu}", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": commit, "torch": torch.__version__,
            "command": f"torchrun --standalone --nproc-per-node {world_size} " + " ".join(argv)}


def write_results(out_dir: Path, stem: str, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    env, cfg = result["env"], result["config"]
    lines = [f"# Expert-parallel decode ({cfg['shape']}, {env['gpu']})", "",
             f"{env['date']}, commit {env['commit']}, torch {env['torch']}", f"Command: `{env['command']}`", "",
             f"KV cache: {cfg['kv_cache_dtype']}" + (f" ({cfg['kv_note']})" if cfg.get("kv_note") else "")
             + f"; context {cfg['context']} tokens; dispatch {cfg['dispatch']} (allgather up to "
             f"{cfg['allgather_max_tokens']} tokens per rank); {cfg['steps']} timed steps after {cfg['warmup']}.",
             "", "| run | sequences | time per output token (ms, median) | p90 | tokens/s | dispatch+combine share |",
             "|---|---|---|---|---|---|"]
    for name, run in result["decode"].items():
        tps = run["sequences"] / (run["step_ms_median"] / 1e3)
        lines.append(f"| {name} | {run['sequences']} | {run['step_ms_median']:.2f} | {run['step_ms_p90']:.2f} "
                     f"| {tps:.0f} | {100 * run['comm_share']:.0f}% |")
    if "batch1_vs_single" in result:
        lines += ["", f"Batch 1, expert parallel ({cfg['dispatch']}) vs one device: {result['batch1_vs_single']:.3f}x; "
                  f"best dispatch: {result['batch1_best_vs_single']:.3f}x (target <= 1.15 on GPUs)."]
    if "cpu" in env["gpu"]:
        lines += ["", "CPU run: these timings check the code paths; they say nothing about GPU speed."]
    lines += ["", "## Dispatch sweep (one MoE layer: dispatch + experts + combine, ms)", ""]
    lines += sweep_table(result["dispatch_sweep"])
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def sweep_table(rows: list[dict]) -> list[str]:
    lines = ["| tokens per rank | all_to_all | (collectives) | allgather | (collectives) | faster |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['tokens_per_rank']} | {row['all_to_all_ms']:.3f} | {row['all_to_all_comm_ms']:.3f} "
                     f"| {row['allgather_ms']:.3f} | {row['allgather_comm_ms']:.3f} | {row['winner']} |")
    return lines


def write_sweep(out_dir: Path, stem: str, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    env, layer = result["env"], result["layer"]
    lines = [f"# Expert-parallel dispatch sweep ({env['gpu']})", "",
             f"{env['date']}, commit {env['commit']}, torch {env['torch']}", f"Command: `{env['command']}`", "",
             f"One MoE layer, {layer['num_experts']} experts top-{layer['top_k']}, hidden {layer['hidden_size']}, "
             f"expert intermediate {layer['intermediate_size']}, bf16: dispatch + local experts + combine, "
             f"median of {layer['reps']} calls (ms).", ""] + sweep_table(result["dispatch_sweep"])
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--seqs", type=int, default=128, help="concurrent sequences over all ranks")
    parser.add_argument("--context", type=int, default=16384, help="cached tokens per sequence")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps (median)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--kv-cache-dtype", default="int3")
    parser.add_argument("--page-size", type=int, default=None, help="default 128 (low-bit) or 16")
    parser.add_argument("--dispatch", default="auto", choices=("auto", "all_to_all", "allgather"))
    parser.add_argument("--allgather-max-tokens", type=int, default=None,
                        help="auto's switch point (default: the backend's, distributed.expert_parallel)")
    parser.add_argument("--sweep-tokens", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--sweep-reps", type=int, default=10)
    parser.add_argument("--sweep-hidden", type=int, default=None, help="hidden size of the sweep's layer "
                        "(default: the shape's; e.g. 4096 with --tiny for Mixtral-width rows on the CPU)")
    parser.add_argument("--sweep-only", action="store_true", help="only the dispatch sweep")
    parser.add_argument("--no-single", action="store_true", help="skip the one-device batch-1 baseline")
    parser.add_argument("--no-compare", action="store_true", help="decode with --dispatch only (default: also "
                        "with all_to_all and allgather forced)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (gloo): checks the code paths")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--tag", default=None, help="result file tag (default: gpu / cpu-tiny)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seqs, args.context = min(args.seqs, 8), min(args.context, 256)
        args.steps, args.warmup = min(args.steps, 8), min(args.warmup, 2)
    args.page_size = args.page_size or (128 if args.kv_cache_dtype.startswith("int") else 16)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    group = init_expert_parallel(world_size, "cpu" if args.tiny else "auto")
    device, rank = group.device, group.rank
    arch = named_arch(args.shape, **(TINY if args.tiny else {}))
    kv_dtype, kv_note = args.kv_cache_dtype, None
    why = kv_dtype_available(kv_dtype, arch, args.page_size, device)
    if why is not None:
        kv_note = f"{kv_dtype} unavailable ({why}); measured with bf16 KV pages"
        kv_dtype, args.page_size = "bf16", 16
    seqs_per_rank = [len(range(r, args.seqs, world_size)) for r in range(world_size)]
    runtime = make_runtime(ParallelConfig(expert_parallel_size=world_size, expert_dispatch=args.dispatch,
                                          allgather_max_tokens=args.allgather_max_tokens), group, time_comm=True)
    sweep_arch = replace(arch, hidden_size=args.sweep_hidden) if args.sweep_hidden else arch
    sweep = dispatch_sweep(runtime, sweep_arch, [int(t) for t in args.sweep_tokens.split(",")], args.sweep_reps,
                           torch.bfloat16, device)
    if args.sweep_only:
        if rank == 0:
            result = {"env": environment(["benchmarks/bench_expert_parallel.py", *argv], device, world_size),
                      "layer": {"hidden_size": sweep_arch.hidden_size, "num_experts": arch.num_experts,
                                "top_k": arch.top_k, "intermediate_size": arch.expert_intermediate_size,
                                "reps": args.sweep_reps}, "dispatch_sweep": sweep}
            tag = args.tag or f"{'cpu-tiny' if args.tiny else 'gpu'}-h{sweep_arch.hidden_size}"
            print(write_sweep(args.out, f"expert-parallel-sweep-{tag}", result).read_text())
        shutdown()
        return 0
    placements = initial_placements(arch, world_size, 0)
    model = build_random_model(arch, runtime, placements, torch.bfloat16, device, seed=1)
    config = engine_config(args, arch, kv_dtype, seqs_per_rank[0], world_size, device)
    engine = LockstepEngine(config, model, None, runtime)
    if rank == 0:
        print(f"{world_size} ranks on {device}: {args.shape}, KV {kv_dtype}, {args.seqs} x {args.context} tokens")
    modes = [args.dispatch]
    if not args.no_compare:
        modes += [m for m in ("all_to_all", "allgather") if m != args.dispatch]
    decode, batch1 = {}, {}
    for batch, label in ((None, ""), (1, ", batch 1")):
        for mode in modes:
            runtime.dispatch_mode = mode
            runtime.exchange_calls.clear()
            num_seqs = seqs_per_rank[rank] if batch is None else (1 if rank == 0 else 0)
            run = run_decode(engine, args, arch, num_seqs, device)
            name = f"expert parallel x{world_size}{label}, {mode}"
            decode[name] = {**run, "sequences": batch or args.seqs, "dispatch": mode,
                            "calls": dict(runtime.exchange_calls)}
            if batch == 1:
                batch1[mode] = run
    runtime.dispatch_mode = args.dispatch
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result_single = None
    if not args.no_single and rank == 0:
        result_single = single_device_batch1(args, arch, kv_dtype, device)
    dist.barrier(group=group.cpu_group)
    if rank == 0:
        if result_single is not None:
            decode["one device, batch 1"] = {**result_single, "sequences": 1, "calls": {}}
        result = {"env": environment(["benchmarks/bench_expert_parallel.py", *argv], device, world_size),
                  "config": {"shape": args.shape, "tiny": args.tiny, "kv_cache_dtype": kv_dtype, "kv_note": kv_note,
                             "context": args.context, "steps": args.steps, "warmup": args.warmup,
                             "page_size": args.page_size, "dispatch": args.dispatch,
                             "allgather_max_tokens": runtime.allgather_max_tokens, "seqs_per_rank": seqs_per_rank,
                             "rank0_peak_memory_bytes": memory},
                  "decode": decode, "dispatch_sweep": sweep}
        if result_single is not None:
            single_ms = result_single["step_ms_median"]
            result["batch1_vs_single"] = batch1[args.dispatch]["step_ms_median"] / single_ms
            result["batch1_best_vs_single"] = min(r["step_ms_median"] for r in batch1.values()) / single_ms
        tag = args.tag or ("cpu-tiny" if args.tiny else "gpu")
        path = write_results(args.out, f"expert-parallel-{tag}", result)
        print(path.read_text())
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

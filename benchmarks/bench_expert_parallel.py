"""Expert-parallel decode: Mixtral-8x7B shape, random bf16 weights, int3 KV, 128 sequences at 16k context.

    # 2 GPUs (one process per GPU; NCCL), about 3-5 minutes on 2 x H200:
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_expert_parallel.py --out benchmarks/results
    # the dispatch sweep alone:
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_expert_parallel.py --sweep-only --out benchmarks/results
    # CPU plumbing check with gloo, tiny shapes (timings meaningless as speed, except the dispatch sweep):
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_expert_parallel.py --tiny

Each rank builds only its own experts, directly on its device (distributed.sharding.build_random_model)
and its share of the sequences (data-parallel attention). KV pages are filled synthetically (random
pages quantized once and copied into every page; context lengths set directly), not by a 2M-token
prefill. Before anything is allocated, every rank checks that weights + KV pool + a working reserve
fit in its free device memory and stops with the numbers if not. Phases, on rank 0's clock:

1. decode with `--seqs` sequences at `--context` tokens: time per output token (median step time
   over `--steps` steps after `--warmup`), tokens/s, and the share of the step inside the
   dispatch/combine collectives (CUDA events around each collective; eager steps only); with
   `--dispatch` and, unless --no-compare, all_to_all and allgather forced;
2. batch 1 (one sequence on rank 0; the other ranks join each step with 0 tokens), same modes;
3. batch 1 on one device with the whole model (rank 0, after the expert-parallel model is freed),
   always with CUDA graphs (as bench_decode);
4. a dispatch sweep: one MoE layer (dispatch + experts + combine) per tokens-per-rank count, for
   all_to_all and allgather, to place `allgather_max_tokens`.

Rank 0 rewrites expert-parallel-<tag>.json and .md after every measurement ("complete": false until
the end), so a run cut by a time limit keeps what it measured; progress lines are flushed as they
happen. A rank that fails makes every rank stop at once (distributed.failure). Asserts nothing about
speed.

Decode steps replay CUDA graphs by default (the collectives captured inside each bucket's graph, see
docs/expert-parallel.md); `--enforce-eager` runs every expert-parallel step eagerly (the one-device
baseline keeps its graphs). Every run reports how its timed steps ran: graph steps (and how many of
those replayed a captured graph on every rank) and eager steps, e.g. "graphs 64/64 replayed on all
ranks" or "eager 64/64" (all_to_all steps are always eager: their split sizes are read on the host).
With --tiny on the CPU the graph path runs eagerly on its static buffers (no capture).

Pieces: expert_parallel_setup.py (progress lines, memory plan, engine config), expert_parallel_measure.py
(timed decode steps, the one-device baseline, the dispatch sweep), expert_parallel_report.py (JSON and
markdown results).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moekv.config import ParallelConfig  # noqa: E402
from moekv.distributed.failure import report_failure  # noqa: E402
from moekv.distributed.groups import init_expert_parallel, shutdown  # noqa: E402
from moekv.distributed.sharding import build_random_model  # noqa: E402
from moekv.engine.factory import initial_placements, make_runtime  # noqa: E402
from moekv.engine.lockstep import LockstepEngine  # noqa: E402
from moekv.models.registry import named_arch  # noqa: E402
from benchmarks.expert_parallel_measure import dispatch_sweep, run_decode, single_device_batch1  # noqa: E402
from benchmarks.expert_parallel_report import environment, step_kinds, write_results, write_sweep  # noqa: E402
from benchmarks.expert_parallel_setup import (GIB, TINY, engine_config, kv_dtype_available,  # noqa: E402
                                              kv_pool_bytes, log, memory_plan, replace_steps, synchronize,
                                              weight_bytes)


# ---------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--seqs", type=int, default=128, help="concurrent sequences over all ranks")
    parser.add_argument("--context", type=int, default=16384, help="cached tokens per sequence (a multiple of "
                        "the page size)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps (median)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode steps first (the first compiles)")
    parser.add_argument("--batch1-steps", type=int, default=None, help="timed steps of the batch-1 runs "
                        "(default: --steps)")
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
    parser.add_argument("--no-sweep", action="store_true", help="skip the dispatch sweep")
    parser.add_argument("--no-batch1", action="store_true", help="skip the expert-parallel batch-1 runs")
    parser.add_argument("--no-single", action="store_true", help="skip the one-device batch-1 baseline")
    parser.add_argument("--no-compare", action="store_true", help="decode with --dispatch only (default: also "
                        "with all_to_all and allgather forced)")
    parser.add_argument("--enforce-eager", action="store_true", help="expert-parallel decode steps run eagerly "
                        "(default: CUDA graphs, the collectives captured; the one-device baseline keeps its graphs)")
    parser.add_argument("--pg-timeout", type=float, default=600.0, help="seconds a collective may wait for a "
                        "peer (process groups' timeout; a rank that raises stops the others at once anyway)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (gloo): checks the code paths")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--tag", default=None, help="result file tag (default: gpu / cpu-tiny)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seqs, args.context = min(args.seqs, 8), min(args.context, 256)
        args.steps, args.warmup = min(args.steps, 8), min(args.warmup, 2)
    args.page_size = args.page_size or (128 if args.kv_cache_dtype.startswith("int") else 16)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.tiny:
        # NVLink multicast stays off (the GPU hosts require it; 2-GPU all_to_all does not use it anyway)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    group = init_expert_parallel(world_size, "cpu" if args.tiny else "auto", timeout=args.pg_timeout,
                                 control_timeout=args.pg_timeout)
    try:
        run(args, argv, group)
    except BaseException as exc:  # noqa: BLE001 - tell the other ranks, then end without NCCL teardown
        report_failure(exc, "bench_expert_parallel")
        sys.stdout.flush()
        sys.stderr.write(f"[rank {group.rank}] bench_expert_parallel failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)
    shutdown()
    return 0


def run(args, argv: list[str], group) -> None:
    device, rank, world_size = group.device, group.rank, group.world_size
    arch = named_arch(args.shape, **(TINY if args.tiny else {}))
    env = environment(argv, device, world_size)
    log(f"{world_size} ranks, backend {dist.get_backend()}, rank 0 on {device} ({env['gpu']}); commit {env['commit']}")
    runtime = make_runtime(ParallelConfig(expert_parallel_size=world_size, expert_dispatch=args.dispatch,
                                          allgather_max_tokens=args.allgather_max_tokens), group, time_comm=True)
    sweep_arch = replace(arch, hidden_size=args.sweep_hidden) if args.sweep_hidden else arch
    sweep_tokens = [int(t) for t in args.sweep_tokens.split(",") if t.strip()]
    layer = {"hidden_size": sweep_arch.hidden_size, "num_experts": arch.num_experts, "top_k": arch.top_k,
             "intermediate_size": arch.expert_intermediate_size, "reps": args.sweep_reps}

    if args.sweep_only:
        tag = args.tag or f"{'cpu-tiny' if args.tiny else 'gpu'}-h{sweep_arch.hidden_size}"
        result = {"env": env, "layer": layer, "dispatch_sweep": [], "complete": False}

        def save_rows(rows):
            if rank == 0:
                result["dispatch_sweep"] = list(rows)
                write_sweep(args.out, f"expert-parallel-sweep-{tag}", result)

        log(f"dispatch sweep: {sweep_tokens} tokens per rank, {args.sweep_reps} reps, hidden {sweep_arch.hidden_size}")
        dispatch_sweep(runtime, sweep_arch, sweep_tokens, args.sweep_reps, torch.bfloat16, device, save_rows)
        if rank == 0:
            result["complete"] = True
            print(write_sweep(args.out, f"expert-parallel-sweep-{tag}", result).read_text(), flush=True)
        return

    # -- set-up: KV format, memory plan, model -------------------------------------------------
    kv_dtype, kv_note = args.kv_cache_dtype, None
    why = kv_dtype_available(kv_dtype, arch, args.page_size, device)
    if why is not None:
        kv_note = f"{kv_dtype} unavailable ({why}); measured with bf16 KV pages"
        kv_dtype, args.page_size = "bf16", 16
        log(f"note: {kv_note}")
    if args.context % args.page_size:
        raise SystemExit(f"--context {args.context} is not a multiple of the page size {args.page_size}: the "
                         f"synthetic fill cannot write a partly filled page")
    seqs_per_rank = [len(range(r, args.seqs, world_size)) for r in range(world_size)]
    batch1_steps = args.batch1_steps or args.steps
    config = engine_config(replace_steps(args, max(args.steps, batch1_steps)), arch, kv_dtype, seqs_per_rank[0],
                           world_size, device, cuda_graphs=not args.enforce_eager)   # the longest run's pages
    placements = initial_placements(arch, world_size, 0)
    expert_bytes, other_bytes = weight_bytes(arch)
    local_slots = placements[min(placements)].slots_per_rank[rank]
    weights = other_bytes + expert_bytes * local_slots // arch.num_experts
    kv_pages, kv_bytes = kv_pool_bytes(config, arch)
    plan = memory_plan(f"expert parallel, {seqs_per_rank[0]} x {args.context} tokens per rank", weights, kv_bytes,
                       kv_pages, device, rank)
    log(f"memory plan per rank: weights {plan['weights_gib']:.1f} GiB ({local_slots} of {arch.num_experts} experts) "
        f"+ KV pool {plan['kv_pool_gib']:.1f} GiB ({kv_pages} pages of {args.page_size}, {kv_dtype})"
        + (f"; free {plan['free_gib']:.1f} of {plan['total_gib']:.1f} GiB" if "free_gib" in plan else ""))
    began = time.perf_counter()
    model = build_random_model(arch, runtime, placements, torch.bfloat16, device, seed=1)   # on device, local experts
    engine = LockstepEngine(config, model, None, runtime)
    if device.type != "cuda" and not args.enforce_eager:
        engine.runner.enable_graphs(capture=False)          # the CPU check: the graph path on its static buffers
    synchronize(device)
    log(f"expert-parallel decode steps: graph path {engine.runner.graph_mode or 'off'}"
        + (f" ({engine.runner.graph_fallback_reason})" if engine.runner.graph_fallback_reason else "")
        + f"; buckets {engine.runner.buckets}; auto dispatch uses allgather up to {runtime.allgather_max_tokens} "
        f"tokens per rank")
    log(f"built {args.shape} ({kv_dtype} KV) in {time.perf_counter() - began:.1f} s: {args.seqs} x {args.context} "
        f"tokens over {world_size} ranks {seqs_per_rank}")

    result = {"env": env,
              "config": {"shape": args.shape, "tiny": args.tiny, "kv_cache_dtype": kv_dtype, "kv_note": kv_note,
                         "context": args.context, "steps": args.steps, "warmup": args.warmup,
                         "batch1_steps": batch1_steps, "page_size": args.page_size,
                         "dispatch": args.dispatch, "allgather_max_tokens": runtime.allgather_max_tokens,
                         "seqs_per_rank": seqs_per_rank, "pg_timeout_s": args.pg_timeout,
                         "world_size": world_size, "cuda_graphs": engine.runner.graph_mode == "cuda",
                         "graph_path": engine.runner.graph_mode, "graph_buckets": engine.runner.buckets,
                         "graph_fallback_reason": engine.runner.graph_fallback_reason},
              "memory_plan_rank0": plan if rank == 0 else None,
              "decode": {}, "dispatch_sweep": [], "phases_done": [], "complete": False}
    tag = args.tag or ("cpu-tiny" if args.tiny else "gpu")
    stem = f"expert-parallel-{tag}"

    def save() -> None:
        if rank == 0:
            write_results(args.out, stem, result)

    save()
    modes = [args.dispatch]
    if not args.no_compare:
        modes += [m for m in ("all_to_all", "allgather") if m != args.dispatch]
    batch1: dict[str, dict] = {}
    phases = [("decode", None, args.steps)] + ([] if args.no_batch1 else [("batch1", 1, batch1_steps)])
    for phase, batch, steps in phases:
        for mode in modes:
            runtime.dispatch_mode = mode
            runtime.exchange_calls.clear()
            num_seqs = seqs_per_rank[rank] if batch is None else (1 if rank == 0 else 0)
            began = time.perf_counter()
            run = run_decode(engine, replace_steps(args, steps), arch, num_seqs, device)
            replayed: list = [None] * world_size               # every rank's replays (an idle rank's too)
            dist.all_gather_object(replayed, run["replayed_steps"], group=group.cpu_group)
            run["replayed_all_ranks"] = replayed
            label = ", batch 1" if batch == 1 else ""
            name = f"expert parallel x{world_size}{label}, {mode}"
            result["decode"][name] = {**run, "sequences": batch or args.seqs, "dispatch": mode,
                                      "calls": dict(runtime.exchange_calls)}
            if batch == 1:
                batch1[mode] = run
            log(f"{name}: {run['step_ms_median']:.2f} ms per step (p90 {run['step_ms_p90']:.2f}), "
                f"{(batch or args.seqs) / (run['step_ms_median'] / 1e3):.0f} tokens/s, timed steps: "
                f"{step_kinds(run)} ({run['captures']} captures), dispatch+combine "
                + (f"{100 * run['comm_share']:.0f}% of the step" if run["eager_steps"] else "n/a (graphs)")
                + f", first step {run['first_step_s']:.2f} s "
                f"[{time.perf_counter() - began:.1f} s]")
            save()
        if phase == "decode":
            peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
            memory: list = [None] * world_size
            dist.all_gather_object(memory, {"plan": plan, "peak_gib": peak}, group=group.cpu_group)
            result["memory"] = memory
        result["phases_done"].append(phase)
        save()
    runtime.dispatch_mode = args.dispatch

    # -- free the expert-parallel model (the runtime's layer list holds its expert weights too) --------
    runtime.layers.clear()
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        log(f"expert-parallel model freed: {torch.cuda.memory_allocated(device) / GIB:.2f} GiB still allocated on "
            f"rank 0")

    if not args.no_single:
        single = None
        if rank == 0:
            log("one device, batch 1: building the whole model on rank 0 (the other ranks wait)")
            began = time.perf_counter()
            try:       # rank 0 alone, no collectives: a failure here (e.g. out of memory) spares the sweep
                single = single_device_batch1(replace_steps(args, batch1_steps), arch, kv_dtype, device)
            except Exception as exc:  # noqa: BLE001 - recorded in the results, the run goes on
                result["single_error"] = f"{type(exc).__name__}: {exc}"
                log(f"one device, batch 1 FAILED ({result['single_error']}); going on\n{traceback.format_exc()}")
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if single is not None:
            result["decode"]["one device, batch 1"] = {**single, "sequences": 1, "calls": {}}
            if batch1:
                single_ms = single["step_ms_median"]
                if args.dispatch in batch1:
                    result["batch1_vs_single"] = batch1[args.dispatch]["step_ms_median"] / single_ms
                result["batch1_best_vs_single"] = min(r["step_ms_median"] for r in batch1.values()) / single_ms
                result.setdefault("batch1_vs_single", result["batch1_best_vs_single"])
            log(f"one device, batch 1: {single['step_ms_median']:.2f} ms per step (CUDA graphs: "
                f"{single['cuda_graphs']}; timed steps: {step_kinds(single)}) [{time.perf_counter() - began:.1f} s]")
            result["phases_done"].append("single")
        save()
        dist.barrier(group=group.cpu_group)

    if not args.no_sweep:
        log(f"dispatch sweep: {sweep_tokens} tokens per rank, {args.sweep_reps} reps, hidden {sweep_arch.hidden_size}")

        def save_rows(rows):
            result["dispatch_sweep"] = list(rows)
            save()

        dispatch_sweep(runtime, sweep_arch, sweep_tokens, args.sweep_reps, torch.bfloat16, device, save_rows)
        result["phases_done"].append("sweep")
    result["complete"] = True
    save()
    if rank == 0:
        print((args.out / f"{stem}.md").read_text(), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Measurements of benchmarks/bench_expert_parallel.py: timed decode steps (and how they ran: graphs or eager),
the one-device batch-1 baseline, and the dispatch sweep (one MoE layer per exchange and tokens-per-rank count)."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from benchmarks.expert_parallel_setup import (GIB, engine_config, kv_pool_bytes, log, memory_plan, synchronize,
                                              weight_bytes)
from benchmarks.synthetic_kv import admit_with_context, fill_kv_synthetic
from moekv.distributed.expert_parallel import ExpertParallelExperts
from moekv.distributed.placement import ExpertPlacement


def time_decode(engine, steps: int, warmup: int, device) -> dict:
    """Median step time over `steps` decode steps (every running sequence gains one token per step), and
    how the timed steps ran: through the graph buckets (replayed or, without capture, eagerly) or eagerly."""
    runtime = getattr(engine, "runtime", None)
    runner = engine.runner
    times, comm = [], []
    kinds = {"graph": 0, "replayed": 0, "eager": 0}
    captures_before = runner.captures
    first_step_s = None
    for index in range(warmup + steps):
        graph_steps, replays = runner.graph_steps, runner.graph_replays
        synchronize(device)
        began = time.perf_counter()
        engine.step()
        synchronize(device)
        elapsed = time.perf_counter() - began
        spent = sum(runtime.timer.read().values()) if runtime is not None else 0.0
        if index == 0:
            first_step_s = elapsed                  # includes any kernel compilation and graph capture
        if index >= warmup:
            times.append(elapsed)
            comm.append(spent)
            graph = runner.graph_steps > graph_steps
            kinds["graph" if graph else "eager"] += 1
            kinds["replayed"] += runner.graph_replays > replays
    median = statistics.median(times)
    ordered = sorted(times)
    return {"steps": steps, "warmup": warmup, "step_ms_median": 1e3 * median,
            "step_ms_p10": 1e3 * ordered[len(ordered) // 10], "step_ms_p90": 1e3 * ordered[(9 * len(ordered)) // 10],
            "comm_ms_median": 1e3 * statistics.median(comm), "comm_share": statistics.median(comm) / median,
            "first_step_s": first_step_s, "graph_steps": kinds["graph"], "replayed_steps": kinds["replayed"],
            "eager_steps": kinds["eager"], "captures": runner.captures - captures_before,
            "graph_mode": runner.graph_mode, "graph_fallback_reason": runner.graph_fallback_reason}


def abort_all(engine) -> None:
    for request_id in list(engine.requests):
        engine.abort(request_id)
        engine.release(request_id)


def dispatch_sweep(runtime, arch, tokens_list: list[int], reps: int, dtype, device, on_row=None) -> list[dict]:
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
    try:
        for tokens in tokens_list:
            began_row = time.perf_counter()
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
            log(f"sweep {tokens} tokens/rank: all_to_all {row['all_to_all_ms']:.3f} ms, allgather "
                f"{row['allgather_ms']:.3f} ms ({time.perf_counter() - began_row:.1f} s)")
            if on_row is not None:
                on_row(rows)
    finally:
        runtime.dispatch_mode = saved
        runtime.layers.remove(experts)
    return rows


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

    config = engine_config(args, arch, kv_dtype, 1, 1, device, cuda_graphs=True)      # graphs, as bench_decode
    experts, other = weight_bytes(arch)
    pages, kv = kv_pool_bytes(config, arch)
    plan = memory_plan("one device, batch 1", experts + other, kv, pages, device, 0)
    began = time.perf_counter()
    model = build_full_model(arch, dtype=torch.bfloat16, device=device, seed=1)    # allocated and filled on device
    engine = Engine(config, model=model)
    synchronize(device)
    log(f"one device: whole model built in {time.perf_counter() - began:.1f} s")
    if device.type != "cuda" and not args.enforce_eager:
        engine.runner.enable_graphs(capture=False)          # the CPU check: the same static-buffer path
    result = run_decode(engine, args, arch, 1, device)
    result["cuda_graphs"] = engine.runner.graph_mode == "cuda"
    result["memory_plan"] = plan
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result

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
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moekv.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig,  # noqa: E402
                          SchedulerConfig)
from moekv.distributed.expert_parallel import ExpertParallelExperts  # noqa: E402
from moekv.distributed.failure import report_failure  # noqa: E402
from moekv.distributed.groups import init_expert_parallel, shutdown  # noqa: E402
from moekv.distributed.placement import ExpertPlacement  # noqa: E402
from moekv.distributed.sharding import build_random_model  # noqa: E402
from moekv.engine.factory import initial_placements, make_runtime  # noqa: E402
from moekv.engine.lockstep import LockstepEngine  # noqa: E402
from moekv.models.registry import named_arch  # noqa: E402
from moekv.provenance import git_commit  # noqa: E402
from benchmarks.synthetic_kv import admit_with_context, fill_kv_synthetic  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            expert_intermediate_size=128, max_position_embeddings=4096)
GIB = 1 << 30
RESERVE_BYTES = 4 * GIB        # activations, kernel workspaces, the CUDA caching allocator's slack
_T0 = time.perf_counter()
_RANK = int(os.environ.get("RANK", "0"))


def log(message: str, all_ranks: bool = False) -> None:
    """A progress line on rank 0 (or on every rank), flushed at once: a run cut by a time limit shows
    how far it got."""
    if _RANK == 0 or all_ranks:
        prefix = f"[{time.perf_counter() - _T0:7.1f}s]" + (f" rank {_RANK}:" if all_ranks else "")
        print(f"{prefix} {message}", flush=True)


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


def weight_bytes(arch, dtype=torch.bfloat16) -> tuple[int, int]:
    """(expert bytes, all other parameter bytes) of the whole model, counted on the meta device."""
    from moekv.models.registry import model_class

    model = model_class(arch.architecture)(arch, dtype=dtype, device="meta")
    experts = other = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if ".experts." in name:
            experts += size
        else:
            other += size
    return experts, other


def kv_pool_bytes(config: EngineConfig, arch) -> tuple[int, int]:
    """(pages, bytes) of the KV pool an engine with `config` allocates (the format's own accounting)."""
    from moekv.kvcache import KVCacheSpec, kv_cache_class

    cache = config.cache
    spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, cache.page_size, torch.bfloat16)
    format_class = kv_cache_class(cache.kv_cache_dtype)
    pages = cache.num_pages
    return pages, pages * format_class.bytes_per_page(spec, cache) + format_class.fixed_bytes(spec, cache)


def memory_plan(what: str, weights: int, kv: int, kv_pages: int, device, rank: int) -> dict:
    """Check that `weights` + `kv` + a reserve fit in the free device memory; ConfigError-like
    RuntimeError with the numbers if not (CPU: recorded, not checked)."""
    plan = {"what": what, "weights_gib": weights / GIB, "kv_pool_gib": kv / GIB, "kv_pages": kv_pages,
            "reserve_gib": RESERVE_BYTES / GIB}
    if device.type != "cuda":
        return plan
    free, total = torch.cuda.mem_get_info(device)
    plan.update(free_gib=free / GIB, total_gib=total / GIB)
    need = weights + kv + RESERVE_BYTES
    if need > free:
        raise RuntimeError(
            f"rank {rank}, {what}: needs {need / GIB:.1f} GiB (weights {weights / GIB:.1f} + KV pool "
            f"{kv / GIB:.1f} for {kv_pages} pages + reserve {RESERVE_BYTES / GIB:.0f}) but only {free / GIB:.1f} "
            f"of {total / GIB:.1f} GiB are free on {device}; lower --seqs or --context, use more ranks, or a "
            f"smaller --kv-cache-dtype")
    return plan


# ---------------------------------------------------------------- measurements
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


def step_kinds(run: dict) -> str:
    """How a run's timed steps ran, in words: "graphs 64/64 replayed on all ranks", "eager 64/64", ..."""
    total = run["steps"]
    replayed = run.get("replayed_all_ranks", [run.get("replayed_steps", 0)])
    parts = []
    if run.get("graph_steps"):
        graphs = run["graph_steps"]
        if max(replayed) == 0:
            how = "on static buffers, not captured"
        elif min(replayed) == graphs:
            how = "replayed on all ranks" if len(replayed) > 1 else "replayed"
        else:
            how = f"replayed {'/'.join(map(str, replayed))} per rank"
        parts.append(f"graphs {graphs}/{total} {how}")
    if run.get("eager_steps"):
        parts.append(f"eager {run['eager_steps']}/{total}")
    return ", ".join(parts) or "?"


def graph_path_words(mode: str | None, reason: str | None) -> str:
    if mode == "cuda":
        return "CUDA graphs"
    if mode == "static":
        return "the graph path on static buffers (no capture off CUDA)"
    return f"eager ({reason})" if reason else "eager"


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


# ---------------------------------------------------------------- engines
def engine_config(args, arch, kv_dtype: str, seqs_per_rank: int, ep_size: int, device,
                  cuda_graphs: bool = True) -> EngineConfig:
    page = args.page_size
    pages_per_seq = -(-(args.context + args.steps + args.warmup + 2) // page)
    return EngineConfig(
        model=ModelConfig(model=args.shape, dtype="bf16", max_model_len=args.context + args.steps + args.warmup + 8),
        cache=CacheConfig(kv_cache_dtype=kv_dtype, page_size=page, num_pages=max(1, seqs_per_rank) * pages_per_seq + 4,
                          staging_pages=max(1, seqs_per_rank) + 8 if kv_dtype.startswith("int") else None),
        scheduler=SchedulerConfig(max_num_seqs=max(1, seqs_per_rank), max_num_batched_tokens=max(256, seqs_per_rank)),
        parallel=ParallelConfig(expert_parallel_size=ep_size, expert_dispatch=args.dispatch,
                                allgather_max_tokens=args.allgather_max_tokens),
        device=DeviceConfig(str(device), cuda_graphs=cuda_graphs))


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


# ---------------------------------------------------------------- outputs
def launch_command(argv: list[str], world_size: int) -> str:
    """The command as launched (torchrun's own flags are not visible to a worker: rebuilt from its env)."""
    script = "benchmarks/bench_expert_parallel.py " + " ".join(shlex.quote(a) for a in argv)
    nnodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)) or world_size)
    launcher = "torchrun --standalone" if nnodes == 1 else f"torchrun --nnodes {nnodes}"
    return f"{launcher} --nproc-per-node {per_node} {script}".strip()


def environment(argv: list[str], device, world_size: int) -> dict:
    commit = git_commit() or "unknown"
    extra: dict = {}
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        extra.update(cuda=torch.version.cuda, gpu_memory_gib=torch.cuda.get_device_properties(device).total_memory / GIB)
        try:
            version = torch.cuda.nccl.version()
            extra["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - provenance only
            pass
    else:
        gpu = f"cpu (gloo, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})"
    try:
        import triton

        extra["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - provenance only
        pass
    return {"gpu": f"{world_size} x {gpu}", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": commit, "torch": torch.__version__, "backend": dist.get_backend(),
            "command": launch_command(argv, world_size), **extra}


def write_json(path: Path, result: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)                      # a run killed mid-write keeps the previous complete file


def write_results(out_dir: Path, stem: str, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / f"{stem}.json", result)
    env, cfg = result["env"], result["config"]
    status = "complete" if result.get("complete") else \
        f"PARTIAL: phases done {', '.join(result.get('phases_done', [])) or 'none'} (the run stopped or is running)"
    lines = [f"# Expert-parallel decode ({cfg['shape']}, {env['gpu']})", "",
             f"{env['date']}, commit {env['commit']}, torch {env['torch']}" +
             (f", NCCL {env['nccl']}" if env.get("nccl") else "") + f". Status: {status}.",
             f"Command: `{env['command']}`", "",
             f"KV cache: {cfg['kv_cache_dtype']}" + (f" ({cfg['kv_note']})" if cfg.get("kv_note") else "")
             + f"; context {cfg['context']} tokens; dispatch {cfg['dispatch']} (allgather up to "
             f"{cfg['allgather_max_tokens']} tokens per rank); {cfg['steps']} timed steps after {cfg['warmup']}; "
             f"sequences per rank {cfg['seqs_per_rank']}.",
             "Expert-parallel decode steps: "
             + graph_path_words(cfg.get("graph_path"), cfg.get("graph_fallback_reason"))
             + ". Dispatch+combine share: CUDA events around each collective, eager steps only (a replayed "
             "graph cannot be timed inside).",
             "", "| run | sequences | time per output token (ms, median) | p90 | tokens/s | timed steps ran as "
             "| dispatch+combine share | first step (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, run in result["decode"].items():
        tps = run["sequences"] / (run["step_ms_median"] / 1e3)
        first = run.get("first_step_s")
        share = f"{100 * run['comm_share']:.0f}%" if run.get("eager_steps", 1) else "n/a"
        lines.append(f"| {name} | {run['sequences']} | {run['step_ms_median']:.2f} | {run['step_ms_p90']:.2f} "
                     f"| {tps:.0f} | {step_kinds(run)} | {share} | " + (f"{first:.2f} |" if first is not None else "|"))
    if "batch1_vs_single" in result:
        single = result["decode"].get("one device, batch 1", {})
        graphs = graph_path_words(single.get("graph_mode"), single.get("graph_fallback_reason"))
        ep_run = result["decode"].get(f"expert parallel x{cfg.get('world_size', 2)}, batch 1, {cfg['dispatch']}", {})
        lines += ["", f"Batch 1, expert parallel ({cfg['dispatch']}, {step_kinds(ep_run) if ep_run else '?'}) vs one "
                  f"device ({graphs}): {result['batch1_vs_single']:.3f}x; best dispatch: "
                  f"{result['batch1_best_vs_single']:.3f}x (target <= 1.15 on GPUs)."]
    if result.get("single_error"):
        lines += ["", f"One-device baseline failed: {result['single_error']}"]
    memory = result.get("memory")
    if memory:
        lines += ["", "Device memory per rank (GiB): " + "; ".join(
            f"rank {r}: planned weights {m['plan']['weights_gib']:.1f} + KV pool {m['plan']['kv_pool_gib']:.1f}"
            + (f", peak allocated {m['peak_gib']:.1f}" if m.get("peak_gib") is not None else "")
            for r, m in enumerate(memory))]
    if "cpu" in env["gpu"]:
        lines += ["", "CPU run: these timings check the code paths; they say nothing about GPU speed."]
    if result.get("dispatch_sweep"):
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
    write_json(out_dir / f"{stem}.json", result)
    env, layer = result["env"], result["layer"]
    status = "complete" if result.get("complete") else "PARTIAL (the run stopped or is running)"
    lines = [f"# Expert-parallel dispatch sweep ({env['gpu']})", "",
             f"{env['date']}, commit {env['commit']}, torch {env['torch']}" +
             (f", NCCL {env['nccl']}" if env.get("nccl") else "") + f". Status: {status}.",
             f"Command: `{env['command']}`", "",
             f"One MoE layer, {layer['num_experts']} experts top-{layer['top_k']}, hidden {layer['hidden_size']}, "
             f"expert intermediate {layer['intermediate_size']}, bf16: dispatch + local experts + combine, "
             f"median of {layer['reps']} calls (ms).", ""] + sweep_table(result["dispatch_sweep"])
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


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


def replace_steps(args, steps: int) -> argparse.Namespace:
    """args with `steps` timed steps (the batch-1 runs may time fewer)."""
    return argparse.Namespace(**{**vars(args), "steps": steps})


if __name__ == "__main__":
    sys.exit(main())

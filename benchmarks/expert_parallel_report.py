"""Outputs of benchmarks/bench_expert_parallel.py: provenance (the launch command, versions) and the JSON +
markdown result files, rewritten after every measurement (a run cut by a time limit keeps what it measured)."""

from __future__ import annotations

import datetime
import json
import os
import shlex
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.expert_parallel_setup import GIB
from moekv.provenance import git_commit


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

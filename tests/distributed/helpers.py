"""Shared by the expert-parallel tests and their torchrun worker (tests/distributed/ep_worker.py):
tiny random models, greedy generation with one process, and launching torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from moekv.config import (ArchConfig, CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig,
                          SchedulerConfig)
from moekv.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ep_worker.py")


def tiny_arch(num_experts: int = 5, top_k: int = 2, num_layers: int = 2) -> ArchConfig:
    return ArchConfig(architecture="mixtral", vocab_size=128, hidden_size=32, num_layers=num_layers, num_heads=4,
                      num_kv_heads=2, head_dim=8, num_experts=num_experts, top_k=top_k, expert_intermediate_size=16,
                      norm_topk_prob=True, max_position_embeddings=256)


def engine_config(ep_size: int = 1, scheduler: dict | None = None, device: str = "cpu", cuda_graphs: bool = True,
                  **parallel) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="random", max_model_len=128),
                        cache=CacheConfig(kv_cache_dtype="fp32", page_size=4, num_pages=256),
                        scheduler=SchedulerConfig(**(scheduler or {})),
                        parallel=ParallelConfig(expert_parallel_size=ep_size, **parallel),
                        device=DeviceConfig(device, cuda_graphs=cuda_graphs))


def prompts_and_params(lengths=(5, 9, 3, 7, 2), max_tokens=(6, 3, 8, 2, 5), seed: int = 0):
    """Prompts of uneven lengths and budgets, so ranks run out of work at different steps."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    return prompts, params


def greedy_tokens(engine, prompts, params) -> list[list[int]]:
    """Generate with a plain (single-process) Engine; one batch, greedy."""
    from moekv.entrypoints.llm import collect_outputs

    ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return [out.outputs[0].token_ids for out in collect_outputs(engine, prompts, ids)]


def single_process_tokens(arch: ArchConfig, seed: int, prompts, params, fp8: bool = False) -> list[list[int]]:
    from moekv.engine.engine import Engine
    from moekv.models.loader import build_random_model
    from moekv.models.quantize import quantize_model

    model = build_random_model(arch, dtype=torch.float32, seed=seed)
    if fp8:
        quantize_model(model)
    return greedy_tokens(Engine(engine_config(), model=model), prompts, params)


def run_torchrun(nproc: int, args: list[str], timeout: float = 240.0, module: bool = False,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone` (it picks a free port) with `nproc` CPU processes; raises with the output on failure."""
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    command = [*launcher, "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", *args] if module else [str(WORKER), *args]
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": "",
                "PYTHONWARNINGS": "ignore", **(env or {})}
    result = subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"torchrun exited with {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}"
                             f"\n--- stderr ---\n{result.stderr[-6000:]}")
    return result


def run_worker(nproc: int, scenarios: list[dict], tmp_path: Path, timeout: float = 240.0,
               env: dict | None = None) -> dict[str, dict]:
    """Run ep_worker.py's scenarios on `nproc` ranks; returns {name: rank 0's result}."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"scenarios": scenarios}))
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    run_torchrun(nproc, [str(spec), str(out_dir)], timeout=timeout, env=env)
    return {s["name"]: json.loads((out_dir / f"{s['name']}.json").read_text()) for s in scenarios}

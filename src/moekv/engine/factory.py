"""The one place that decides which engine runs: `build_engine` for the offline API and `moekv generate`,
`build_serving_engine` for `moekv serve`.

    expert_parallel_size == 1   Engine (engine/engine.py): one process
    expert_parallel_size > 1    LockstepEngine (engine/lockstep.py), one per rank under torchrun:
                                   torchrun --nproc-per-node 2 script.py   # LLM(model, expert_parallel_size=2)
                                   torchrun --nproc-per-node 2 -m moekv generate --expert-parallel-size 2 ...
                                serving: rank 0's LeaderEngine (engine/leader.py), the others follow it

Under expert parallelism the checkpoint is loaded on each rank's CPU, the rank keeps its experts
(distributed.sharding), the rest is replicated and moved to cuda:LOCAL_RANK (or kept on the CPU with
gloo). A rank that fails while the others wait on it (loading, a step, the final gather) is reported to
them (distributed.failure): they stop at once with its error instead of hanging in a collective. On GPUs
decode steps replay CUDA graphs with the MoE collectives captured, when all ranks agree on a bucket
(docs/expert-parallel.md, "CUDA-graph decode steps"); `cuda_graphs=False` / `--enforce-eager` runs every
step eagerly.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moekv.config import ArchConfig, EngineConfig, ParallelConfig, torch_dtype
from moekv.distributed.balancer import initial_placement
from moekv.distributed.expert_parallel import ExpertParallelRuntime
from moekv.distributed.failure import collective_section
from moekv.distributed.groups import ExpertParallelGroup, init_expert_parallel
from moekv.distributed.placement import ExpertPlacement
from moekv.distributed.sharding import shard_experts
from moekv.engine.engine import Engine
from moekv.engine.leader import LeaderEngine, follower_loop
from moekv.engine.lockstep import LockstepEngine
from moekv.errors import ConfigError


def build_engine(config: EngineConfig, time_comm: bool = False) -> Engine:
    """The engine this process runs: an Engine, or under expert parallelism this rank's LockstepEngine."""
    if config.parallel.expert_parallel_size > 1:
        return build_lockstep_engine(config, time_comm)
    return Engine(config)


def build_serving_engine(config: EngineConfig) -> Engine | LeaderEngine | None:
    """The engine an HTTP server drives: an Engine, or under expert parallelism rank 0's LeaderEngine;
    on the other ranks None, after they have served the leader's steps until it stopped them."""
    engine = build_engine(config)
    if engine.world_size == 1:
        return engine
    if engine.rank == 0:
        return LeaderEngine(engine)
    follower_loop(engine)
    return None


def initial_placements(arch: ArchConfig, num_ranks: int, num_redundant: int) -> dict[int, ExpertPlacement]:
    """The starting placement of every MoE layer (ConfigError if the redundancy cannot be placed)."""
    try:
        placement = initial_placement(arch.num_experts, num_ranks, num_redundant)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return {layer: placement for layer in range(arch.num_layers) if arch.is_moe_layer(layer)}


def make_runtime(parallel: ParallelConfig, group: ExpertParallelGroup,
                 time_comm: bool = False) -> ExpertParallelRuntime:
    return ExpertParallelRuntime(group, parallel.expert_dispatch, parallel.allgather_max_tokens,
                                 parallel.num_redundant_experts, time_comm=time_comm)


def build_lockstep_engine(config: EngineConfig, time_comm: bool = False) -> LockstepEngine:
    """This rank's engine: the checkpoint loaded on the CPU, this rank's experts kept, the rest replicated,
    everything moved to cuda:LOCAL_RANK (or kept on the CPU with gloo)."""
    from moekv.models.loader import load_model
    from moekv.tokenizer import Tokenizer

    if getattr(config, "offload", None) is not None and config.offload.cpu_offload_experts:
        raise ConfigError("cpu_offload_experts cannot be combined with expert_parallel_size > 1 yet")
    group = init_expert_parallel(config.parallel.expert_parallel_size, config.device.device)
    model_dir = Path(config.model.model)
    dtype = None if config.model.dtype == "auto" else torch_dtype(config.model.dtype)
    with collective_section("building the engine", unreported=(ConfigError,)):
        model = load_model(model_dir, dtype=dtype, device="cpu", progress=None if group.rank == 0 else False,
                           quantization=config.model.quantization)
        runtime = make_runtime(config.parallel, group, time_comm)
        placements = initial_placements(model.arch, group.world_size, config.parallel.num_redundant_experts)
        model = shard_experts(model, runtime, placements, group.device)
        tokenizer_dir = Path(config.model.tokenizer_dir)
        tokenizer = Tokenizer(tokenizer_dir) if (tokenizer_dir / "tokenizer.json").is_file() else None
    config = replace(config, device=replace(config.device, device=str(group.device)))
    return LockstepEngine(config, model, tokenizer, runtime)

"""The offline API and `moekv generate` with expert parallelism: one process per rank, under torchrun.

    torchrun --nproc-per-node 2 script.py      # script.py: LLM(model, expert_parallel_size=2).generate(prompts)
    torchrun --nproc-per-node 2 -m moekv generate --expert-parallel-size 2 --prompt "ROMEO:"

Every rank runs the same script with the same prompts. `generate_lockstep`: every rank validates
every prompt (a bad prompt raises on all ranks alike), rank r keeps prompts r, r + N, r + 2N, ...,
the ranks step in lockstep until no rank has work (distributed.lockstep), and the outputs are
all-gathered so every rank returns the full list in prompt order.

A rank that fails while the others wait on it (loading, a step, the final gather) is reported to
them (distributed.failure): they stop at once with its error instead of hanging in a collective.

On GPUs decode steps replay CUDA graphs with the MoE collectives captured, when all ranks agree on a
bucket (docs/expert-parallel.md, "CUDA-graph decode steps"); `cuda_graphs=False` / `--enforce-eager`
runs every step eagerly.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from moekv.config import ArchConfig, EngineConfig, ParallelConfig, torch_dtype
from moekv.distributed.balancer import initial_placement
from moekv.distributed.expert_parallel import ExpertParallelRuntime
from moekv.distributed.failure import collective_section
from moekv.distributed.groups import ExpertParallelGroup, init_expert_parallel
from moekv.distributed.lockstep import LockstepEngine
from moekv.distributed.placement import ExpertPlacement
from moekv.distributed.sharding import shard_experts
from moekv.errors import ConfigError


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


def build_engine(config: EngineConfig, time_comm: bool = False) -> LockstepEngine:
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
        model = load_model(model_dir, dtype=dtype, device="cpu", progress=None if group.rank == 0 else False)
        runtime = make_runtime(config.parallel, group, time_comm)
        placements = initial_placements(model.arch, group.world_size, config.parallel.num_redundant_experts)
        model = shard_experts(model, runtime, placements, group.device)
        tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    config = replace(config, device=replace(config.device, device=str(group.device)))
    return LockstepEngine(config, model, tokenizer, runtime)


def generate_lockstep(engine: LockstepEngine, prompts: list, sampling_params: list) -> list:
    """LLM.generate under expert parallelism (see the module docstring); every rank gets every output."""
    from moekv.entrypoints.llm import add_all_or_none, collect_outputs

    request_ids = add_all_or_none(engine, prompts, sampling_params)
    mine = list(range(engine.rank, len(prompts), engine.world_size))
    for index, request_id in enumerate(request_ids):
        if index % engine.world_size != engine.rank:
            engine.abort(request_id)
            engine.release(request_id)
    while engine.has_unfinished():                  # collective: all ranks leave the loop together
        engine.step()
    gathered: list = [None] * engine.world_size
    with collective_section("gathering the outputs"):
        local = collect_outputs(engine, [prompts[i] for i in mine], [request_ids[i] for i in mine])
        dist.all_gather_object(gathered, list(zip(mine, local)), group=engine.runtime.group.cpu_group)
    ordered = sorted((pair for part in gathered for pair in part), key=lambda pair: pair[0])
    return [output for _, output in ordered]


def follow(engine: LockstepEngine) -> None:
    """A rank without requests of its own (e.g. `moekv generate` on ranks > 0): join steps until all are done."""
    while engine.has_unfinished():
        engine.step()

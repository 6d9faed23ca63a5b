"""Process groups for expert parallelism, set up from torchrun's environment.

torchrun starts one process per GPU (`torchrun --nproc-per-node N`, or `--nnodes M` across
machines) and exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the default
process group is initialised from them (NCCL on CUDA, gloo on the CPU). Two groups are used:

- `device_group` moves tokens and expert weights (the default group: NCCL on GPUs; held as None,
  because a Python reference to the world group that outlives destroy_process_group() can abort
  the interpreter at exit);
- `cpu_group` (always gloo, CPU tensors) carries the small per-step control messages (work flags,
  token counts, request lists), so agreeing on a step never waits on a GPU stream.

Today the expert-parallel group is the whole world: expert_parallel_size must equal WORLD_SIZE.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moekv.errors import ConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
CONTROL_TIMEOUT = timedelta(days=7)   # an idle server's followers wait on the control group this long


@dataclass(frozen=True)
class ExpertParallelGroup:
    """This process's place in the expert-parallel group and the groups it talks over."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    device_group: dist.ProcessGroup | None     # None: the default (world) group
    cpu_group: dist.ProcessGroup

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARS)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """'auto' -> cuda:LOCAL_RANK when CUDA is available, else cpu; 'cuda' -> cuda:LOCAL_RANK."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_expert_parallel(size: int, device: str = "auto") -> ExpertParallelGroup:
    """Join (or initialise) the default process group and return this rank's expert-parallel group.

    Every rank must call this at the same point (it creates the gloo control group collectively).
    """
    if not dist.is_initialized():
        if not launched_by_torchrun():
            raise ConfigError(f"expert_parallel_size={size} runs one process per rank: launch with "
                              f"`torchrun --nproc-per-node {size} ...` (the environment has no "
                              f"{'/'.join(n for n in TORCHRUN_VARS if n not in os.environ)})")
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != size:
            raise ConfigError(f"expert_parallel_size={size} but torchrun started {world_size} processes; "
                              f"use --nproc-per-node {size} (times the number of nodes)")
        local_rank = int(os.environ["LOCAL_RANK"])
        target = resolve_device(device, local_rank)
        if target.type == "cuda":
            torch.cuda.set_device(target)
        dist.init_process_group("nccl" if target.type == "cuda" else "gloo")
        atexit.register(shutdown)      # a process group left open at exit can abort the interpreter
    world_size = dist.get_world_size()
    if world_size != size:
        raise ConfigError(f"expert_parallel_size={size} but the process group has {world_size} ranks")
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    target = resolve_device(device, local_rank)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)   # its own group even on the CPU
    return ExpertParallelGroup(rank=dist.get_rank(), world_size=world_size, local_rank=local_rank,
                               device=target, device_group=None, cpu_group=cpu_group)


def shutdown() -> None:
    """Destroy the default process group (call once, at the end of a torchrun script)."""
    if dist.is_initialized():
        dist.destroy_process_group()

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

NCCL specifics: the rank's GPU (cuda:LOCAL_RANK) is made current before the group is initialised,
so NCCL's communicators bind to it; collectives on `device_group` take tensors on that GPU (NCCL
cannot take CPU tensors), control messages go over `cpu_group` on CPU tensors; no barrier or object
collective is run on the NCCL group. The device group's timeout (`device_timeout`: the `timeout`
argument, else MOEKV_EP_TIMEOUT_S, else 600 s) bounds a collective a peer never joins; the NCCL
watchdog then ends the process. A rank that raises is reported to the others at once
(distributed.failure), so they stop within a fraction of a second instead of waiting that long.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moekv import envs
from moekv.distributed import failure
from moekv.errors import ConfigError

CONTROL_TIMEOUT = timedelta(days=7)   # an idle server's followers wait on the control group this long
DEVICE_TIMEOUT = timedelta(minutes=10)   # torch's NCCL default, made explicit


def device_timeout(timeout: timedelta | float | None = None) -> timedelta:
    """The device group's timeout: `timeout` (seconds or timedelta), else MOEKV_EP_TIMEOUT_S, else 10 min."""
    if timeout is None:
        timeout = envs.ep_timeout_s()
        if timeout is None:
            return DEVICE_TIMEOUT
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ConfigError(f"the expert-parallel timeout must be positive, got {timeout}")
    return timeout


def backend_for(device: torch.device) -> str:
    """The device group's backend: NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


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
    return not envs.torchrun_missing()


def resolve_device(device: str, local_rank: int) -> torch.device:
    """'auto' -> cuda:LOCAL_RANK when CUDA is available, else cpu; 'cuda' -> cuda:LOCAL_RANK."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_expert_parallel(size: int, device: str = "auto", timeout: timedelta | float | None = None,
                         control_timeout: timedelta | float | None = None) -> ExpertParallelGroup:
    """Join (or initialise) the default process group and return this rank's expert-parallel group.

    Every rank must call this at the same point (it creates the gloo control group collectively).
    timeout: the device group's (see `device_timeout`; only when this call initialises it);
    control_timeout: the gloo control group's (default 7 days: idle serving followers wait there).
    """
    if not dist.is_initialized():
        if not launched_by_torchrun():
            raise ConfigError(f"expert_parallel_size={size} runs one process per rank: launch with "
                              f"`torchrun --nproc-per-node {size} ...` (the environment has no "
                              f"{'/'.join(envs.torchrun_missing())})")
        world_size = envs.torchrun_int("WORLD_SIZE")
        if world_size != size:
            raise ConfigError(f"expert_parallel_size={size} but torchrun started {world_size} processes; "
                              f"use --nproc-per-node {size} (times the number of nodes)")
        local_rank = envs.torchrun_int("LOCAL_RANK")
        target = resolve_device(device, local_rank)
        if target.type == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                                  f"start at most that many processes per node (--nproc-per-node)")
            torch.cuda.set_device(target)     # before init: NCCL binds its communicators to the current GPU
        # no device_id: eager NCCL init would also bind the gloo control group to the GPU; nothing
        # here needs it (no barrier or object collective runs on the NCCL group)
        dist.init_process_group(backend_for(target), timeout=device_timeout(timeout))
        atexit.register(_exit_shutdown)   # a process group left open at exit can abort the interpreter
    world_size = dist.get_world_size()
    if world_size != size:
        raise ConfigError(f"expert_parallel_size={size} but the process group has {world_size} ranks")
    local_rank = envs.torchrun_int("LOCAL_RANK", dist.get_rank())
    target = resolve_device(device, local_rank)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    if control_timeout is None:
        control_timeout = CONTROL_TIMEOUT
    elif not isinstance(control_timeout, timedelta):
        control_timeout = timedelta(seconds=float(control_timeout))
    cpu_group = dist.new_group(backend="gloo", timeout=control_timeout)   # its own group even on the CPU
    _start_failure_monitor(dist.get_rank())
    return ExpertParallelGroup(rank=dist.get_rank(), world_size=world_size, local_rank=local_rank,
                               device=target, device_group=None, cpu_group=cpu_group)


def _start_failure_monitor(rank: int) -> None:
    """Watch the failure flag in the default group's store (distributed.failure); skipped, with the
    process groups' timeouts as the only bound, if this torch does not expose the store."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API: degrade to timeouts only
        return
    failure.start_monitor(store, rank)


_BEFORE_SHUTDOWN: list[weakref.WeakMethod] = []


def before_shutdown(method) -> None:
    """Call the bound `method` (if its object is still alive) before the process group is destroyed.

    Lockstep engines register their runner's `reset_graphs`: NCCL's communicator destruction waits until
    every CUDA graph that captured one of its collectives is destroyed, so a captured decode graph still
    alive at `destroy_process_group()` would hang the exit."""
    _BEFORE_SHUTDOWN.append(weakref.WeakMethod(method))


def release_graphs() -> None:
    """Run the `before_shutdown` callbacks and free what they dropped (captured graphs), then wait for the
    device, so that destroying the NCCL communicator finds no graph holding it."""
    for ref in list(_BEFORE_SHUTDOWN):
        method = ref()
        if method is not None:
            method()
    _BEFORE_SHUTDOWN.clear()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def shutdown() -> None:
    """Destroy the default process group (call once, at the end of a torchrun script), after releasing the
    captured decode graphs (`before_shutdown`).

    After a failure (distributed.failure) the groups are left alone: destroying an NCCL group can
    wait forever on work a failed peer never finishes; the process is about to end anyway.
    """
    monitor = failure.stop_monitor()
    if dist.is_initialized() and not (monitor is not None and (monitor.failure or monitor.failed_here)):
        release_graphs()
        dist.destroy_process_group()


def _exit_shutdown() -> None:
    """At interpreter exit: shut down cleanly, or, after a failure, end the process without the
    destructors of NCCL groups whose peers are gone (status 1: the run failed)."""
    if failure.failed():
        failure.stop_monitor()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    shutdown()

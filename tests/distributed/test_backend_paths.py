"""The NCCL code paths, checked on a CPU-only machine with a fake torch.distributed: which backend and
device each rank picks, the order of set_device and init_process_group, timeouts, and that control
messages stay on CPU tensors over the gloo group while the device group is NCCL."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from moekv.distributed import expert_parallel, groups
from moekv.distributed.expert_parallel import AUTO_ALLGATHER_MAX_TOKENS, ExpertParallelRuntime
from moekv.distributed.groups import ExpertParallelGroup
from moekv.errors import ConfigError

CPU_GROUP = object()


@pytest.fixture
def fake_dist(monkeypatch):
    """torch.distributed and torch.cuda stand-ins that record what init_expert_parallel does."""
    calls = []
    state = {"initialized": False}
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MOEKV_EP_TIMEOUT_S", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", torch.device(device))))

    def init_process_group(backend, timeout=None, **kwargs):
        calls.append(("init_process_group", backend, timeout, kwargs))
        state["initialized"] = True

    def new_group(backend=None, timeout=None, **kwargs):
        calls.append(("new_group", backend, timeout))
        return CPU_GROUP

    monkeypatch.setattr(dist, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(groups, "_start_failure_monitor", lambda rank: calls.append(("monitor", rank)))
    monkeypatch.setattr(groups.atexit, "register", lambda fn: calls.append(("atexit", fn.__name__)))
    return calls


def test_cuda_rank_sets_its_device_before_nccl_init(fake_dist):
    group = groups.init_expert_parallel(2, "auto")
    assert group.device == torch.device("cuda", 1) and group.local_rank == 1 and group.rank == 1
    names = [c[0] for c in fake_dist]
    assert names.index("set_device") < names.index("init_process_group")
    assert fake_dist[names.index("set_device")] == ("set_device", torch.device("cuda", 1))
    _, backend, timeout, kwargs = fake_dist[names.index("init_process_group")]
    assert backend == "nccl" and timeout == groups.DEVICE_TIMEOUT and "device_id" not in kwargs
    assert ("new_group", "gloo", groups.CONTROL_TIMEOUT) in fake_dist        # control messages: gloo, CPU
    assert ("monitor", 1) in fake_dist and ("atexit", "_exit_shutdown") in fake_dist
    assert group.cpu_group is CPU_GROUP and group.device_group is None


def test_cpu_rank_uses_gloo_and_timeouts_are_bounded(fake_dist, monkeypatch):
    monkeypatch.setenv("MOEKV_EP_TIMEOUT_S", "42")
    group = groups.init_expert_parallel(2, "cpu", control_timeout=90)
    assert group.device == torch.device("cpu")
    assert not [c for c in fake_dist if c[0] == "set_device"]
    init = next(c for c in fake_dist if c[0] == "init_process_group")
    assert init[1] == "gloo" and init[2] == timedelta(seconds=42)
    assert ("new_group", "gloo", timedelta(seconds=90)) in fake_dist


def test_explicit_timeout_wins_and_bad_values_are_config_errors(monkeypatch):
    monkeypatch.setenv("MOEKV_EP_TIMEOUT_S", "42")
    assert groups.device_timeout(7) == timedelta(seconds=7)
    assert groups.device_timeout() == timedelta(seconds=42)
    monkeypatch.setenv("MOEKV_EP_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="MOEKV_EP_TIMEOUT_S"):
        groups.device_timeout()
    with pytest.raises(ConfigError, match="positive"):
        groups.device_timeout(0)
    assert groups.backend_for(torch.device("cuda", 3)) == "nccl"
    assert groups.backend_for(torch.device("cpu")) == "gloo"


def test_more_processes_than_gpus_is_a_config_error(fake_dist, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="LOCAL_RANK=2 but this node has 2 GPUs"):
        groups.init_expert_parallel(2, "cuda")


def test_control_collectives_use_cpu_tensors_on_the_gloo_group_under_nccl(monkeypatch):
    """NCCL cannot take CPU tensors and gloo is the control group: token counts and work flags must be
    CPU tensors sent over cpu_group even when the device group is NCCL on a GPU."""
    group = ExpertParallelGroup(rank=0, world_size=2, local_rank=0, device=torch.device("cuda", 0),
                                device_group=None, cpu_group=CPU_GROUP)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    runtime = ExpertParallelRuntime(group)
    assert runtime.allgather_max_tokens == AUTO_ALLGATHER_MAX_TOKENS["nccl"]
    seen = []

    def fake_all_gather(out, tensor, group=None):
        seen.append(("all_gather", out.device.type, tensor.device.type, group))
        out.copy_(torch.tensor([tensor.item(), 5]))

    def fake_all_reduce(tensor, op=None, group=None):
        seen.append(("all_reduce", tensor.device.type, group))

    monkeypatch.setattr(expert_parallel, "all_gather", fake_all_gather)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    assert runtime.exchange_counts(3) == [3, 5]
    assert runtime.any_rank(True) is True
    assert seen == [("all_gather", "cpu", "cpu", CPU_GROUP), ("all_reduce", "cpu", CPU_GROUP)]


def test_shutdown_releases_captured_graphs_before_destroying_the_group(monkeypatch):
    """NCCL's communicator destruction waits for every CUDA graph that captured one of its collectives:
    the lockstep engine's graphs (registered with before_shutdown) must go first; dead owners are skipped."""
    calls = []

    class Runner:
        def reset_graphs(self):
            calls.append("reset_graphs")

    live, dead = Runner(), Runner()
    groups.before_shutdown(live.reset_graphs)
    groups.before_shutdown(dead.reset_graphs)
    del dead
    monkeypatch.setattr(groups.failure, "stop_monitor", lambda: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy_process_group"))
    groups.shutdown()
    assert calls == ["reset_graphs", "destroy_process_group"]

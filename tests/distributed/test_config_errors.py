"""Expert-parallel settings that cannot work fail at the boundary with a message that says what to do."""

from __future__ import annotations

import pytest

from moekv.config import ParallelConfig
from moekv.engine.factory import initial_placements
from moekv.errors import ConfigError
from tests.distributed.helpers import tiny_arch


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_redundant_experts=2), "num_redundant_experts needs expert_parallel_size > 1"),
    (dict(expert_parallel_size=2, expert_dispatch="nccl"), "expert_dispatch must be auto, all_to_all or allgather"),
    (dict(expert_parallel_size=2, allgather_max_tokens=-1), "allgather_max_tokens must be >= 0 or None"),
    (dict(expert_parallel_size=2, rebalance_interval=-3), "rebalance_interval must be >= 0"),
])
def test_parallel_config_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kwargs)


def test_llm_without_torchrun_says_how_to_launch(monkeypatch, tmp_path):
    from moekv.entrypoints.llm import LLM

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="launch with `torchrun --nproc-per-node 2"):
        LLM(str(tmp_path), expert_parallel_size=2, device="cpu")   # never loaded


def test_offload_and_expert_parallel_do_not_combine(tmp_path):
    from moekv.entrypoints.llm import LLM

    with pytest.raises(ConfigError, match="cpu_offload_experts cannot be combined"):
        LLM(str(tmp_path), expert_parallel_size=2, cpu_offload_experts=True, device="cpu")


def test_too_many_redundant_experts_is_a_config_error():
    with pytest.raises(ConfigError, match="at most 4"):
        initial_placements(tiny_arch(num_experts=4), num_ranks=2, num_redundant=5)
    placements = initial_placements(tiny_arch(num_experts=4), num_ranks=2, num_redundant=4)
    assert sorted(placements) == [0, 1]
    assert all(p.slots_per_rank == (4, 4) for p in placements.values())

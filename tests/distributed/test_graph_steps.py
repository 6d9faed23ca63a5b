"""Expert-parallel decode steps through the CUDA-graph buckets, on the CPU (gloo, 2 processes).

The runner's "static" graph mode (enable_graphs(capture=False)) runs exactly what a bucket's graph
captures, eagerly: the experts' static all-gather over every rank's bucket rows, padding rows masked by
the token-valid mask. 2 ranks must give the greedy tokens of one process through prefill steps, mixed
prefill + decode steps (eager), graph steps whose bucket changes as sequences finish, steps in which one
rank has no sequence (it replays the bucket with padding rows only), uneven expert slots (3 + 2) and
replicas after a rebalance. The capture path itself runs with a stand-in for the capture: both ranks
warm up (real collectives), "capture", then replay; a capture that fails on one rank makes both fall
back to eager at the same step. The ranks' agreement rule is checked on its own at the end.
"""

from __future__ import annotations

import pytest
import torch

from moekv.distributed.expert_parallel import agree_graph_bucket
from tests.distributed.helpers import prompts_and_params, run_worker, single_process_tokens, tiny_arch

# 4 sequences at most per rank and 8 tokens per step: prefills are chunked, so one rank still prefills
# while the other decodes (eager steps), and buckets 4 -> 2 -> 1 follow as sequences finish
SMALL_STEPS = {"max_num_seqs": 4, "max_num_batched_tokens": 8}
SCENARIOS = [
    dict(name="static_allgather", kind="random", num_experts=5, seed=1, dispatch="allgather", static=True,
         no_host_reads=True, scheduler=SMALL_STEPS),
    # auto switching at 2 tokens per rank: 3-sequence decode steps run eagerly (all_to_all), smaller ones as
    # graph steps; replicas (4 + 2 slots), then a rebalance (the buckets are dropped and rebuilt)
    dict(name="static_auto_rebalance", kind="random", num_experts=5, seed=1, dispatch="auto",
         allgather_max_tokens=2, redundant=1, static=True, rebalance=True, hot_expert=0, scheduler=SMALL_STEPS),
    dict(name="capture", kind="random", num_experts=5, seed=1, dispatch="allgather", fake_capture={},
         scheduler=SMALL_STEPS),
    dict(name="capture_fails_on_rank_1", kind="random", num_experts=5, seed=1, dispatch="allgather",
         fake_capture={"fail_rank": 1}, scheduler=SMALL_STEPS),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(2, SCENARIOS, tmp_path_factory.mktemp("graphs"))


@pytest.fixture(scope="module")
def expected():
    prompts, params = prompts_and_params()
    return single_process_tokens(tiny_arch(5), 1, prompts, params)


def test_static_graph_steps_match_one_process(results, expected):
    result = results["static_allgather"]
    assert result["ranks_agree"]
    assert result["tokens"] == expected
    rank0, rank1 = result["per_rank"]
    for stats in (rank0, rank1):
        assert stats["graph_mode"] == "static"
        assert stats["step_kinds"]["graph"] >= 4 and stats["step_kinds"]["eager"] >= 2   # prefill / mixed: eager
        assert stats["graph_steps"] == stats["step_kinds"]["graph"]       # every graph step ran on both ranks
        assert stats["guarded_calls"] == 2 * stats["graph_steps"]        # both MoE layers, no host read inside
    # rank 1's two sequences finish first: it replays buckets with padding rows only while rank 0 decodes
    assert rank1["idle_steps"] >= 1 and rank0["idle_steps"] == 0
    assert len(rank0["buckets"]) >= 2 and rank0["buckets"] == rank1["buckets"]   # the bucket changed mid-run


def test_static_graph_steps_with_auto_dispatch_and_rebalance(results, expected):
    result = results["static_auto_rebalance"]
    assert result["ranks_agree"]
    assert result["tokens"] == expected
    assert result["tokens_after"] == expected                # after the rebalance dropped the buckets
    assert any(layer["moved"] for layer in result["rebalance"])
    for stats in result["per_rank"]:
        assert stats["step_kinds"]["graph"] >= 2 and stats["step_kinds"]["eager"] >= 2
        assert max(stats["buckets"]) <= 2                    # 3-sequence decode steps stayed eager
    assert set(result["exchange_calls"]) == {"all_to_all", "allgather"}


def test_capture_path_replays_on_every_rank(results, expected):
    result = results["capture"]
    assert result["tokens"] == expected
    for stats in result["per_rank"]:
        assert stats["graph_mode"] == "cuda" and stats["captures"] == len(stats["buckets"]) >= 2
        assert stats["replays"] == stats["graph_steps"] == stats["step_kinds"]["graph"]
    assert result["per_rank"][1]["idle_steps"] >= 1


def test_capture_failure_on_one_rank_makes_every_rank_eager(results, expected):
    result = results["capture_fails_on_rank_1"]
    assert result["tokens"] == expected
    rank0, rank1 = result["per_rank"]
    for stats in (rank0, rank1):
        assert stats["graph_mode"] is None and stats["captures"] == 0 and stats["replays"] == 0
        assert stats["graph_steps"] == 1                     # the step of the failed capture, on its buffers
        assert stats["step_kinds"]["graph"] == 1
    assert "injected" in rank1["fallback"] and "another rank" in rank0["fallback"]


def test_agreement_rule():
    buckets = [1, 2, 4, 8]
    assert agree_graph_bucket([3, 1], [3, 1], buckets, [8, 8]) == 4      # the largest batch's bucket
    assert agree_graph_bucket([0, 2], [0, 2], buckets, [8, 8]) == 2      # an idle rank replays it too
    assert agree_graph_bucket([5, 1], [-1, 1], buckets, [8, 8]) is None  # a prefill anywhere: eager
    assert agree_graph_bucket([0, 0], [0, 0], buckets, [8, 8]) is None   # nobody has tokens
    assert agree_graph_bucket([3, 1], [3, 1], buckets, [2, 2]) is None   # past the all-gather range
    # equal limits but different bucket lists (max_num_seqs differs): the same batch would map to
    # different buckets, so the step is eager everywhere
    assert agree_graph_bucket([3, 1], [3, 1], buckets, [8, 8], [8, 8]) == 4
    assert agree_graph_bucket([3, 1], [3, 1], buckets, [8, 8], [8, 16]) is None
    assert agree_graph_bucket([2, 1], [2, 1], buckets, [0, 0]) is None   # all_to_all / graphs off
    assert agree_graph_bucket([2, 1], [2, 1], buckets, [8, 0]) is None   # one rank's graphs are off
    assert agree_graph_bucket([2, 1], [2, 1], buckets, [8, 4]) is None   # configs differ: never graphs
    assert agree_graph_bucket([2, 1], [2, 1], [], [8, 8]) is None
    assert agree_graph_bucket([8, 8], [8, 8], buckets, [64, 64]) == 8


# -- 2 GPUs (NCCL): real capture, the collectives inside each bucket's graph ----------------------------------
GPU_ARCH = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "expert_intermediate_size": 64}
GPU_BASE = dict(kind="random", device="cuda", arch=GPU_ARCH, num_experts=5, seed=1, scheduler=SMALL_STEPS)
GPU_SCENARIOS = [
    dict(GPU_BASE, name="gpu_graphs", dispatch="allgather"),
    dict(GPU_BASE, name="gpu_static", dispatch="allgather", cuda_graphs=False, static=True),
    # the default (auto, NCCL's graph switch point); replicas, then a rebalance drops and recaptures the graphs
    dict(GPU_BASE, name="gpu_auto_rebalance", dispatch="auto", redundant=1, rebalance=True, hot_expert=0),
]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_graph_steps_on_two_gpus(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    results = run_worker(2, GPU_SCENARIOS, tmp_path, timeout=500, env=env)
    graphs, static = results["gpu_graphs"], results["gpu_static"]
    assert graphs["ranks_agree"] and graphs["tokens"] == static["tokens"]   # replay == the same work run eagerly
    for stats in graphs["per_rank"]:
        assert stats["graph_mode"] == "cuda", stats["fallback"]
        assert stats["captures"] == len(stats["buckets"]) >= 2
        assert stats["replays"] == stats["graph_steps"] == stats["step_kinds"]["graph"] >= 4
    assert graphs["per_rank"][1]["idle_steps"] >= 1
    auto = results["gpu_auto_rebalance"]
    assert auto["per_rank"][0]["allgather_max_tokens"] == 64
    assert auto["tokens_after"] == auto["tokens"]
    for stats in auto["per_rank"]:
        assert stats["graph_mode"] == "cuda" and stats["replays"] == stats["step_kinds"]["graph"] >= 8

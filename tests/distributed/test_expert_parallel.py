"""Expert parallelism end to end on the CPU: gloo processes launched by torchrun (the real launch
path) produce the same greedy tokens as one process, with uneven expert counts, both dispatch
implementations, redundant replicas, after a rebalance, through the offline API, `moekv generate`
and the serving machinery, and (8 processes) on the bundled model.

Each torchrun launch runs several scenarios (tests/distributed/ep_worker.py) to amortise start-up.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moekv.distributed.balancer import initial_placement
from tests.distributed.helpers import (REPO, prompts_and_params, run_torchrun, run_worker, single_process_tokens,
                                       tiny_arch)

RANDOM_SCENARIOS = [
    # 5 experts on 2 ranks: 3 + 2 slots
    dict(name="uneven_all_to_all", kind="random", num_experts=5, seed=1, dispatch="all_to_all", rebalance=True,
         hot_expert=0),
    dict(name="uneven_allgather", kind="random", num_experts=5, seed=1, dispatch="allgather"),
    # 5 experts + 2 redundant on 2 ranks: 4 + 3 slots; auto: all_to_all for prefill, allgather for decode
    dict(name="redundant_auto", kind="random", num_experts=5, seed=1, dispatch="auto", allgather_max_tokens=4,
         redundant=2, rebalance=True, hot_expert=4),
    dict(name="top3_all_to_all", kind="random", num_experts=6, top_k=3, seed=2, dispatch="all_to_all"),
    # FP8 experts (codes + per-channel scales) sharded, replicated and moved by a rebalance
    dict(name="fp8_redundant", kind="random", num_experts=5, seed=1, dispatch="auto", allgather_max_tokens=4,
         redundant=2, rebalance=True, hot_expert=4, fp8=True),
    # re-placed every 3 steps while sequences are in flight
    dict(name="interval_rebalance", kind="random", num_experts=5, seed=1, dispatch="allgather", redundant=1,
         rebalance_interval=3),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_worker(2, RANDOM_SCENARIOS, tmp_path_factory.mktemp("ep2"))


def reference(num_experts: int, seed: int, top_k: int = 2, fp8: bool = False) -> list[list[int]]:
    prompts, params = prompts_and_params()
    return single_process_tokens(tiny_arch(num_experts, top_k), seed, prompts, params, fp8=fp8)


@pytest.mark.parametrize("name", ["uneven_all_to_all", "uneven_allgather"])
def test_uneven_experts_match_one_process(two_ranks, name):
    result = two_ranks[name]
    assert result["ranks_agree"]
    assert result["tokens"] == reference(5, seed=1)
    assert result["placement"]["0"]["rank_experts"] == [[0, 1, 2], [3, 4]]
    kind = "all_to_all" if name.endswith("all_to_all") else "allgather"
    assert set(result["exchange_calls"]) == {kind}


def test_rebalance_moves_experts_and_keeps_tokens(two_ranks):
    result = two_ranks["uneven_all_to_all"]
    for layer in result["rebalance"]:
        assert layer["moved"] >= 1
        assert layer["after"] < layer["before"]
    for placement in result["placement_after"].values():
        hot_rank = next(r for r, experts in enumerate(placement["rank_experts"]) if 0 in experts)
        assert len(placement["rank_experts"][hot_rank]) == 2        # the hot expert sits on the 2-slot rank
    assert result["tokens_after"] == reference(5, seed=1)


def test_redundant_replicas_match_one_process(two_ranks):
    result = two_ranks["redundant_auto"]
    assert result["ranks_agree"]
    assert result["tokens"] == reference(5, seed=1)
    for placement in result["placement"].values():
        slots = placement["rank_experts"]
        assert [len(s) for s in slots] == [4, 3]
        assert set(slots[0]) & set(slots[1])                     # some expert has a replica on each rank
    assert set(result["exchange_calls"]) == {"all_to_all", "allgather"}
    # after making expert 4 hot: it is replicated on both ranks, and tokens are unchanged
    for placement in result["placement_after"].values():
        assert all(4 in slots for slots in placement["rank_experts"])
    assert all(layer["moved"] >= 1 for layer in result["rebalance"])
    assert result["tokens_after"] == reference(5, seed=1)


def test_fp8_experts_match_one_process_and_move_in_a_rebalance(two_ranks):
    result = two_ranks["fp8_redundant"]
    assert result["ranks_agree"] and result["fp8_experts"]
    expected = reference(5, seed=1, fp8=True)
    assert expected != reference(5, seed=1)              # FP8 changes the tokens here: the check can fail
    assert result["tokens"] == expected
    assert sum(layer["moved"] for layer in result["rebalance"]) >= 1   # codes and scales broadcast together
    assert result["tokens_after"] == expected


def test_top3_routing_matches_one_process(two_ranks):
    result = two_ranks["top3_all_to_all"]
    assert result["tokens"] == reference(6, seed=2, top_k=3)


def test_rebalance_every_few_steps_keeps_tokens(two_ranks):
    result = two_ranks["interval_rebalance"]
    assert result["steps"] >= 6 and result["interval_rebalances"] == 2     # one report per MoE layer
    initial = initial_placement(5, 2, 1).to_dict()
    assert any(placement != initial for placement in result["placement"].values())   # experts did move
    assert result["tokens"] == reference(5, seed=1)


# -- checkpoints: the offline API, the CLI, the serving machinery -----------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Mixtral checkpoint with 8 experts and a word-level tokenizer ("w0 w1 ...")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.hf_fixtures import make_checkpoint

    path, _ = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "mixtral", num_experts=8, seed=3)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(160)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


CKPT_PROMPTS = [[5, 17, 33, 9], [101, 7], [64, 65, 66, 67, 68, 12], [3], [150, 149, 148]]


def one_process_llm_tokens(model: Path, max_tokens: int) -> list[list[int]]:
    from moekv.entrypoints.llm import LLM
    from moekv.sampling import SamplingParams

    outputs = LLM(str(model), device="cpu").generate(CKPT_PROMPTS, SamplingParams(max_tokens=max_tokens,
                                                                                   temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs]


def test_offline_api_8_experts_on_3_ranks(checkpoint, tmp_path):
    from tests.fp8_fixtures import fp8_checkpoint

    fp8_dir = fp8_checkpoint(checkpoint, tmp_path / "fp8", "block", (16, 32))     # block scales, as stored
    scenarios = [dict(name="llm", kind="llm", model=str(checkpoint), prompts=CKPT_PROMPTS, max_tokens=5,
                      rebalance=True, kwargs={"num_redundant_experts": 1}),
                 dict(name="serve", kind="serve", model=str(checkpoint), prompts=CKPT_PROMPTS, max_tokens=5),
                 dict(name="fp8", kind="llm", model=str(fp8_dir), prompts=CKPT_PROMPTS, max_tokens=5,
                      rebalance=True, kwargs={"num_redundant_experts": 1})]
    results = run_worker(3, scenarios, tmp_path)
    fp8 = results["fp8"]
    assert fp8["ranks_agree"]
    assert fp8["tokens"] == fp8["tokens_after"] == one_process_llm_tokens(fp8_dir, 5)
    expected = one_process_llm_tokens(checkpoint, 5)
    llm = results["llm"]
    assert llm["ranks_agree"]
    assert llm["tokens"] == expected
    assert llm["request_ids"] == [f"req-{i}" for i in range(len(CKPT_PROMPTS))]
    assert llm["tokens_after"] == expected
    serve = results["serve"]
    assert serve["tokens"] == expected
    assert set(serve["owners"].values()) == {0, 1, 2}         # requests were spread over every rank
    assert serve["left"] == 0                                 # released everywhere on the leader


def test_generate_cli_under_torchrun(checkpoint, capsys):
    from moekv.cli import main

    args = ["generate", "--model", str(checkpoint), "--prompt", "w5 w17 w33", "--max-tokens", "6",
            "--temperature", "0", "--device", "cpu"]
    assert main(args) == 0
    single = capsys.readouterr().out
    result = run_torchrun(2, ["moekv", *args, "--expert-parallel-size", "2", "--expert-dispatch", "allgather"],
                          module=True)
    completion = single.split("\n\n")[0]
    assert completion.startswith("w5 w17 w33") and len(re.findall(r"w\d+", completion)) == 3 + 6
    assert result.stdout.split("\n\n")[0] == completion       # rank 0 streams it; rank 1 prints nothing
    assert result.stdout.count("w5 w17 w33") == 1


# -- the bundled model on 8 processes -------------------------------------------------------------------
BUNDLED = REPO / "models" / "tiny-shakespeare-moe"


@pytest.mark.slow
@pytest.mark.skipif(not (BUNDLED / "config.json").is_file(),
                    reason="models/tiny-shakespeare-moe is not in this checkout yet (tools/ trains it)")
def test_bundled_model_on_8_ranks(tmp_path):
    from moekv.entrypoints.llm import LLM
    from moekv.sampling import SamplingParams

    prompts = ["ROMEO:", "JULIET:\nO", "First Citizen:\nBefore we proceed", "KING", "To be, or not",
               "MENENIUS:", "All:", "Speak, speak."]
    max_tokens = 4
    # a KV pool for 64-token sequences, not the CPU default of 1 GiB that each of the 8 ranks would zero
    kwargs = {"max_model_len": 64}
    llm = LLM(str(BUNDLED), device="cpu", **kwargs)        # the checkpoint's dtype, bf16
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    results = run_worker(8, [dict(name="bundled", kind="llm", model=str(BUNDLED), prompts=prompts,
                                  max_tokens=max_tokens, kwargs=kwargs)], tmp_path, timeout=400)
    assert results["bundled"]["ranks_agree"]
    assert results["bundled"]["tokens"] == expected


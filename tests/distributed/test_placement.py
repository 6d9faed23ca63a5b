"""ExpertPlacement: uneven slot counts, replicas, per-rank load; replica choice of the EP experts."""

from __future__ import annotations

import pytest
import torch

from moekv.distributed.expert_parallel import ExpertParallelExperts
from moekv.distributed.placement import ExpertPlacement, split_evenly


@pytest.mark.parametrize("total, parts, expected", [
    (8, 3, (3, 3, 2)), (5, 2, (3, 2)), (8, 2, (4, 4)), (2, 3, (1, 1, 0)), (10, 4, (3, 3, 2, 2))])
def test_split_evenly(total, parts, expected):
    assert split_evenly(total, parts) == expected


def test_contiguous_uneven_8_experts_on_3_ranks():
    placement = ExpertPlacement.contiguous(8, 3)
    assert placement.rank_experts == ((0, 1, 2), (3, 4, 5), (6, 7))
    assert placement.slots_per_rank == (3, 3, 2)
    assert placement.slot_offsets == (0, 3, 6)
    assert placement.slot_ranks == (0, 0, 0, 1, 1, 1, 2, 2)
    assert placement.physical_experts == tuple(range(8))
    assert placement.replica_counts == (1,) * 8
    assert placement.num_redundant == 0
    assert placement.ranks_of(7) == (2,)


def test_replicas_and_per_rank_load():
    placement = ExpertPlacement(4, ((0, 1, 2), (0, 3)))        # expert 0 on both ranks
    assert placement.num_slots == 5 and placement.num_redundant == 1
    assert placement.replicas(0) == (0, 3)
    assert placement.replica_counts == (2, 1, 1, 1)
    load = [10, 1, 1, 1]
    assert placement.per_rank_load(load) == [5 + 1 + 1, 5 + 1]  # expert 0's load split over its replicas
    assert placement.imbalance(load) == pytest.approx(7 / 6.5)
    assert placement.imbalance([0, 0, 0, 0]) == 1.0


def test_moves_from_counts_slots_that_change_expert():
    old = ExpertPlacement(4, ((0, 1), (2, 3)))
    assert ExpertPlacement(4, ((1, 0), (2, 3))).moves_from(old) == 0      # reordering moves nothing
    assert ExpertPlacement(4, ((0, 3), (2, 1))).moves_from(old) == 2
    assert ExpertPlacement(4, ((0, 1, 3), (2, 3, 0))).to_dict() == {"num_experts": 4,
                                                                     "rank_experts": [[0, 1, 3], [2, 3, 0]]}


@pytest.mark.parametrize("rank_experts, message", [
    (((0, 1), (2,)), "experts \\[3\\] are on no rank"),
    (((0, 0), (1, 2, 3)), "holds an expert twice"),
    (((0, 1), (2, 4)), "outside \\[0, 4\\)"),
    ((), "at least one rank"),
])
def test_invalid_placements_are_rejected(rank_experts, message):
    with pytest.raises(ValueError, match=message):
        ExpertPlacement(4, rank_experts)


class _Runtime:
    """Just what ExpertParallelExperts reads at construction (no process group needed)."""

    def __init__(self, rank: int):
        self.rank = rank


def test_replicated_expert_splits_tokens_between_its_replicas():
    placement = ExpertPlacement(3, ((0, 1), (0, 2)))           # expert 0: physical ids 0 (rank 0) and 2 (rank 1)
    experts = ExpertParallelExperts(_Runtime(1), placement, 0, hidden_size=8, intermediate_size=4, top_k=2,
                                    dtype=torch.float32, device="cpu")
    assert experts.w_gate_up.shape == (2, 8, 8) and experts.local_experts == (0, 2)
    topk_ids = torch.tensor([[0, 1]] * 6 + [[2, 0]] * 2)                       # [8, 2]
    token_index = torch.arange(8).unsqueeze(1)
    physical = experts.physical_ids(topk_ids, token_index, 0)                  # as rank 0 would pick
    assert physical[:, 1][:6].tolist() == [1] * 6                              # expert 1: one replica
    replicas_of_0 = torch.cat([physical[:6, 0], physical[6:, 1]])
    assert sorted(set(replicas_of_0.tolist())) == [0, 2]
    assert (replicas_of_0 == 0).sum().item() == 4                              # an even split
    shifted = experts.physical_ids(topk_ids, token_index, 1)                   # rank 1 starts on the other replica
    assert shifted[0, 0].item() == 2 and physical[0, 0].item() == 0
    assert experts.slot_rank.tolist() == [0, 0, 1, 1] and experts.slot_local.tolist() == [0, 1, 0, 1]


def test_set_placement_rejects_a_different_slot_count():
    experts = ExpertParallelExperts(_Runtime(0), ExpertPlacement.contiguous(5, 2), 3, 8, 4, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="layer 3: placement gives rank 0 2 slots, it holds 3"):
        experts.set_placement(ExpertPlacement(5, ((0, 1), (2, 3, 4))))

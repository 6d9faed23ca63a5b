"""The EPLB-style balancer: replicate hot experts, pack replicas on ranks, keep experts in place."""

from __future__ import annotations

import random

import pytest

from moekv.distributed.balancer import (balance, check_redundancy, improve_by_swaps, initial_placement, pack,
                                        replicate, round_robin)
from moekv.distributed.placement import ExpertPlacement, split_evenly


def test_replicate_gives_extra_slots_to_the_hottest_per_replica():
    assert replicate([100, 10, 10, 10], num_slots=6, limit=4) == [3, 1, 1, 1]
    assert replicate([100, 60, 1, 1], num_slots=6, limit=4) == [2, 2, 1, 1]   # 100/2 = 50 < 60
    assert replicate([100, 1], num_slots=4, limit=2) == [2, 2]                 # capped at one per rank


def test_hot_expert_is_replicated_and_ranks_balance():
    load = [80, 10, 10, 10, 10, 10, 10, 10]                      # expert 0 carries half of all traffic
    contiguous = ExpertPlacement.contiguous(8, 2)
    placement = balance(load, num_ranks=2, num_redundant=2, current=None)
    assert placement.slots_per_rank == (5, 5)
    assert placement.replica_counts[0] == 2 and len(placement.ranks_of(0)) == 2
    assert contiguous.imbalance(load) == pytest.approx(110 / 75)
    assert placement.imbalance(load) == pytest.approx(1.0)


def test_uneven_slots_put_the_hot_expert_on_the_smaller_rank():
    load = [2060, 40, 50, 30, 20]                                # 5 experts on 2 ranks: 3 + 2 slots
    current = ExpertPlacement.contiguous(5, 2)
    placement = balance(load, num_ranks=2, current=current)
    assert placement.slots_per_rank == (3, 2)
    assert 0 in placement.rank_experts[1]
    assert placement.per_rank_load(load) == [120, 2080]          # the best split there is
    assert placement.imbalance(load) < current.imbalance(load)


def test_balanced_placement_is_kept_in_place():
    load = [5, 1, 1, 5]
    current = ExpertPlacement(4, ((3, 1), (2, 0)))
    assert balance(load, 2, 0, current) == current               # nothing to move, slots keep their experts
    moved = balance([9, 1, 1, 1], 2, 0, ExpertPlacement(4, ((0, 1), (2, 3))))
    assert moved.rank_experts[0][0] == 0                         # an expert a rank keeps stays in its slot


def test_no_load_yet_gives_the_initial_layout():
    assert balance([0, 0, 0], 2, 0) == ExpertPlacement(3, ((0, 1), (2,)))
    current = ExpertPlacement(3, ((2,), (0, 1)))
    assert balance([0, 0, 0], 2, 0, current) is current
    assert initial_placement(8, 3) == ExpertPlacement.contiguous(8, 3)
    placement = initial_placement(5, 2, num_redundant=2)
    assert placement.slots_per_rank == (4, 3) and placement.num_redundant == 2


@pytest.mark.parametrize("num_experts, num_ranks, num_redundant, ok", [
    (4, 2, 4, True), (4, 2, 5, False), (8, 3, 16, True), (8, 3, 17, False), (2, 4, 2, True), (2, 4, 7, False)])
def test_redundancy_limit(num_experts, num_ranks, num_redundant, ok):
    if ok:
        check_redundancy(num_experts, num_ranks, num_redundant)
    else:
        with pytest.raises(ValueError, match="one replica of each expert per rank"):
            check_redundancy(num_experts, num_ranks, num_redundant)


def test_round_robin_always_fits():
    for counts, slots in [([3, 2, 1, 1], (3, 2, 2)), ([2, 2, 2, 1], (3, 2, 2)), ([1] * 8, (3, 3, 2))]:
        ranks = round_robin(counts, slots)
        assert [len(r) for r in ranks] == list(slots)
        assert all(len(set(r)) == len(r) for r in ranks)
        assert sorted(e for r in ranks for e in r) == sorted(e for e, c in enumerate(counts) for _ in range(c))


def test_stuck_greedy_falls_back_to_round_robin():
    # 3 + 1 slots: the heavy singles take rank 0 and rank 1's only slot, leaving both replicas of
    # expert 0 for rank 0; pack() reports it, balance() uses round_robin instead.
    assert pack([1, 100, 100], [2, 1, 1], (3, 1)) is None
    assert round_robin([2, 1, 1], (3, 1)) == [[0, 1, 2], [0]]


def test_swaps_lower_the_heaviest_rank():
    weights = [1, 10, 10, 1]
    ranks = improve_by_swaps([[1, 2], [0, 3]], weights, [1, 1, 1, 1])
    assert sorted(sum(weights[e] for e in r) for r in ranks) == [11, 11]


def test_random_loads_give_valid_placements_no_worse_than_contiguous():
    for seed in range(200):
        rng = random.Random(seed)
        num_experts, num_ranks = rng.randint(2, 16), rng.randint(1, 8)
        limit = num_experts * (min(num_ranks, num_experts) - 1)
        num_redundant = rng.randint(0, min(limit, 8))
        load = [rng.expovariate(1.0) * (10 if rng.random() < 0.2 else 1) for _ in range(num_experts)]
        current = initial_placement(num_experts, num_ranks, num_redundant)
        placement = balance(load, num_ranks, num_redundant, current)   # ExpertPlacement validates itself
        assert placement.slots_per_rank == split_evenly(num_experts + num_redundant, num_ranks)
        for expert in range(num_experts):
            assert len(placement.ranks_of(expert)) == placement.replica_counts[expert]   # distinct ranks
        if num_redundant == 0:
            assert placement.imbalance(load) <= current.imbalance(load) + 1e-9

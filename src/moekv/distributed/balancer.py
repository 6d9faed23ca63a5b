"""Expert load balancing in the spirit of DeepSeek's EPLB: replicate hot experts, pack replicas.

Given the routed load of one MoE layer (token-slots per logical expert, summed over all ranks):

1. replicate: every expert gets one slot; each of the `num_redundant` extra slots goes to the
   expert with the highest load per replica (never more replicas than ranks with slots, so
   replicas of one expert always sit on distinct ranks).
2. pack: replicas, heaviest first (load / replica count), go to the least-loaded rank that has a
   free slot and no replica of that expert yet; slot counts per rank are fixed (placement.split_evenly).
   If the greedy pass gets stuck (rare), a round-robin layout that always fits is used instead.
   Then single swaps between the most loaded rank and another, while they lower its load.
3. order: an expert a rank keeps stays in its slot, so a rebalance moves only the weights that
   change rank.

Pure Python on plain numbers: every rank computes the same placement from the same all-reduced load.
"""

from __future__ import annotations

from typing import Sequence

from moekv.distributed.placement import ExpertPlacement, split_evenly


def max_replicas(num_experts: int, num_ranks: int, num_redundant: int) -> int:
    """Most replicas one expert may have: one per rank that has at least one slot."""
    return min(num_ranks, num_experts + num_redundant)


def check_redundancy(num_experts: int, num_ranks: int, num_redundant: int) -> None:
    """ValueError unless `num_redundant` extra slots can hold replicas on distinct ranks."""
    if num_redundant < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    limit = num_experts * (max_replicas(num_experts, num_ranks, num_redundant) - 1)
    if num_redundant > limit:
        raise ValueError(f"num_redundant_experts={num_redundant} is more than {num_experts} experts on "
                         f"{num_ranks} ranks can use (at most {limit}: one replica of each expert per rank)")


def replicate(load: Sequence[float], num_slots: int, limit: int) -> list[int]:
    """Replica count per expert: sum == num_slots, each in [1, limit], extra slots to the hottest."""
    counts = [1] * len(load)
    for _ in range(num_slots - len(load)):
        best = max((e for e in range(len(load)) if counts[e] < limit),
                   key=lambda e: (load[e] / counts[e], -e))
        counts[best] += 1
    return counts


def pack(load: Sequence[float], counts: Sequence[int], slots_per_rank: Sequence[int],
         current: ExpertPlacement | None = None) -> list[list[int]] | None:
    """Greedy balanced packing of replicas onto ranks; None if it gets stuck.

    Ties in rank load prefer a rank that already holds the expert (no weights to move), then the lower rank.
    """
    items = sorted(((load[e] / counts[e], e) for e in range(len(counts)) for _ in range(counts[e])),
                   key=lambda item: (-item[0], item[1]))
    ranks: list[list[int]] = [[] for _ in slots_per_rank]
    rank_load = [0.0] * len(slots_per_rank)
    held = [set(slots) for slots in current.rank_experts] if current is not None else [set() for _ in ranks]
    for weight, expert in items:
        free = [r for r in range(len(ranks)) if len(ranks[r]) < slots_per_rank[r] and expert not in ranks[r]]
        if not free:
            return None
        rank = min(free, key=lambda r: (rank_load[r], expert not in held[r], r))
        ranks[rank].append(expert)
        rank_load[rank] += weight
    return ranks


def improve_by_swaps(ranks: list[list[int]], load: Sequence[float], counts: Sequence[int],
                     max_rounds: int = 100) -> list[list[int]]:
    """Swap single replicas between the most loaded rank and another while that lowers the pair's maximum.

    Greedy packing alone can leave a hot expert on a rank with more slots (uneven slot counts); one
    swap pass fixes that. Replicas of one expert stay on distinct ranks.
    """
    weight = [load[e] / counts[e] for e in range(len(counts))]
    for _ in range(max_rounds):
        totals = [sum(weight[e] for e in experts) for experts in ranks]
        heavy = max(range(len(ranks)), key=lambda r: (totals[r], -r))
        best = None                                   # (new pair maximum, other rank, index in heavy, index in other)
        for other in range(len(ranks)):
            if other == heavy:
                continue
            for i, x in enumerate(ranks[heavy]):
                for j, y in enumerate(ranks[other]):
                    if x == y or y in ranks[heavy] or x in ranks[other]:
                        continue
                    delta = weight[x] - weight[y]
                    pair_max = max(totals[heavy] - delta, totals[other] + delta)
                    if pair_max < totals[heavy] - 1e-12 and (best is None or pair_max < best[0]):
                        best = (pair_max, other, i, j)
        if best is None:
            return ranks
        _, other, i, j = best
        ranks[heavy][i], ranks[other][j] = ranks[other][j], ranks[heavy][i]
    return ranks


def round_robin(counts: Sequence[int], slots_per_rank: Sequence[int]) -> list[list[int]]:
    """Replicas laid over slots round by round (rank 0, 1, ..., then each rank's next slot).

    Consecutive replicas land on distinct ranks as long as no expert has more replicas than ranks
    with slots (only the last round may be short, and nothing wraps past it).
    """
    order = [r for depth in range(max(slots_per_rank, default=0)) for r in range(len(slots_per_rank))
             if slots_per_rank[r] > depth]
    replicas = [e for e in sorted(range(len(counts)), key=lambda e: (-counts[e], e)) for _ in range(counts[e])]
    ranks: list[list[int]] = [[] for _ in slots_per_rank]
    for rank, expert in zip(order, replicas):
        ranks[rank].append(expert)
    return ranks


def order_slots(ranks: Sequence[Sequence[int]], current: ExpertPlacement | None) -> tuple[tuple[int, ...], ...]:
    """Each rank's experts in slot order: experts it already holds keep their slot, new ones fill the gaps."""
    result = []
    for rank, experts in enumerate(ranks):
        old = current.rank_experts[rank] if current is not None and rank < current.num_ranks else ()
        slots: list[int | None] = [e if e in experts else None for e in old][:len(experts)]
        slots += [None] * (len(experts) - len(slots))
        newcomers = iter(sorted(e for e in experts if e not in slots))
        result.append(tuple(e if e is not None else next(newcomers) for e in slots))
    return tuple(result)


def balance(load: Sequence[float], num_ranks: int, num_redundant: int = 0,
            current: ExpertPlacement | None = None) -> ExpertPlacement:
    """The placement of one layer for `load` [num_experts] (any non-negative numbers)."""
    num_experts = len(load)
    check_redundancy(num_experts, num_ranks, num_redundant)
    load = [float(x) for x in load]
    if sum(load) <= 0:                      # no traffic recorded: nothing to balance by
        return current if current is not None else initial_placement(num_experts, num_ranks, num_redundant)
    slots_per_rank = split_evenly(num_experts + num_redundant, num_ranks)
    counts = replicate(load, num_experts + num_redundant, max_replicas(num_experts, num_ranks, num_redundant))
    ranks = pack(load, counts, slots_per_rank, current)
    if ranks is None:
        ranks = round_robin(counts, slots_per_rank)
    ranks = improve_by_swaps(ranks, load, counts)
    return ExpertPlacement(num_experts, order_slots(ranks, current))


def initial_placement(num_experts: int, num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
    """Before any load is known: contiguous blocks; with redundant slots, a balance of uniform load."""
    if num_redundant == 0:
        return ExpertPlacement.contiguous(num_experts, num_ranks)
    return balance([1.0] * num_experts, num_ranks, num_redundant)

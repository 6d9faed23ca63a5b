"""Which rank holds which expert: the expert -> rank map of one MoE layer.

Each rank owns a fixed number of *slots* (physical experts). Slot counts come from the number of
ranks and `num_experts + num_redundant_experts` alone (`split_evenly`), so they never change when
the balancer moves experts around: 8 experts on 3 ranks are 3 + 3 + 2 slots; 8 experts plus 2
redundant on 2 ranks are 5 + 5. A *physical id* numbers all slots of the layer rank by rank:
rank r's slots are [slot_offsets[r], slot_offsets[r] + slots_per_rank[r]).

An expert with several replicas (on distinct ranks) has its tokens split between them: token t
of rank s uses replica (t + s) % replica_count (see `expert_parallel.ExpertParallelExperts`),
so `per_rank_load` assumes an even split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """`total` items over `parts` bins, the first `total % parts` bins one larger: (8, 3) -> (3, 3, 2)."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if part < extra else 0) for part in range(parts))


@dataclass(frozen=True)
class ExpertPlacement:
    """rank_experts[r][s] = the logical expert in local slot s of rank r (one MoE layer)."""

    num_experts: int
    rank_experts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_experts", tuple(tuple(int(e) for e in slots) for slots in self.rank_experts))
        if not self.rank_experts:
            raise ValueError("a placement needs at least one rank")
        seen = set()
        for rank, slots in enumerate(self.rank_experts):
            bad = [e for e in slots if not 0 <= e < self.num_experts]
            if bad:
                raise ValueError(f"rank {rank} holds expert {bad[0]}, outside [0, {self.num_experts})")
            if len(set(slots)) != len(slots):
                raise ValueError(f"rank {rank} holds an expert twice: {slots}")
            seen.update(slots)
        missing = sorted(set(range(self.num_experts)) - seen)
        if missing:
            raise ValueError(f"experts {missing} are on no rank")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> "ExpertPlacement":
        """No replicas: experts in order, ranks filled in order (uneven counts allowed)."""
        ranks, start = [], 0
        for count in split_evenly(num_experts, num_ranks):
            ranks.append(tuple(range(start, start + count)))
            start += count
        return cls(num_experts, tuple(ranks))

    # -- derived ------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.rank_experts)

    @property
    def slots_per_rank(self) -> tuple[int, ...]:
        return tuple(len(slots) for slots in self.rank_experts)

    @property
    def num_slots(self) -> int:
        return sum(self.slots_per_rank)

    @property
    def num_redundant(self) -> int:
        return self.num_slots - self.num_experts

    @property
    def slot_offsets(self) -> tuple[int, ...]:
        """Physical id of each rank's first slot."""
        offsets, start = [], 0
        for count in self.slots_per_rank:
            offsets.append(start)
            start += count
        return tuple(offsets)

    @property
    def physical_experts(self) -> tuple[int, ...]:
        """Logical expert of every physical id."""
        return tuple(e for slots in self.rank_experts for e in slots)

    @property
    def slot_ranks(self) -> tuple[int, ...]:
        """Rank of every physical id."""
        return tuple(rank for rank, slots in enumerate(self.rank_experts) for _ in slots)

    def replicas(self, expert: int) -> tuple[int, ...]:
        """Physical ids holding `expert`, ascending."""
        return tuple(p for p, e in enumerate(self.physical_experts) if e == expert)

    @property
    def replica_counts(self) -> tuple[int, ...]:
        counts = [0] * self.num_experts
        for e in self.physical_experts:
            counts[e] += 1
        return tuple(counts)

    def ranks_of(self, expert: int) -> tuple[int, ...]:
        return tuple(rank for rank, slots in enumerate(self.rank_experts) if expert in slots)

    # -- load ---------------------------------------------------------------------------------
    def per_rank_load(self, load: Sequence[float]) -> list[float]:
        """Routed token-slots each rank computes, splitting an expert's load evenly over its replicas."""
        counts = self.replica_counts
        return [sum(float(load[e]) / counts[e] for e in slots) for slots in self.rank_experts]

    def imbalance(self, load: Sequence[float]) -> float:
        """max / mean of the per-rank load (1.0 = perfectly balanced; 1.0 when there is no load)."""
        per_rank = self.per_rank_load(load)
        mean = sum(per_rank) / len(per_rank)
        return max(per_rank) / mean if mean > 0 else 1.0

    def moves_from(self, old: "ExpertPlacement") -> int:
        """Slots whose expert changes when going from `old` to this placement (weights to move)."""
        return sum(1 for new_slots, old_slots in zip(self.rank_experts, old.rank_experts)
                   for e in new_slots if e not in old_slots)

    def to_dict(self) -> dict:
        return {"num_experts": self.num_experts, "rank_experts": [list(s) for s in self.rank_experts]}

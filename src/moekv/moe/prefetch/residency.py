"""Which experts of one MoE layer sit in which device slots: the host-side bookkeeping of the cache.

No tensors here (offload.py moves the bytes); this is the policy, testable on its own:

- `num_slots` slots hold at most that many of the layer's `num_experts` experts.
- Eviction picks, among the slots it may take, the lowest protection level first, then the least
  recently used (LRU) or the least frequently used (LFU, ties by least recent) expert.
- Protection levels for the current step (cleared by `end_step()` after the layer ran):
  PREDICTED_FAR (predicted two layers ahead) < PREDICTED (one layer ahead) < NEEDED (routed now).
  A request at level p may only evict an expert protected below p, so a prediction never evicts
  an expert the running block needs, and a one-ahead prediction may evict a two-ahead one.
- Predictions are hints: protecting a resident expert does not count as a use (no LRU/LFU update);
  an admitted expert counts as recently used (LRU) but keeps its use count (LFU counts uses over
  the whole run, resident or not).
"""

from __future__ import annotations

from dataclasses import dataclass

UNPROTECTED, PREDICTED_FAR, PREDICTED, NEEDED = 0, 1, 2, 3


@dataclass
class CacheCounters:
    """What happened to the experts a block needed (per layer; summed for totals)."""

    hits: int = 0                   # needed experts that were resident (including prefetched ones)
    prefetch_hits: int = 0          # ... of which were brought in by a prefetch not yet used
    misses: int = 0                 # needed experts loaded on demand (the block waits for these)
    prefetches: int = 0             # experts copied ahead of need because they were predicted
    wasted_prefetches: int = 0      # prefetched experts evicted before any use
    evictions: int = 0
    staged_hits: int = 0            # misses whose copy a staged guess had started (policy.py)
    split_misses: int = 0           # misses computed part on the CPU, part from a partial copy (not admitted)

    def add(self, other: "CacheCounters") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def hit_rate(self) -> float:
        needed = self.hits + self.misses
        return self.hits / needed if needed else 0.0

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["hit_rate"] = self.hit_rate
        return out


class ExpertCache:
    """Slot bookkeeping of one layer's device expert cache."""

    def __init__(self, num_experts: int, num_slots: int, policy: str = "lru"):
        assert 1 <= num_slots <= num_experts and policy in ("lru", "lfu")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.policy = policy
        self.slot_of_expert: list[int] = [-1] * num_experts     # -1: not resident
        self.expert_in_slot: list[int] = [-1] * num_slots       # -1: empty slot
        self.last_use: list[int] = [0] * num_experts            # tick of the last use (0: never)
        self.use_count: list[int] = [0] * num_experts           # uses while ever resident (LFU)
        self.protection: list[int] = [UNPROTECTED] * num_experts
        self.unused_prefetch: list[bool] = [False] * num_experts
        self.counters = CacheCounters()
        self._tick = 0

    # -- queries ---------------------------------------------------------------------------------
    def is_resident(self, expert: int) -> bool:
        return self.slot_of_expert[expert] >= 0

    def resident_experts(self) -> list[int]:
        return [e for e in self.expert_in_slot if e >= 0]

    def _rank(self, slot: int) -> tuple:
        """Eviction order: smaller is evicted first (empty slots before everything)."""
        expert = self.expert_in_slot[slot]
        if expert < 0:
            return (-1,)
        if self.policy == "lfu":
            return (self.protection[expert], self.use_count[expert], self.last_use[expert])
        return (self.protection[expert], self.last_use[expert])

    def victim(self, level: int) -> int | None:
        """The slot to fill for a request protected at `level`, or None if every slot is protected at
        `level` or above."""
        slot = min(range(self.num_slots), key=self._rank)
        expert = self.expert_in_slot[slot]
        if expert >= 0 and self.protection[expert] >= level:
            return None
        return slot

    # -- changes ---------------------------------------------------------------------------------
    def protect(self, expert: int, level: int) -> None:
        self.protection[expert] = max(self.protection[expert], level)

    def admit(self, expert: int, level: int, prefetch: bool = False) -> tuple[int, int] | None:
        """Make room for a non-resident `expert` and assign it a slot; the caller copies its weights.

        Returns (slot, evicted expert or -1), or None when no slot may be taken at `level`.
        """
        assert not self.is_resident(expert)
        slot = self.victim(level)
        if slot is None:
            return None
        evicted = self.expert_in_slot[slot]
        if evicted >= 0:
            self.slot_of_expert[evicted] = -1
            self.counters.evictions += 1
            if self.unused_prefetch[evicted]:
                self.counters.wasted_prefetches += 1
                self.unused_prefetch[evicted] = False
        self.expert_in_slot[slot] = expert
        self.slot_of_expert[expert] = slot
        self._tick += 1
        self.last_use[expert] = self._tick                  # arriving counts as recent (not as a use for LFU)
        self.protect(expert, level)
        if prefetch:
            self.unused_prefetch[expert] = True
            self.counters.prefetches += 1
        return slot, evicted

    def use(self, expert: int) -> None:
        """The running block computed with `expert` (resident): update recency and frequency."""
        self._tick += 1
        self.last_use[expert] = self._tick
        self.use_count[expert] += 1
        self.unused_prefetch[expert] = False

    def record_need(self, expert: int) -> bool:
        """Count a needed expert as a hit (resident) or a miss; returns whether it was resident."""
        if self.is_resident(expert):
            self.counters.hits += 1
            if self.unused_prefetch[expert]:
                self.counters.prefetch_hits += 1
            return True
        self.counters.misses += 1
        return False

    def end_step(self) -> None:
        """The layer ran: drop this step's protections."""
        self.protection = [UNPROTECTED] * self.num_experts

"""Device-driven staging: offloaded experts with the slot table on the device and no host read of routing.

The host-driven path (offload.py) reads each layer's routing back to the host to decide its copies, so an
offloaded decode step cannot be captured in a CUDA graph. Here the decision is device work:

    DeviceSlotTable.plan(topk_ids)   torch ops on [E] / [S] tensors, fixed shapes, no sync: which experts
                                     are needed, which of them are missing, the victim slots (empty first,
                                     then LRU or LFU among the slots holding no needed expert), the table
                                     update, the use ticks, the hit / miss counters, and a copy list of
                                     M = min(S, T*k) entries (expert id or -1, pool slot; unused entries
                                     name the pool's trash slot)
    ops.dispatch.stage_expert_copies one launch per plane: the Triton kernel reads the listed experts from
                                     pinned host memory through UVA into the pool (ops/triton/moe/stage.py;
                                     the reference twin gathers with index ops)
    SlotExpertCompute                the same kernels, configuration and summation as the resident experts,
                                     with the [E] -> pool slot table as a device tensor

All of it is stream-ordered on the current stream: the copies of layer l's misses run before layer l's
experts and after every earlier reader of the victim slots, with no events and no host decision, so a
decode step replays as a CUDA graph like resident decode (engine/cuda_graphs.py takes experts that set
`graph_capturable`). The device table makes the same choices as residency.ExpertCache loading on demand
(tests drive both with the same routing), so the copies, hits and misses equal the host path's.

Limits: one pass per layer, so a step may need at most S experts per layer; a step with T*k > S tokens
(prefill) runs groups of S experts, reading the needed set on the host (eager steps only). No guesses yet:
staging="device" loads on demand (the design for device-side guesses: docs/expert-offload.md).
"""

from __future__ import annotations

import torch

from moekv.moe.prefetch.compute import SlotExpertCompute
from moekv.moe.prefetch.pool import HostExperts, PooledExperts, SlotPool
from moekv.moe.prefetch.residency import CacheCounters
from moekv.ops import dispatch

LFU_SHIFT = 40                  # LFU key: use count * 2**40 + last use tick (ticks stay far below 2**40)


class DeviceSlotTable:
    """One layer's slots as device tensors: the device twin of ExpertCache for on-demand loading."""

    def __init__(self, num_experts: int, slot_pool: list[int], trash: int, eviction: str, device: torch.device):
        assert eviction in ("lru", "lfu")
        num_slots = len(slot_pool)
        self.num_experts, self.num_slots, self.eviction = num_experts, num_slots, eviction
        self.expert_slot = torch.full((num_experts + 1,), -1, dtype=torch.int64, device=device)  # [E+1], E: sink
        self.slot_expert = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=device)    # [S+1], S: sink
        self.slot_pool = torch.tensor(slot_pool + [trash], dtype=torch.int64, device=device)    # [S+1]
        self.last_use = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)            # [S+1] ticks
        self.use_count = torch.zeros(num_experts, dtype=torch.int64, device=device)            # [E]
        self.tick = torch.zeros(1, dtype=torch.int64, device=device)
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)    # hits, misses, evictions
        self._experts = torch.arange(num_experts, device=device)
        self._slots = torch.arange(num_slots, device=device)

    def plan(self, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the experts in `expert_ids` (any shape, at most S distinct) resident in the table.

        -> (src [M] int64: the expert to copy per entry or -1, dst [M] int64: its pool slot, the trash slot
        for unused entries), M = min(S, expert_ids.numel()). Device ops only."""
        num_experts, num_slots = self.num_experts, self.num_slots
        flat = expert_ids.reshape(-1)
        entries = min(num_slots, flat.numel())
        needed = torch.zeros(num_experts, dtype=torch.bool, device=flat.device).index_fill_(0, flat, True)   # [E]
        resident = self.expert_slot[:num_experts] >= 0
        missing = needed & ~resident
        # the missing experts, ascending (as ExpertCache admits them), first `entries` of them
        order = torch.sort(torch.where(missing, self._experts, self._experts + num_experts)).values[:entries]
        valid = order < num_experts                                                   # [M]
        incoming = torch.where(valid, order, num_experts)                             # [M], sink E
        # victims: empty slots first (lowest index), then the least recently (LRU) / frequently (LFU) used;
        # slots holding a needed expert are never taken
        held = self.slot_expert[:num_slots]                                           # [S]
        held_safe = held.clamp(min=0)
        key = self.last_use[:num_slots]
        if self.eviction == "lfu":
            key = self.use_count.index_select(0, held_safe) * (1 << LFU_SHIFT) + key
        key = torch.where(held < 0, -1, key)
        key = torch.where((held >= 0) & needed.index_select(0, held_safe), torch.iinfo(torch.int64).max, key)
        victims = torch.sort(key, stable=True).indices[:entries]                      # [M]
        victims = torch.where(valid, victims, num_slots)                              # sink S
        evicted = self.slot_expert.index_select(0, victims)                           # [M]
        gone = valid & (evicted >= 0)
        self.expert_slot.index_fill_(0, torch.where(gone, evicted, num_experts), -1)
        self.slot_expert.index_copy_(0, victims, incoming)
        self.expert_slot.index_copy_(0, incoming, victims)
        # uses: the needed experts become the most recent, in ascending expert order (as ExpertCache.use)
        rank = torch.cumsum(needed.to(torch.int64), 0)                                # [E] 1-based among needed
        used_slots = torch.where(needed, self.expert_slot[:num_experts], num_slots)   # [E], sink S
        self.last_use.index_copy_(0, used_slots, self.tick + rank)
        self.tick += needed.sum()
        self.use_count += needed.to(torch.int64)
        self.counters += torch.stack([(needed & resident).sum(), missing.sum(), gone.sum()])
        src = torch.where(valid, order, -1)
        return src, self.slot_pool.index_select(0, victims)

    def pool_index_of(self) -> torch.Tensor:
        """[E] pool slot of every expert (-1: not resident)."""
        slots = self.expert_slot[:self.num_experts]
        return torch.where(slots >= 0, self.slot_pool.index_select(0, slots.clamp(min=0)), -1)

    def resident(self) -> list[int]:
        """Resident experts, ascending (reads the device: tests, stats)."""
        return [e for e, s in enumerate(self.expert_slot[:self.num_experts].tolist()) if s >= 0]


class _DeviceCounters:
    """`.counters` of a device table as residency.CacheCounters (reading them syncs: outside a step)."""

    def __init__(self, table: DeviceSlotTable):
        self.table = table

    @property
    def counters(self) -> CacheCounters:
        hits, misses, evictions = self.table.counters.tolist()
        return CacheCounters(hits=hits, misses=misses, evictions=evictions)

    @counters.setter
    def counters(self, value: CacheCounters) -> None:
        self.table.counters.copy_(torch.tensor([value.hits, value.misses, value.evictions]))


class DeviceStagedExperts(PooledExperts):
    """One layer's offloaded experts, staged by the device (module docstring)."""

    graph_capturable = True         # decode steps with T*k <= S read nothing back to the host

    def __init__(self, layer_idx: int, host: HostExperts, pool: SlotPool, slots: list[int], eviction: str = "lru"):
        super().__init__(layer_idx, host, pool, slots)
        self.table = DeviceSlotTable(self.num_experts, self.slot_pool, pool.trash, eviction, pool.device)
        self.cache = _DeviceCounters(self.table)
        self.staging = None
        self.events = None

    def _stage(self, expert_ids: torch.Tensor) -> None:
        src, dst = self.table.plan(expert_ids)
        for host_plane, pool_plane in zip(self.host.planes, self.pool.planes):
            dispatch.stage_expert_copies(host_plane, pool_plane, src, dst)

    def forward(self, hidden, topk_ids, topk_weights):
        """hidden [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H]."""
        weights = self.pool.weights()
        inter = self.host.down.shape[2]
        if topk_ids.numel() <= self.num_slots:                          # one pass, planned on the device
            self._stage(topk_ids)
            compute = SlotExpertCompute(hidden, topk_ids, topk_weights, self.num_experts, inter, weights=weights)
            compute.add(*weights, self.table.expert_slot[:self.num_experts], self.table.slot_pool, None)
            return compute.result()
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts).tolist()   # host read (prefill)
        needed = [e for e, c in enumerate(counts) if c > 0]
        compute = SlotExpertCompute(hidden, topk_ids, topk_weights, self.num_experts, inter, counts, weights=weights)
        groups = [needed[i:i + self.num_slots] for i in range(0, len(needed), self.num_slots)]
        for group in groups:
            self._stage(torch.tensor(group, dtype=torch.int64, device=topk_ids.device))
            compute.add(*weights, self.table.expert_slot[:self.num_experts], self.table.slot_pool,
                        None if len(groups) == 1 else group)
        return compute.result()

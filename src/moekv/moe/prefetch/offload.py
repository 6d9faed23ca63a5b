"""Offloaded experts: weights in host memory, a bounded cache of device slots per MoE layer.

`OffloadedExperts` replaces a block's `LocalExperts` after the model is built. Per layer it holds
the experts' weights in host memory (pinned when CUDA is available) and `num_slots` device slots
(slot_w_gate_up [S, 2I, H], slot_w_down [S, H, I]). A block's forward:

    1. one host read: which experts the router chose (and the vote counts of pending predictions)
    2. demand-load the chosen experts that are not resident (misses; the block waits for these)
    3. issue prefetches for later layers from the predictions made so far (ExpertOffload)
    4. compute with the slot tensors (compute.SlotExpertCompute): the same kernels, launch
       configuration (that of the resident [E, ...] shape) and summation order as LocalExperts,
       so the output is bit-identical to the resident model's
When more experts are needed than there are slots (a long prefill), the needed experts are split
into groups of S and computed in several passes; each pass fills its rows of the per-(token,
choice) expert outputs and the weighted sum over a token's choices runs once at the end.

Copies: on CUDA they run on one side stream. Each slot has a "ready" event recorded after its
copy and the main stream waits on exactly the slots a pass uses (so a block waits only for copies
still in flight: misses and late prefetches); the side stream waits on the layer's last compute
before overwriting its slots. On the CPU a copy is a plain tensor copy into the slot, so the same
bookkeeping runs in CI.
"""

from __future__ import annotations

import time

import torch

from moekv.layers.experts import Experts
from moekv.moe.prefetch.compute import SlotExpertCompute
from moekv.moe.prefetch.residency import NEEDED, UNPROTECTED, ExpertCache


def to_host(weight: torch.Tensor) -> torch.Tensor:
    """A host copy of `weight`; pinned (page-locked, for asynchronous copies) only when CUDA exists."""
    host = weight.detach().to("cpu")                     # no copy when the weight already lives on the CPU
    return host.pin_memory() if torch.cuda.is_available() else host


class SlotCopier:
    """Host -> device slot copies: a side CUDA stream ordered with events, or plain copies on the CPU.

    Counts copies and bytes (host-side integers, no sync).
    """

    def __init__(self, device: torch.device, timing: bool = False):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copies = 0
        self.bytes = 0
        self.timing = timing            # measure each copy (benchmarks): CUDA events on the copy stream
        self._timed: list = []          # (start, end) events on CUDA
        self._seconds = 0.0             # CPU copies, and CUDA events already read

    def copy_seconds(self) -> float:
        """Total time the copies took (copy-stream busy time on CUDA; reads the events: syncs)."""
        if self._timed:
            self._timed[-1][1].synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in self._timed) / 1e3
            self._timed.clear()
        return self._seconds

    def reset_counters(self) -> None:
        self.copies = self.bytes = 0
        self._timed.clear()
        self._seconds = 0.0

    def copy_expert(self, experts: "OffloadedExperts", expert: int, slot: int) -> None:
        src_gate_up, src_down = experts.host_w_gate_up[expert], experts.host_w_down[expert]
        dst_gate_up, dst_down = experts.slot_w_gate_up[slot], experts.slot_w_down[slot]
        self.copies += 1
        self.bytes += src_gate_up.nbytes + src_down.nbytes
        if self.stream is None:
            began = time.perf_counter() if self.timing else 0.0
            dst_gate_up.copy_(src_gate_up)
            dst_down.copy_(src_down)
            if self.timing:
                self._seconds += time.perf_counter() - began
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(experts.compute_done)       # the slot's last reader has finished
            start = None
            if self.timing:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            dst_gate_up.copy_(src_gate_up, non_blocking=True)
            dst_down.copy_(src_down, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=self.timing)
            ready.record(self.stream)
        if start is not None:
            self._timed.append((start, ready))
        experts.slot_ready[slot] = ready

    def wait_for(self, experts: "OffloadedExperts", slots: list[int]) -> None:
        """Order the current stream after the copies into `slots` (no host wait)."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        for slot in slots:
            ready = experts.slot_ready[slot]
            if ready is not None:
                current.wait_event(ready)
                experts.slot_ready[slot] = None

    def mark_computed(self, experts: "OffloadedExperts") -> None:
        if self.stream is not None:
            experts.compute_done.record(torch.cuda.current_stream(self.device))


class OffloadedExperts(Experts):
    """One layer's experts: host weights + `num_slots` device slots managed by an ExpertCache."""

    def __init__(self, layer_idx: int, host_w_gate_up: torch.Tensor, host_w_down: torch.Tensor, num_slots: int,
                 device: torch.device, dtype: torch.dtype, copier: SlotCopier, eviction: str = "lru",
                 on_routed=None):
        super().__init__()
        num_experts, two_inter, hidden = host_w_gate_up.shape
        self.layer_idx = layer_idx
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.host_w_gate_up = host_w_gate_up                    # [E, 2I, H] host (plain attribute: never moved)
        self.host_w_down = host_w_down                          # [E, H, I] host
        self.register_buffer("slot_w_gate_up", torch.zeros(num_slots, two_inter, hidden, dtype=dtype,
                                                           device=device), persistent=False)   # [S, 2I, H]
        self.register_buffer("slot_w_down", torch.zeros(num_slots, hidden, two_inter // 2, dtype=dtype,
                                                        device=device), persistent=False)      # [S, H, I]
        self.cache = ExpertCache(num_experts, num_slots, eviction)
        self.copier = copier
        self.slot_ready: list = [None] * num_slots              # CUDA events of copies in flight
        self.compute_done = torch.cuda.Event() if device.type == "cuda" else None
        if self.compute_done is not None:
            self.compute_done.record(torch.cuda.current_stream(device))
        self.on_routed = on_routed      # callable(layer, pending vote rows) -> issues prefetches (ExpertOffload)
        self.pending_votes = None       # callable() -> list of [E] device tensors to read with the routing
        self.events: list[tuple] | None = None   # optional trace for tests: ("load"|"prefetch"|"compute", ...)

    @property
    def expert_bytes(self) -> int:
        return self.host_w_gate_up[0].nbytes + self.host_w_down[0].nbytes

    def _load(self, expert: int, level: int, prefetch: bool) -> bool:
        """Make `expert` resident (copy issued); False if no slot may be taken at `level`."""
        admitted = self.cache.admit(expert, level, prefetch=prefetch)
        if admitted is None:
            return False
        self.copier.copy_expert(self, expert, admitted[0])
        if self.events is not None:
            self.events.append(("prefetch" if prefetch else "load", self.layer_idx, expert, admitted[0]))
        return True

    def prefetch(self, experts: list[int], level: int) -> None:
        """Stage predicted `experts` (most wanted first) and protect them at `level` for this step."""
        for expert in experts[:self.num_slots]:
            if self.cache.is_resident(expert):
                self.cache.protect(expert, level)
            elif not self._load(expert, level, prefetch=True):
                break

    def forward(self, hidden, topk_ids, topk_weights):
        """hidden [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H]."""
        num_experts = self.num_experts
        flat_ids = topk_ids.reshape(-1)                                                 # [T*k]
        routed = torch.zeros(num_experts, dtype=torch.float32, device=flat_ids.device)
        routed.index_add_(0, flat_ids, torch.ones(flat_ids.shape, device=flat_ids.device))   # [E] (bincount syncs on CUDA)
        rows = [routed]
        pending = self.pending_votes() if self.pending_votes is not None else []
        counts = torch.stack(rows + pending).tolist()            # the block's one host sync
        needed = [e for e in range(num_experts) if counts[0][e] > 0]
        cache = self.cache
        resident = [e for e in needed if cache.record_need(e)]
        missing = [e for e in needed if e not in resident]
        groups = [needed] if len(needed) <= self.num_slots else \
            [(resident + missing)[i:i + self.num_slots] for i in range(0, len(needed), self.num_slots)]
        for expert in groups[0]:
            cache.protect(expert, NEEDED)
        for expert in groups[0]:
            if not cache.is_resident(expert):
                self._load(expert, NEEDED, prefetch=False)      # a miss: the block waits for this copy
        if self.on_routed is not None:
            self.on_routed(self.layer_idx, counts[1:])          # prefetches for later layers, after our misses
        compute = SlotExpertCompute(hidden, topk_ids, topk_weights, num_experts, self.slot_w_down.shape[2],
                                    [int(c) for c in counts[0]])
        for index, group in enumerate(groups):
            if index > 0:                                       # more experts than slots: next group
                for expert in groups[index - 1]:
                    cache.protection[expert] = UNPROTECTED
                for expert in group:
                    cache.protect(expert, NEEDED)
                for expert in group:
                    if not cache.is_resident(expert):
                        self._load(expert, NEEDED, prefetch=False)
            self._compute(compute, group, None if len(groups) == 1 else group)
        out = compute.result()                                  # [T, H], bit-identical to LocalExperts
        cache.end_step()
        return out

    def _compute(self, compute: SlotExpertCompute, group: list[int], experts: list[int] | None) -> None:
        """One pass over the slot-resident experts of `group` (experts None: all of the step's rows)."""
        slots = [self.cache.slot_of_expert[e] for e in group]
        self.copier.wait_for(self, slots)
        for expert in group:
            self.cache.use(expert)
        if self.events is not None:
            self.events.append(("compute", self.layer_idx, tuple(group), tuple(slots)))
        compute.add(self.slot_w_gate_up, self.slot_w_down, list(self.cache.slot_of_expert), experts)
        self.copier.mark_computed(self)

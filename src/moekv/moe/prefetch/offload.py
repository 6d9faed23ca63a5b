"""Offloaded experts: weights in host memory, a bounded cache of device slots per MoE layer.

`OffloadedExperts` replaces a block's `LocalExperts` after the model is built. Per layer it holds the
experts' host copies (pool.HostExperts: pinned when CUDA is available, 16-bit or FP8) and owns S slots
of the shared device pool (pool.SlotPool; `slot_pool[j]` is the pool index of its local slot j).
A block's forward (the host-driven path; device_staging.py is the one without host reads):

    1. one host read: which experts the router chose (and the rows of pending predictions)
    2. demand-load the chosen experts that are not resident (misses; the block waits for these). A miss
       that a staged guess had started (policy.py) takes over the guess's staging slot and copies only
       the chunks still missing; the slot it evicts becomes a staging slot
    3. prefetch guesses for later layers from the predictions made so far (ExpertOffload)
    4. compute with the pool (compute.SlotExpertCompute): the same kernels, launch configuration (that
       of the resident [E, ...] shape) and summation order as LocalExperts, so the output is
       bit-identical to the resident model's (FP8 host experts: to the resident FP8 model's)
With cpu_compute_fraction > 0 (`split`, cpu_split.CpuSplit) a decode miss with few rows is not admitted: after
step 2 its first channels go to the CPU worker and only the rest is copied (to a part buffer, not a slot), and
its rows are put into step 4's buffer before the weighted sum (close to, not bit-identical with, LocalExperts).
The staged policy marks the decision point right after the host read (its overrun check, staged.py) and
stages its guesses after step 4's launch instead of at step 3.
When more experts are needed than there are slots (a long prefill), the needed experts are split
into groups of S and computed in several passes; each pass fills its rows of the per-(token,
choice) expert outputs and the weighted sum over a token's choices runs once at the end.

Copies: on CUDA they run on one side stream. Each pool slot has a "ready" event recorded after its
latest copy and the main stream waits on exactly the slots a pass uses (so a block waits only for
copies still in flight); before overwriting a slot the side stream waits on the end of the last compute
that read it (an event per compute). On the CPU a copy is a plain tensor copy, so the same bookkeeping runs in CI.
"""

from __future__ import annotations

import time

import torch

from moekv.moe.prefetch.compute import SlotExpertCompute
from moekv.moe.prefetch.gate import EventMeter
from moekv.moe.prefetch.pool import HostExperts, PooledExperts, SlotPool, plane_rows
from moekv.moe.prefetch.residency import NEEDED, UNPROTECTED, ExpertCache


class SlotCopier:
    """Host -> pool copies: a side CUDA stream ordered with events, or plain copies on the CPU.

    Counts copies and bytes (host-side integers, no sync) and keeps a host-clock estimate of when the
    copy stream runs dry (`busy_until`, perf_counter seconds; `bandwidth` bytes/s once measured), which
    the staged prefetch policy plans with.
    """

    def __init__(self, device: torch.device, timing: bool = False, chunks: int = 8):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.chunks = chunks            # pieces of one expert copy for staged guesses
        self.copies = 0
        self.bytes = 0
        self.timing = timing            # measure each copy (benchmarks): CUDA events on the copy stream
        self._timed: list = []          # (start, end) events on CUDA
        self._seconds = 0.0             # CPU copies, and CUDA events already read
        self.ready: dict[int, torch.cuda.Event] = {}       # pool index -> event after its latest copy
        self.reader: dict[int, torch.cuda.Event] = {}      # pool index -> the end of the last compute that read it
        self.bandwidth: float | None = None                 # bytes / s, host -> device (measure_bandwidth)
        self.busy_until = 0.0                               # host-clock estimate: the copy stream is idle after
        self.last_event = None                              # the latest copy's end event (CUDA)

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

    def measure_bandwidth(self, host: HostExperts, pool: SlotPool, index: int) -> float:
        """Time one whole expert copy into pool slot `index` (synchronous; CUDA) -> bytes / s."""
        if self.stream is None:
            return 0.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for src, dst in zip(host.planes, pool.planes):
                dst[index].copy_(src[0], non_blocking=True)
            end.record(self.stream)
        end.synchronize()
        self.bandwidth = host.expert_bytes / max(start.elapsed_time(end) / 1e3, 1e-9)
        return self.bandwidth

    def copy(self, host: HostExperts, expert: int, pool: SlotPool, index: int, chunks: range | None = None,
             new: bool = True) -> int:
        """Copy `expert`'s planes (only `chunks` of them, each a row range of every plane) into pool slot
        `index`; `new` counts it as a copy. Returns the bytes moved."""
        if isinstance(chunks, range) and chunks.step == 1 and len(chunks) > 0:
            spans = [(chunks.start, chunks.stop)]          # consecutive chunks: one row range per plane
        else:
            spans = [(c, c + 1) for c in chunks] if chunks is not None else None
        pieces = []
        for src, dst in zip(host.planes, pool.planes):
            if spans is None:
                pieces.append((src[expert], dst[index]))
            else:
                rows = [plane_rows(src, a, self.chunks, b) for a, b in spans]
                pieces += [(src[expert][r], dst[index][r]) for r in rows]
        return self.copy_pieces(pieces, index, new)

    def copy_pieces(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], index, new: bool = True) -> int:
        """Copy (host source, device destination) pairs as one copy into `index`: a pool slot, or any other key
        whose readers are ordered the same way (the CPU-split part buffers, cpu_split.py). Returns the bytes."""
        nbytes = sum(s.nbytes for s, _ in pieces)
        self.copies += int(new)
        self.bytes += nbytes
        now = time.perf_counter()
        if self.stream is None:
            for s, d in pieces:
                d.copy_(s)
            self._seconds += (time.perf_counter() - now) if self.timing else 0.0
            self.busy_until = time.perf_counter()
            return nbytes
        with torch.cuda.stream(self.stream):
            reader = self.reader.get(index)
            if reader is not None:
                self.stream.wait_event(reader)                   # the slot's last reader has finished
            start = None
            if self.timing:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            for s, d in pieces:
                d.copy_(s, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=self.timing)
            ready.record(self.stream)
        if start is not None:
            self._timed.append((start, ready))
        self.ready[index] = ready
        self.last_event = ready
        if self.bandwidth:
            self.busy_until = max(self.busy_until, now) + nbytes / self.bandwidth
        return nbytes

    def mark(self):
        """A marker of the copies issued so far (their last event; None on the CPU: copies are done)."""
        return self.last_event

    def passed(self, marker) -> bool:
        """Whether the copies up to `marker` have finished (an event query: no wait)."""
        return marker is None or marker.query()

    def wait_for(self, indices: list[int]) -> None:
        """Order the current stream after the copies into pool slots `indices` (no host wait)."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        for index in indices:
            ready = self.ready.pop(index, None)
            if ready is not None:
                current.wait_event(ready)

    def mark_computed(self, indices: list[int]) -> None:
        """A compute reading pool slots `indices` was launched: copies into them wait for its end (one event
        per compute, so a copy into a slot waits for the compute that read that slot, not a later one)."""
        if self.stream is None:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        for index in indices:
            self.reader[index] = done

    def make_meter(self):
        """The measured guess gate's meter (gate.EventMeter on CUDA; None on the CPU: copies are synchronous)."""
        return EventMeter(self.stream, self.device) if self.stream is not None else None


class OffloadedExperts(PooledExperts):
    """One layer's experts: host copies + `len(slots)` slots of the device pool managed by an ExpertCache.

    staging: the manager's staged-guess bookkeeping (policy.StagedPrefetch) or None; `_load` asks it
    whether a miss was staged already."""

    def __init__(self, layer_idx: int, host: HostExperts, pool: SlotPool, slots: list[int], copier: SlotCopier,
                 eviction: str = "lru", on_routed=None):
        super().__init__(layer_idx, host, pool, slots)
        self.cache = ExpertCache(self.num_experts, self.num_slots, eviction)
        self.copier = copier
        self.on_routed = on_routed      # callable(layer, needed experts, pending rows) -> prefetches (ExpertOffload)
        self.pending_rows = None        # callable() -> list of [E] device tensors to read with the routing
        self.staging = None             # policy.StagedPrefetch (staged guesses) or None
        self.events: list[tuple] | None = None   # optional trace for tests: ("load"|"prefetch"|"compute", ...)
        self.split = None               # cpu_split.CpuSplit: decode misses computed part on the CPU, or None

    @classmethod
    def standalone(cls, layer_idx: int, w_gate_up, w_down, num_slots: int, device: torch.device,
                   copier: SlotCopier | None = None, eviction: str = "lru", host_format: str = "native"):
        """One layer on its own pool (tests): host copies of the given weights, num_slots slots + trash."""
        host = HostExperts.from_weights(w_gate_up, w_down, host_format)
        pool = SlotPool(host, num_slots + 1, device)
        return cls(layer_idx, host, pool, list(range(num_slots)), copier or SlotCopier(device), eviction)

    def _load(self, expert: int, level: int, prefetch: bool) -> bool:
        """Make `expert` resident (copy issued); False if no slot may be taken at `level`."""
        admitted = self.cache.admit(expert, level, prefetch=prefetch)
        if admitted is None:
            return False
        slot = admitted[0]
        staged = self.staging.take(self.layer_idx, expert) if (self.staging is not None and not prefetch) else None
        if staged is not None:          # a staged guess: its slot joins the layer, the evicted one becomes staging
            index, done = staged
            self.staging.release(self.slot_pool[slot])
            self.slot_pool[slot] = index
            if done < self.copier.chunks:
                self.copier.copy(self.host, expert, self.pool, index, range(done, self.copier.chunks), new=False)
            self.cache.counters.staged_hits += 1
        else:
            self.copier.copy(self.host, expert, self.pool, self.slot_pool[slot])
        if self.events is not None:
            self.events.append(("prefetch" if prefetch else "staged" if staged else "load", self.layer_idx,
                                expert, self.slot_pool[slot]))
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
        pending = self.pending_rows() if self.pending_rows is not None else []
        counts = torch.stack([routed] + pending).tolist()        # the block's one host sync
        needed = [e for e in range(num_experts) if counts[0][e] > 0]
        cache = self.cache
        resident = [e for e in needed if cache.record_need(e)]
        missing = [e for e in needed if e not in resident]
        split = [] if self.split is None else self.split.choose(missing, counts[0], cache.expert_in_slot.count(-1))
        if split:                       # not admitted: computed part on the CPU, part from a copy (cpu_split.py)
            cache.counters.split_misses += len(split)
            missing = [e for e in missing if e not in split]
        slotted = resident + missing
        groups = [[e for e in needed if e not in split]] if len(slotted) <= self.num_slots else \
            [slotted[i:i + self.num_slots] for i in range(0, len(slotted), self.num_slots)]
        for expert in groups[0]:
            cache.protect(expert, NEEDED)
        staged = self.staging is not None and self.staging.engaged()
        if staged:
            self.staging.mark_decision(self.layer_idx)          # before the misses: did guesses overrun?
        for expert in groups[0]:
            if not cache.is_resident(expert):
                self._load(expert, NEEDED, prefetch=False)      # a miss: the block waits for this copy
        if split:                       # CPU halves to the worker, then the device halves' copies (after the misses)
            split_job = self.split.start(self.host, split, hidden, flat_ids.tolist(), topk_ids.shape[1])
            if self.events is not None:
                self.events.append(("split", self.layer_idx, tuple(split)))
        if self.on_routed is not None and self.staging is None:
            self.on_routed(self.layer_idx, needed, counts[1:], bool(missing or split))   # guesses, after our misses
        compute = SlotExpertCompute(hidden, topk_ids, topk_weights, num_experts, self.host.down.shape[2],
                                    [int(c) for c in counts[0]], weights=self.pool.weights())
        for index, group in enumerate(groups):
            if index > 0:                                       # more experts than slots: next group
                for expert in groups[index - 1]:
                    cache.protection[expert] = UNPROTECTED
                for expert in group:
                    cache.protect(expert, NEEDED)
                for expert in group:
                    if not cache.is_resident(expert):
                        self._load(expert, NEEDED, prefetch=False)
            if group:
                self._compute(compute, group, None if len(groups) == 1 and not split else group)
        if split:
            self.split.finish(split_job, hidden, compute)
        out = compute.result()                                  # [T, H], bit-identical to LocalExperts
        if self.on_routed is not None and staged:
            # staged guesses after the compute launch: their host time overlaps the GPU's, not the launch's
            self.on_routed(self.layer_idx, needed, counts[1:], bool(missing or split))
        cache.end_step()
        return out

    def _compute(self, compute: SlotExpertCompute, group: list[int], experts: list[int] | None) -> None:
        """One pass over the slot-resident experts of `group` (experts None: all of the step's rows)."""
        indices = [self.slot_pool[self.cache.slot_of_expert[e]] for e in group]
        self.copier.wait_for(indices)
        for expert in group:
            self.cache.use(expert)
        if self.events is not None:
            self.events.append(("compute", self.layer_idx, tuple(group), tuple(indices)))
        compute.add(*self.pool.weights(), self.cache.slot_of_expert, self.slot_pool, experts)
        self.copier.mark_computed(indices)

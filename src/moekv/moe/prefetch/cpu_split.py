"""CPU-split misses: part of a missed expert computed on the CPU while the rest is copied (issue 24).

A missed expert at decode has few tokens. Its intermediate dimension I is split at c = floor(f * I):
the CPU computes channels [0, c) from the host copy it already has,

    h = silu(x W_gate[:c]^T) * (x W_up[:c]^T)          y_cpu = h W_down[:, :c]^T

while only channels [c, I) -- those rows of gate and up and those columns of down, (1 - f) of the bytes --
are copied to the device and computed there (y_dev). The expert's output is y_cpu + y_dev, summed in fp32
and written into the block's per-(token, choice) buffer (compute.SlotExpertCompute.put), so the routing
weights are applied by the same weighted sum as for every other expert. Both halves read disjoint weights.

    split_expert_reference(x, w_gate_up, w_down, fraction)   the pure-PyTorch twin, any device, one thread
    split_expert(x, w_gate_up, w_down, fraction, device)      the same through CpuSplit (worker thread + copy)
    CpuSplit                                                  what offload.OffloadedExperts uses per miss

Placement (CpuSplit): the CPU half runs on one worker thread (torch's CPU kernels release the GIL, so it
overlaps the copy stream and the GPU); `threads` sets torch.set_num_threads inside that worker (None: torch's
default). The device half goes through a ring of `2 * top_k` part buffers ([2(I - c), H] and [H, I - c],
outside expert_cache_size; at most that many split misses per block, the others are copied whole), copied on
the copier's side stream and ordered by its events like a pool slot.
A split miss does **not** make the expert resident (no slot, no eviction): the next step that routes to it
misses again. That is the simpler correct choice -- a partial copy can never be read as a whole expert -- and
its cost is that a hot expert keeps being split instead of cached. So a miss is split only when the layer has
no empty slot left: the cache first fills with whole copies, then changes only through misses that are not
split (more than SPLIT_MAX_TOKENS rows, a prefill) and prefetches.

Host layout: gate and up's rows [c, I) are contiguous row ranges of the host gate_up plane, but down's
columns [c, I) are strided, and a strided pinned source would make torch stage the copy through pageable
memory. CpuSplit therefore keeps, per layer, a pinned copy of down's columns [c, I) ([E, H, I - c]): extra host
memory of (1 - f) / 3 of the 16-bit host experts. 16-bit (native) host experts only: FP8 host copies are not
split (offload_config refuses the combination).
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from moekv.errors import ConfigError
from moekv.moe.prefetch.offload import SlotCopier
from moekv.moe.prefetch.pool import HostExperts, to_host

SPLIT_MAX_TOKENS = 4        # a miss is split only when at most this many (token, choice) rows route to it


def split_channels(inter: int, fraction: float) -> int:
    """The CPU's intermediate channels [0, c) of I: c = floor(fraction * I)."""
    return int(fraction * inter)


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert, unsplit: x [n, H], w_gate_up [2I, H] (gate rows first), w_down [H, I] -> [n, H] in x's dtype."""
    inter = w_down.shape[1]
    gate_up = F.linear(x, w_gate_up)
    return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down)


def cpu_part(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, channels: int) -> torch.Tensor:
    """Channels [0, channels) of one expert from its full weights -> [n, H] fp32 (its share of the output)."""
    inter = w_down.shape[1]
    gate = F.linear(x, w_gate_up[:channels])
    up = F.linear(x, w_gate_up[inter:inter + channels])
    return F.linear(F.silu(gate) * up, w_down[:, :channels]).float()


def device_part(x: torch.Tensor, part_gate_up: torch.Tensor, part_down: torch.Tensor) -> torch.Tensor:
    """The copied channels: part_gate_up [2R, H] (gate rows then up rows), part_down [H, R] -> [n, H] fp32."""
    return expert_mlp(x, part_gate_up, part_down).float()


def part_rows(inter: int, channels: int) -> tuple[slice, slice]:
    """The rows of gate_up [2I, H] that the device half needs: gate [c, I) and up [I + c, 2I)."""
    return slice(channels, inter), slice(inter + channels, 2 * inter)


def split_expert_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                           fraction: float) -> torch.Tensor:
    """The split computation in plain PyTorch on x's device: cpu_part + device_part -> [n, H] in x's dtype."""
    inter = w_down.shape[1]
    channels = split_channels(inter, fraction)
    gate, up = part_rows(inter, channels)
    part = torch.cat([w_gate_up[gate], w_gate_up[up]])
    return (cpu_part(x, w_gate_up, w_down, channels) + device_part(x, part, w_down[:, channels:])).to(x.dtype)


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)      # the worker's own intra-op threads (OpenMP: per calling thread)


class CpuSplit:
    """Split misses of every offloaded layer: the CPU worker, the device part buffers, the down tails."""

    def __init__(self, fraction: float, template, device: torch.device, copier, top_k: int,
                 threads: int | None = None, buffers: int | None = None):
        """template: a HostExperts with the layers' layout (16-bit); copier: offload.SlotCopier."""
        if template.fp8:
            raise ConfigError("cpu_compute_fraction splits 16-bit host experts only; host_format='fp8' (or an FP8 "
                              "model) is not split")
        if not 0.0 <= fraction < 1.0:
            raise ConfigError(f"cpu_compute_fraction must be in [0, 1), got {fraction!r}")
        self.fraction = fraction
        self.device = torch.device(device)
        self.copier = copier
        num_experts, hidden_size, inter = template.down.shape
        self.inter = inter
        self.channels = split_channels(inter, fraction)
        rest = inter - self.channels
        count = buffers or 2 * top_k
        dtype = template.dtype
        self.gate_up = torch.zeros((count, 2 * rest, hidden_size), dtype=dtype, device=self.device)
        self.down = torch.zeros((count, hidden_size, rest), dtype=dtype, device=self.device)
        self._next = 0
        self._tails: dict[int, torch.Tensor] = {}       # id(host.down) -> pinned down[:, :, c:] [E, H, R]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="moekv-cpu-split", initializer=_set_threads,
                                       initargs=(threads,))
        weakref.finalize(self, self.pool.shutdown, wait=False)
        self.experts = 0                # split misses
        self.cpu_seconds = 0.0          # the worker's time on CPU halves
        self.wait_seconds = 0.0         # the block's host time waiting for CPU halves (on the critical path)

    def tail(self, host) -> torch.Tensor:
        """The pinned, contiguous copy of host.down's columns [c, I) (made once per host copy)."""
        key = id(host.down)
        if key not in self._tails:
            self._tails[key] = to_host(host.down[:, :, self.channels:].contiguous())
        return self._tails[key]

    def part_bytes(self) -> int:
        return self.gate_up[0].nbytes + self.down[0].nbytes

    # -- one block's split misses ---------------------------------------------------------------------
    def choose(self, missing: list[int], counts: list[float], free_slots: int = 0) -> list[int]:
        """The misses to split: those with at most SPLIT_MAX_TOKENS rows routed to them (decode), at most one
        per part buffer (a buffer is not reused within a block); the others are copied whole, and so are the
        first of them while the layer has empty slots (`free_slots`, after the unsplittable misses took theirs):
        a miss that evicts nothing fills the cache instead."""
        few = [e for e in missing if counts[e] <= SPLIT_MAX_TOKENS]
        free = max(0, free_slots - (len(missing) - len(few)))
        return few[free:][:self.gate_up.shape[0]]

    def start(self, host, experts: list[int], hidden: torch.Tensor, flat_ids: list[int], top_k: int) -> dict:
        """Submit the CPU halves of `experts` (one worker job) and issue their device halves' copies.
        flat_ids: the step's topk_ids flattened, on the host. Returns the job for finish()."""
        rows = {e: [i for i, x in enumerate(flat_ids) if x == e] for e in experts}
        order = [i // top_k for e in experts for i in rows[e]]            # the split experts' token rows, in turn
        hidden_host = hidden.detach().index_select(0, torch.tensor(order, device=hidden.device)).to("cpu")
        future = self.pool.submit(self._cpu_halves, host, experts, hidden_host, [len(rows[e]) for e in experts])
        tail = self.tail(host)
        gate, up = part_rows(self.inter, self.channels)
        rest = self.inter - self.channels
        buffers = {}
        for expert in experts:
            index = self._next
            self._next = (self._next + 1) % self.gate_up.shape[0]
            src = host.gate_up[expert]
            pieces = [(src[gate], self.gate_up[index][:rest]), (src[up], self.gate_up[index][rest:]),
                      (tail[expert], self.down[index])]
            self.copier.copy_pieces(pieces, ("split", index))
            buffers[expert] = index
        self.experts += len(experts)
        return {"future": future, "rows": rows, "buffers": buffers, "top_k": top_k}

    def _cpu_halves(self, host, experts, hidden_host, sizes) -> dict[int, torch.Tensor]:
        began = time.perf_counter()
        with torch.inference_mode():
            out = {e: cpu_part(x, host.gate_up[e], host.down[e], self.channels)
                   for e, x in zip(experts, hidden_host.split(sizes))}
        self.cpu_seconds += time.perf_counter() - began
        return out

    def finish(self, job: dict, hidden: torch.Tensor, compute) -> None:
        """Launch the device halves, wait for the CPU halves, put y_cpu + y_dev into `compute`'s rows."""
        outputs = {}
        for expert, index in job["buffers"].items():
            key = ("split", index)
            self.copier.wait_for([key])
            tokens = torch.tensor([i // job["top_k"] for i in job["rows"][expert]], device=hidden.device)
            outputs[expert] = device_part(hidden.index_select(0, tokens), self.gate_up[index], self.down[index])
            self.copier.mark_computed([key])
        began = time.perf_counter()
        halves = job["future"].result()
        self.wait_seconds += time.perf_counter() - began
        for expert, y_dev in outputs.items():
            y_cpu = halves[expert].to(hidden.device, non_blocking=False)
            compute.put(expert, job["rows"][expert], y_dev + y_cpu)

    def stats(self) -> dict:
        return {"fraction": self.fraction, "cpu_channels": self.channels, "inter": self.inter,
                "split_experts": self.experts, "part_bytes": self.part_bytes(),
                "cpu_ms": 1e3 * self.cpu_seconds, "wait_ms": 1e3 * self.wait_seconds}

    def reset_counters(self) -> None:
        self.experts = 0
        self.cpu_seconds = self.wait_seconds = 0.0


def split_expert(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, fraction: float,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """split_expert_reference's signature through CpuSplit (tests, benchmarks): the CPU half on the worker
    thread from host copies, the device half copied to `device` (default x's) -> [n, H] in x's dtype."""
    device = torch.device(device) if device is not None else x.device
    host = HostExperts.from_weights(w_gate_up.unsqueeze(0), w_down.unsqueeze(0))
    split = CpuSplit(fraction, host, device, SlotCopier(device), top_k=1, buffers=1)
    rows = list(range(x.shape[0]))

    class _Rows:                                     # the one-expert stand-in for SlotExpertCompute.put
        out = None

        def put(self, expert, rows, values):
            self.out = values

    sink = _Rows()
    x = x.to(device)
    job = split.start(host, [0], x, [0] * len(rows), 1)
    split.finish(job, x, sink)
    return sink.out.to(x.dtype)

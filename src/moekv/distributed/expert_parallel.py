"""Expert-parallel experts: the `Experts` implementation that holds this rank's slots of a MoE layer.

Applied after the model is built (distributed.sharding swaps it into every `MoEBlock.experts`),
so the model code stays single-device. Per layer:

    router (local) -> physical_ids (pick a replica per token-slot) -> TokenExchange (dispatch,
    local experts through ops.dispatch.moe_experts, combine) -> + shared expert (local)

`ExpertParallelRuntime` is the state the MoE layers of one model share on one rank: the process
groups, the dispatch choice, this step's per-rank token counts (one control collective per step,
see distributed.lockstep) and the communication timer. Every MoE layer is a collective call:
all ranks run the same layers in the same order each step, a rank without tokens with 0 rows.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from moekv.distributed.exchange import EXCHANGES, TokenExchange, all_gather
from moekv.distributed.failure import check_healthy
from moekv.distributed.groups import ExpertParallelGroup
from moekv.distributed.placement import ExpertPlacement
from moekv.layers.linear import empty_parameter
from moekv.moe.experts import Experts
from moekv.ops import dispatch

DISPATCH_MODES = ("auto", "all_to_all", "allgather")
# auto's switch point per backend when the config leaves it open (allgather while no rank has more
# tokens than this). gloo: all_to_all was as fast or faster at every size from 1 to 1024 tokens per
# rank (benchmarks/results/expert-parallel-sweep-cpu-tiny-h*.md), so never. nccl: provisional until
# the 2-GPU sweep (benchmarks/bench_expert_parallel.py) places it; allgather has static shapes and
# no host sync, which is what small decode batches on GPUs need.
AUTO_ALLGATHER_MAX_TOKENS = {"gloo": 0, "nccl": 16}


class CommTimer:
    """Time spent inside dispatch/combine collectives (CUDA events on GPUs: no host sync until read)."""

    def __init__(self, device: torch.device, enabled: bool = False):
        self.device = device
        self.enabled = enabled
        self._cpu: Counter = Counter()
        self._events: list[tuple[str, object, object]] = []

    def time(self, name: str):
        return self._timed(name) if self.enabled else nullcontext()

    @contextmanager
    def _timed(self, name: str):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            began = time.perf_counter()
            yield
            self._cpu[name] += time.perf_counter() - began

    def read(self, reset: bool = True) -> dict[str, float]:
        """Seconds per collective kind since the last read (synchronises the device on CUDA)."""
        totals = Counter(self._cpu)
        if self._events:
            torch.cuda.synchronize(self.device)
            for name, start, end in self._events:
                totals[name] += start.elapsed_time(end) / 1000.0
        if reset:
            self._cpu.clear()
            self._events.clear()
        return dict(totals)


class ExpertParallelRuntime:
    """Shared by all expert-parallel MoE layers of a model on one rank; see the module docstring.

    dispatch: "all_to_all", "allgather", or "auto" (allgather when no rank has more than
    `allgather_max_tokens` tokens this step, else all_to_all; every rank decides from the same counts).
    """

    def __init__(self, group: ExpertParallelGroup, dispatch_mode: str = "auto", allgather_max_tokens: int | None = None,
                 num_redundant: int = 0, time_comm: bool = False):
        if dispatch_mode not in DISPATCH_MODES:
            raise ValueError(f"expert dispatch must be one of {DISPATCH_MODES}, got {dispatch_mode!r}")
        self.group = group
        self.dispatch_mode = dispatch_mode
        if allgather_max_tokens is None:
            allgather_max_tokens = AUTO_ALLGATHER_MAX_TOKENS.get(dist.get_backend(group.device_group), 0)
        self.allgather_max_tokens = allgather_max_tokens
        self.num_redundant = num_redundant
        self.exchanges: dict[str, TokenExchange] = {name: cls() for name, cls in EXCHANGES.items()}
        self.layers: list[ExpertParallelExperts] = []     # in forward order
        self.timer = CommTimer(group.device, time_comm)
        self.exchange_calls: Counter = Counter()           # layer calls per exchange kind
        self.step_token_counts: list[int] | None = None
        self._device_counts: tuple[list[int], torch.Tensor] | None = None
        self.layers_done = 0

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def register(self, layer: "ExpertParallelExperts") -> None:
        self.layers.append(layer)
        self.layers.sort(key=lambda m: m.layer_idx)

    # -- per-step control (cpu group) ------------------------------------------------------------
    def exchange_counts(self, num_tokens: int) -> list[int]:
        """Every rank's token count (a gloo all-gather of one integer per rank, CPU tensors)."""
        check_healthy()
        mine = torch.tensor([num_tokens], dtype=torch.int64)
        counts = torch.empty(self.world_size, dtype=torch.int64)
        all_gather(counts, mine, group=self.group.cpu_group)
        return counts.tolist()

    def begin_step(self, num_tokens: int) -> list[int]:
        """Agree on this step's per-rank token counts before the forward (one control collective)."""
        self.step_token_counts = self.exchange_counts(num_tokens)
        self.layers_done = 0
        if self.group.device.type == "cuda":         # copy now, while the stream is idle between steps
            self.device_token_counts(self.step_token_counts)
        return self.step_token_counts

    def end_step(self) -> None:
        self.step_token_counts = None

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank (a gloo all-reduce, CPU tensors)."""
        check_healthy()
        value = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group.cpu_group)
        return bool(value.item())

    def token_counts(self, num_tokens: int) -> list[int]:
        """This step's counts (begin_step), or a count exchange for a forward run outside a step."""
        if self.step_token_counts is not None:
            return self.step_token_counts
        return self.exchange_counts(num_tokens)

    def device_token_counts(self, token_counts: list[int]) -> torch.Tensor:
        """token_counts as an int64 tensor on the device, copied once per step (a host-to-device copy
        waits for the stream, so not once per layer)."""
        if self._device_counts is None or self._device_counts[0] is not token_counts:
            tensor = torch.tensor(token_counts, dtype=torch.int64).to(self.group.device, non_blocking=True)
            self._device_counts = (token_counts, tensor)
        return self._device_counts[1]

    def choose(self, token_counts: list[int]) -> TokenExchange:
        mode = self.dispatch_mode
        if mode == "auto":
            mode = "allgather" if max(token_counts) <= self.allgather_max_tokens else "all_to_all"
        return self.exchanges[mode]

    def join_remaining_layers(self) -> None:
        """Run the MoE collectives of this step's layers not yet run, with 0 tokens (an idle rank
        joins a step; a rank whose forward stopped early catches up so no other rank waits forever)."""
        for layer in self.layers[self.layers_done:]:
            layer.join_empty()


class ExpertParallelExperts(Experts):
    """This rank's slots of one MoE layer: w_gate_up [S_local, 2I, H], w_down [S_local, H, I].

    Placement tensors (buffers, on the weights' device): replica_table [E, R] physical ids of each
    expert's replicas (cycled to R = max replicas), replica_count [E], slot_rank [S] and slot_local [S]
    (rank and local slot index of each physical id).
    """

    def __init__(self, runtime: ExpertParallelRuntime, placement: ExpertPlacement, layer_idx: int,
                 hidden_size: int, intermediate_size: int, top_k: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.runtime = runtime
        self.num_experts = placement.num_experts
        self.layer_idx = layer_idx
        self.hidden_size = hidden_size
        self.top_k = top_k
        num_local = placement.slots_per_rank[runtime.rank]
        self.w_gate_up = empty_parameter(num_local, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.w_down = empty_parameter(num_local, hidden_size, intermediate_size, dtype=dtype, device=device)
        self.set_placement(placement)

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Logical expert of each local slot."""
        return self.placement.rank_experts[self.runtime.rank]

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Adopt a placement with the same slot counts (the weights must already match it)."""
        if placement.slots_per_rank[self.runtime.rank] != self.w_gate_up.shape[0]:
            raise ValueError(f"layer {self.layer_idx}: placement gives rank {self.runtime.rank} "
                             f"{placement.slots_per_rank[self.runtime.rank]} slots, it holds {self.w_gate_up.shape[0]}")
        device = self.w_gate_up.device
        self.placement = placement
        counts = placement.replica_counts
        width = max(counts)
        table = []
        for expert in range(placement.num_experts):
            replicas = placement.replicas(expert)
            table.append([replicas[i % len(replicas)] for i in range(width)])
        local = [s for slots in placement.rank_experts for s in range(len(slots))]

        def buffer(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.register_buffer("replica_table", buffer(table), persistent=False)       # [E, R]
        self.register_buffer("replica_count", buffer(list(counts)), persistent=False)  # [E]
        self.register_buffer("slot_rank", buffer(list(placement.slot_ranks)), persistent=False)  # [S]
        self.register_buffer("slot_local", buffer(local), persistent=False)           # [S]

    def physical_ids(self, topk_ids: torch.Tensor, token_index, source_rank) -> torch.Tensor:
        """topk_ids [T, k]; token_index and source_rank (ints or [T, 1]) -> physical ids [T, k].

        Token t of rank s uses replica (t + s) % replica_count of its expert: an expert's tokens
        split evenly over its replicas, and every rank computes the same choice for a token.
        """
        pick = (token_index + source_rank) % self.replica_count[topk_ids]          # [T, k]
        return self.replica_table[topk_ids, pick]                                 # [T, k]

    def compute(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """rows [R, H], local slot of each row [R] -> unweighted expert outputs [R, H] (model dtype)."""
        if rows.shape[0] == 0:
            return rows.new_empty(0, rows.shape[1])
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)           # [R, 1]
        return dispatch.moe_experts(rows, self.w_gate_up, self.w_down, local_ids.unsqueeze(1), ones)

    def forward(self, hidden, topk_ids, topk_weights):
        runtime = self.runtime
        counts = runtime.token_counts(hidden.shape[0])
        exchange = runtime.choose(counts)
        runtime.exchange_calls[exchange.name] += 1
        runtime.layers_done = runtime.layers.index(self) + 1
        return exchange(self, hidden, topk_ids, topk_weights, counts)               # [T, H]

    def join_empty(self) -> None:
        """This layer's collectives with 0 tokens from this rank."""
        device = self.w_gate_up.device
        hidden = torch.zeros(0, self.hidden_size, dtype=self.w_gate_up.dtype, device=device)
        ids = torch.zeros(0, self.top_k, dtype=torch.int64, device=device)
        self.forward(hidden, ids, torch.zeros(0, self.top_k, dtype=torch.float32, device=device))

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, local_experts={list(self.local_experts)}"

"""Expert-parallel experts: the `Experts` implementation that holds this rank's slots of a MoE layer.

Applied after the model is built (distributed.sharding swaps it into every `MoEBlock.experts`),
so the model code stays single-device. Per layer:

    router (local) -> physical_ids (pick a replica per token-slot) -> TokenExchange (dispatch,
    local experts through ops.dispatch.moe_experts, combine) -> + shared expert (local)

`ExpertParallelRuntime` is the state the MoE layers of one model share on one rank: the process
groups, the dispatch choice, this step's per-rank token counts (one control collective per step,
see engine.lockstep) and the communication timer. Every MoE layer is a collective call:
all ranks run the same layers in the same order each step, a rank without tokens with 0 rows.

CUDA-graph decode steps: the runtime is the model runner's `step_coordinator`
(engine.cuda_graphs.StepCoordinator). With each step's token counts every rank also sends the
batch its runner could replay (`graph_batch`); when every rank's step is decode-only (or empty) and
the largest batch is within the all-gather range, all ranks run the same bucket (`graph_bucket`,
`agree_graph_bucket`), a rank without sequences with padding rows only. Inside such a step's
forward (`static_forward`) the experts always use the all-gather exchange with the bucket size as
every rank's static row count and the bucket's token-valid mask to drop padding rows: no host read,
so the collectives are captured in each bucket's graph. Other steps stay eager as before.
"""

from __future__ import annotations

import math
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
from moekv.layers.experts import Experts, StackedExpertWeights
from moekv.ops import dispatch

DISPATCH_MODES = ("auto", "all_to_all", "allgather")
# auto's switch point per backend when the config leaves it open (allgather while no rank has more
# tokens than this). gloo: all_to_all was as fast or faster at every size from 1 to 1024 tokens per
# rank (benchmarks/results/expert-parallel-sweep-cpu-tiny-h*.md), so never. nccl: provisional until
# the 2-GPU sweep (benchmarks/bench_expert_parallel.py) places it; allgather has static shapes and
# no host sync, which is what small decode batches on GPUs need.
AUTO_ALLGATHER_MAX_TOKENS = {"gloo": 0, "nccl": 16}
# ... when decode steps replay CUDA graphs: a graph step needs the all-gather exchange (static shapes),
# and an eager step pays ~1 ms of launch overhead per MoE layer (Mixtral, H200) against ~0.3 ms in the
# collectives, so graph steps win long before all_to_all's smaller transfers do. 64 covers the
# 128 x 16k run on 2 GPUs (64 sequences per rank); provisional until a GPU run measures larger buckets.
AUTO_ALLGATHER_MAX_TOKENS_GRAPHS = {"gloo": 0, "nccl": 64}
# The all-gather exchange's routing table has 2 * E * M + 1 entries (M: the lcm of a layer's replica counts;
# see ExpertParallelExperts.routing_table); past this many it carries physical ids instead (2 * S + 1).
MAX_PICK_TABLE = 1 << 16


def agree_graph_bucket(counts: list[int], batches: list[int], buckets: list[int], limits: list[int],
                       last_buckets: list[int] | None = None) -> int | None:
    """The bucket every rank replays this step, or None (an eager step), from the values all ranks share.

    counts[r]: rank r's tokens; batches[r]: the rows its runner could replay (ModelRunner.graph_batch: the
    decode batch, 0 for no sequences, -1 when its step must be eager); buckets: the runners' buckets;
    limits[r]: the largest per-rank batch rank r lets a graph step have (ExpertParallelRuntime.graph_limit,
    0: none), which differs between ranks only if their configs do: then no step is a graph step.
    last_buckets[r]: rank r's largest bucket (its max_num_seqs): ranks with equal limits but different
    bucket lists (max_num_seqs 48 vs 100) would pick different buckets for the same batch, so unequal
    values also make every step eager.
    """
    if not buckets or min(limits) <= 0 or len(set(limits)) > 1 or max(counts, default=0) == 0 or min(batches) < 0:
        return None
    if last_buckets is not None and len(set(last_buckets)) > 1:
        return None
    top = max(batches)
    if top > min(limits[0], buckets[-1]):
        return None
    return next(b for b in buckets if b >= top)


class CommTimer:
    """Time spent inside dispatch/combine collectives (CUDA events on GPUs: no host sync until read)."""

    def __init__(self, device: torch.device, enabled: bool = False):
        self.device = device
        self.enabled = enabled
        self.paused = False              # inside a graph step's forward: events cannot be captured
        self._cpu: Counter = Counter()
        self._events: list[tuple[str, object, object]] = []

    def time(self, name: str):
        return self._timed(name) if self.enabled and not self.paused else nullcontext()

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
        self.backend = dist.get_backend(group.device_group)
        self.allgather_max_tokens_config = allgather_max_tokens        # None: the backend's default
        if allgather_max_tokens is None:
            allgather_max_tokens = AUTO_ALLGATHER_MAX_TOKENS.get(self.backend, 0)
        self.allgather_max_tokens = allgather_max_tokens
        self.num_redundant = num_redundant
        self.exchanges: dict[str, TokenExchange] = {name: cls() for name, cls in EXCHANGES.items()}
        self.layers: list[ExpertParallelExperts] = []     # in forward order
        self.timer = CommTimer(group.device, time_comm)
        self.exchange_calls: Counter = Counter()           # layer calls per exchange kind
        self.step_token_counts: list[int] | None = None
        self.layers_done = 0
        # CUDA-graph steps (see the module docstring)
        self.graph_buckets: list[int] = []     # the runner's buckets while its graph path is on
        self.graph_bucket: int | None = None    # this step's agreed bucket (None: an eager step)
        self.static_valid: torch.Tensor | None = None   # inside a graph step's forward: token_valid [Bb] int64
        self.static_step_cache: dict | None = None      # ... tensors its layers share (AllGatherExchange)
        self.step_kinds: Counter = Counter()    # steps with tokens on some rank: "graph" / "eager"

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

    def begin_step(self, num_tokens: int, graph_batch: int | None = None) -> list[int]:
        """Agree on this step's per-rank token counts before the forward (one control collective), and on
        whether it is a graph step: graph_batch is ModelRunner.graph_batch of this rank's step (None: eager)."""
        check_healthy()
        mine = torch.tensor([num_tokens, -1 if graph_batch is None else graph_batch, self.graph_limit(),
                             self.graph_buckets[-1] if self.graph_buckets else 0], dtype=torch.int64)
        rows = torch.empty(4 * self.world_size, dtype=torch.int64)
        all_gather(rows, mine, group=self.group.cpu_group)
        values = rows.tolist()
        self.step_token_counts = values[0::4]
        self.graph_bucket = agree_graph_bucket(self.step_token_counts, values[1::4], self.graph_buckets,
                                               values[2::4], values[3::4])
        self.layers_done = 0
        if any(self.step_token_counts):
            self.step_kinds["graph" if self.graph_bucket is not None else "eager"] += 1
        return self.step_token_counts

    def end_step(self) -> None:
        self.step_token_counts = None
        self.graph_bucket = None

    # -- CUDA-graph steps (engine.cuda_graphs.StepCoordinator) -------------------------------------
    def graph_limit(self) -> int:
        """The largest per-rank batch a graph step may have (0: none): its exchange must be the all-gather,
        and its bucket one of the runner's (the last bucket is max_num_seqs, which every rank must share)."""
        if not self.graph_buckets or self.dispatch_mode == "all_to_all":
            return 0
        if self.dispatch_mode == "allgather":
            return self.graph_buckets[-1]
        return max(0, min(self.graph_buckets[-1], self.allgather_max_tokens))

    def graph_ineligibility(self) -> str | None:
        if self.dispatch_mode == "all_to_all":
            return "expert dispatch all_to_all waits on the host for its split sizes"
        if self.dispatch_mode == "auto" and self.allgather_max_tokens_config is not None \
                and self.allgather_max_tokens_config < 1:
            return "allgather_max_tokens < 1: auto dispatch never uses the all-gather exchange graphs need"
        return None

    def configure_graphs(self, buckets: list[int], capture: bool) -> None:
        """The runner's graph path is on with these buckets ([]: off). Captured graphs raise auto's default
        switch point (AUTO_ALLGATHER_MAX_TOKENS_GRAPHS) unless the config set one."""
        self.graph_buckets = list(buckets)
        if self.allgather_max_tokens_config is None:
            table = AUTO_ALLGATHER_MAX_TOKENS_GRAPHS if buckets and capture else AUTO_ALLGATHER_MAX_TOKENS
            self.allgather_max_tokens = table.get(self.backend, 0)

    @contextmanager
    def static_forward(self, meta):
        """Around a graph step's forward (replayed or run eagerly on the bucket's buffers): the experts take
        the static all-gather path with meta.token_valid as the row mask; no timing events."""
        self.static_valid = meta.token_valid
        self.static_step_cache = {}       # per forward: computed inside it (so a capture records it) once
        self.timer.paused = True
        try:
            yield
        finally:
            self.static_valid = None
            self.static_step_cache = None
            self.timer.paused = False

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

    def choose(self, token_counts: list[int]) -> TokenExchange:
        mode = self.dispatch_mode
        if mode == "auto":
            mode = "allgather" if max(token_counts) <= self.allgather_max_tokens else "all_to_all"
        return self.exchanges[mode]

    def join_remaining_layers(self) -> None:
        """Run the MoE collectives of this step's layers not yet run, with 0 tokens (an idle rank
        joins a step; a rank whose forward stopped early catches up so no other rank waits forever).
        Not in a graph step: its forward is one unit (an idle rank replays the bucket instead)."""
        if self.graph_bucket is not None:
            return
        for layer in self.layers[self.layers_done:]:
            layer.join_empty()


class ExpertParallelExperts(StackedExpertWeights, Experts):
    """This rank's slots of one MoE layer: w_gate_up [S_local, 2I, H], w_down [S_local, H, I], 16-bit or FP8
    (StackedExpertWeights.to_fp8: codes and block scales, the kernels read them as W8A16). `dtype` is the
    model's activation dtype.

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
        self.act_dtype = dtype
        num_local = placement.slots_per_rank[runtime.rank]
        self.w_gate_up = empty_parameter(num_local, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.w_down = empty_parameter(num_local, hidden_size, intermediate_size, dtype=dtype, device=device)
        self.w_gate_up_scale = self.w_down_scale = None
        self.weight_blocks = None
        self.set_placement(placement)

    @property
    def step_coordinator(self) -> ExpertParallelRuntime:
        """The model runner agrees each step's graph bucket with the other ranks through the runtime."""
        return self.runtime

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
        self._routing = None               # routing_table(), rebuilt from these buffers on next use

    def routing_table(self) -> tuple[torch.Tensor, int, int]:
        """(table, M, span): how the all-gather exchange maps a routing code to this rank's local slot.

        M > 0: a token-slot (token t of rank s, expert e) has code 1 + e * M + (t + s) % M, M the lcm of the
        replica counts, so (t + s) % M % count[e] is physical_ids' pick; M = 0 (the table would exceed
        MAX_PICK_TABLE): code 1 + its physical id. span (E * M, or S): padding rows add it. table
        [2 * span + 1] int64: entry 0 is 0 (the exchange's floor column), then per code the local slot of
        its replica if this rank holds it, else -1; every padding code -1. Built with device ops from the
        placement buffers (no host read) on first use after each placement or device change.
        """
        if self._routing is not None and self._routing[0] is self.replica_table:
            return self._routing[1]
        period = math.lcm(*self.placement.replica_counts)
        rank = self.runtime.rank
        own = torch.where(self.slot_rank == rank, self.slot_local, -1)                  # [S] local slot or -1
        if self.num_experts * period <= MAX_PICK_TABLE:
            picks = torch.arange(period, device=own.device) % self.replica_count.unsqueeze(1)   # [E, M]
            codes = own[self.replica_table.gather(1, picks)].reshape(-1)                # [E * M]
        else:
            codes, period = own, 0                                                      # [S]
        span = codes.shape[0]
        table = torch.cat([codes.new_zeros(1), codes, codes.new_full((span,), -1)])     # [2 * span + 1]
        self._routing = (self.replica_table, (table, period, span))
        return self._routing[1]

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
        return dispatch.moe_experts(rows, *self.weights(), local_ids.unsqueeze(1), ones)

    def compute_weighted(self, rows: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows [R, H] (rows may be strided), local slots [R, k], weights [R, k] fp32 ->
        sum_j weights[r, j] * expert_j(rows[r]) [R, H] in fp32 (each expert output rounded as the
        single-device op rounds it, the sum not rounded: the caller adds the ranks' sums first)."""
        if rows.shape[0] == 0:
            return rows.new_empty(0, rows.shape[1], dtype=torch.float32)
        return dispatch.moe_experts(rows, *self.weights(), local_ids, weights, out_dtype=torch.float32)

    def forward(self, hidden, topk_ids, topk_weights):
        runtime = self.runtime
        runtime.layers_done = runtime.layers.index(self) + 1
        if runtime.static_valid is not None:        # a graph step: every rank has the bucket's rows
            exchange = runtime.exchanges["allgather"]
            runtime.exchange_calls[exchange.name] += 1
            return exchange(self, hidden, topk_ids, topk_weights, None, row_valid=runtime.static_valid)
        counts = runtime.token_counts(hidden.shape[0])
        exchange = runtime.choose(counts)
        runtime.exchange_calls[exchange.name] += 1
        return exchange(self, hidden, topk_ids, topk_weights, counts)               # [T, H]

    def join_empty(self) -> None:
        """This layer's collectives with 0 tokens from this rank."""
        device = self.w_gate_up.device
        hidden = torch.zeros(0, self.hidden_size, dtype=self.act_dtype, device=device)
        ids = torch.zeros(0, self.top_k, dtype=torch.int64, device=device)
        self.forward(hidden, ids, torch.zeros(0, self.top_k, dtype=torch.float32, device=device))

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, local_experts={list(self.local_experts)}"

"""Token dispatch and combine for expert-parallel MoE layers: one interface, two implementations.

Both send each routed token-slot (token t, choice j) to the one rank that computes it (the rank
of the replica `ExpertParallelExperts.physical_ids` picks), run the local experts there, and bring
the weighted sum back to the token's own rank:

- `AllToAllExchange`: variable-size `all_to_all_single` (per-slot counts first, then the token
  rows, then the expert outputs back). Moves only the rows a rank needs; one host sync per layer
  for the split sizes. The choice for large batches (prefill, big decode batches).
- `AllGatherExchange`: every rank all-gathers every rank's tokens and routing (one byte-packed
  gather, padded to the step's largest per-rank count), runs every gathered token through its local
  experts with the fused MoE op (the k choices mapped to local slots, the weights of choices owned
  elsewhere zeroed: they add an exact 0), and a reduce-scatter (fp32 sum) hands each rank its tokens'
  results. Static shapes, two collectives, no count exchange and no host sync: meant for small decode
  batches (the extra compute grows with the world size). Padding rows (past a rank's count, or a
  CUDA-graph bucket's padding rows given by `row_valid`) carry codes that route nowhere; in a graph step
  every rank gathers the bucket's rows through per-bucket buffers, a few kernels per layer.

Numerics match the single-device reference bit for bit for top-2 routing: each expert output is
rounded to the model dtype exactly as there (all_to_all: per row; allgather: the same MoE op computes
it, with its fp32 weighted sum returned unrounded), each token's share of the weighted sum stays fp32
until the combine adds the shares, and two products sum to the same bits in any order (for k > 2 the
order of the additions may differ, so the last bit may).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moekv.ops import dispatch

# newer torch names them *_single (the *_tensor spellings warn); older releases have only the latter.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def combine(slot_outputs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """slot_outputs [T*k, H] (row t*k + j: expert topk_ids[t, j] applied to token t) -> [T, H].

    sum_j topk_weights[t, j] * slot_outputs[t*k + j] in fp32, in ascending expert order per token
    (the order ops.reference.moe accumulates in), cast to slot_outputs' dtype.
    """
    num_tokens, top_k = topk_ids.shape
    order = torch.argsort(topk_ids.reshape(-1), stable=True)                    # [T*k] slots by expert
    weights = topk_weights.reshape(-1).float().index_select(0, order)           # [T*k]
    weighted = slot_outputs.index_select(0, order).float() * weights.unsqueeze(-1)   # [T*k, H] fp32
    out = torch.zeros(num_tokens, slot_outputs.shape[1], dtype=torch.float32, device=slot_outputs.device)
    out.index_add_(0, order // top_k, weighted)                                 # [T, H]
    return out.to(slot_outputs.dtype)


class ExchangeExperts(Protocol):
    """What an exchange needs of one MoE layer's expert-parallel experts (distributed.expert_parallel's
    ExpertParallelExperts implements it; the exchange does not import it, so the two files form no cycle)."""

    runtime: Any                    # ExpertParallelRuntime: rank, world size, groups
    placement: Any                  # ExpertPlacement of this layer
    slot_rank: torch.Tensor         # [slots] rank of each global slot
    w_gate_up: torch.Tensor         # [local slots, 2I, H]: this rank's experts

    def physical_ids(self, topk_ids: torch.Tensor, token_index, source_rank) -> torch.Tensor: ...
    def routing_table(self) -> tuple[torch.Tensor, int, int]: ...
    def compute(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor: ...
    def compute_weighted(self, rows: torch.Tensor, local_ids: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor: ...


class TokenExchange(ABC):
    """Dispatch -> local experts -> combine for one MoE layer on one rank (a collective call)."""

    name: str

    @abstractmethod
    def __call__(self, experts: ExchangeExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, token_counts: list[int] | None,
                 row_valid: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H] in hidden's dtype.

        token_counts[r] = T of rank r this step (the same list on every rank). row_valid [T] (a graph
        step, allgather only): every rank has T rows, those with row_valid 0 are padding; token_counts None.
        """


class AllToAllExchange(TokenExchange):
    name = "all_to_all"

    def __call__(self, experts, hidden, topk_ids, topk_weights, token_counts, row_valid=None):
        if row_valid is not None:
            raise ValueError("all_to_all has no static (graph) form: its split sizes are read on the host")
        runtime = experts.runtime
        group, rank, world = runtime.group.device_group, runtime.rank, runtime.world_size
        placement = experts.placement
        slots_per_rank = list(placement.slots_per_rank)
        local_slots = slots_per_rank[rank]
        num_tokens, top_k = topk_ids.shape
        hidden_size = hidden.shape[1]
        token_index = torch.arange(num_tokens, device=hidden.device).unsqueeze(1)          # [T, 1]
        physical = experts.physical_ids(topk_ids, token_index, rank).reshape(-1)          # [T*k]
        order = torch.argsort(physical, stable=True)                                       # [T*k] by rank, slot
        send_slot_counts = torch.zeros(placement.num_slots, dtype=torch.int64, device=hidden.device)
        send_slot_counts.index_add_(0, physical, torch.ones_like(physical))               # [S] (bincount syncs on CUDA)
        recv_slot_counts = torch.empty(world * local_slots, dtype=torch.int64, device=hidden.device)
        with runtime.timer.time("all_to_all"):
            dist.all_to_all_single(recv_slot_counts, send_slot_counts, [local_slots] * world, slots_per_rank,
                                   group=group)                                            # [W * S_local]
        send_rank_counts = torch.zeros(world, dtype=torch.int64, device=hidden.device)
        send_rank_counts.index_add_(0, experts.slot_rank, send_slot_counts)               # [W]
        recv_rank_counts = recv_slot_counts.view(world, local_slots).sum(dim=1)           # [W]
        sizes = torch.cat([send_rank_counts, recv_rank_counts]).tolist()                  # the host sync
        send_sizes, recv_sizes = sizes[:world], sizes[world:]
        send_rows = hidden.index_select(0, order // top_k)                                 # [T*k, H]
        recv_rows = hidden.new_empty(sum(recv_sizes), hidden_size)                         # [R, H]
        with runtime.timer.time("all_to_all"):
            dist.all_to_all_single(recv_rows, send_rows, recv_sizes, send_sizes, group=group)
        local_ids = torch.arange(local_slots, device=hidden.device).repeat(world)          # [W * S_local]
        local_ids = local_ids.repeat_interleave(recv_slot_counts, output_size=recv_rows.shape[0])   # [R] (no sync)
        out_rows = experts.compute(recv_rows, local_ids).contiguous()     # [R, H] (NCCL takes contiguous tensors only)
        returned = hidden.new_empty(num_tokens * top_k, hidden_size)                       # [T*k, H] in `order`
        with runtime.timer.time("all_to_all"):
            dist.all_to_all_single(returned, out_rows, send_sizes, recv_sizes, group=group)
        slot_outputs = torch.empty_like(returned).index_copy_(0, order, returned)          # [T*k, H] t-major
        return combine(slot_outputs, topk_ids, topk_weights)


class AllGatherExchange(TokenExchange):
    """All-gather dispatch, fused weighted sum on the local experts, fp32 reduce-scatter combine.

    Each gathered row is the token's hidden bytes, then k int64 routing codes and one more code, 0 (the
    floor, below), then its k fp32 routing weights. A code is 1 + expert * M + the replica pick
    ((t + s) % M, M the lcm of the layer's replica counts: the pick of ExpertParallelExperts.physical_ids),
    or 1 + the physical id when that table would be large, plus `span` on padding rows; the layer's
    routing table (ExpertParallelExperts.routing_table) maps it to the local slot on this rank, -1 for
    another rank's slot or a padding row, and code 0 to slot 0. On the receiving side:

        local = table[codes]                 one gather: [W*P, k + 1]
        reused = local.amax()                a slot this rank computes anyway (slot 0 if none: the floor)
        ids = where(local >= 0, local, reused), weights = where(local >= 0, weights, 0)
        partial = moe_experts(all_hidden, w_gate_up, w_down, ids, weights, out_dtype=fp32)   [W*P, H]

    so the fused MoE op does the weighted top-k sum per gathered token in fp32. Choices owned elsewhere
    have weight 0 and add an exact 0 (as long as the reused slot's output is finite, which any model whose
    expert outputs fit its dtype gives); they run on a slot whose weights are read anyway, so no extra
    expert is read unless this rank owns none of the step's choices. The reduce-scatter adds the ranks'
    fp32 partial sums: for top-2 the same two products summed once, as one device does. A row only ever
    feeds its own output row.

    Graph steps (row_valid given, every rank has the bucket's P rows) reuse per-bucket buffers (the packed
    rows, the gathered rows, their floor column written once) and per-step code offsets (computed by the
    first layer of each static forward), so a layer launches: 2 copies and the codes into the packed rows,
    the all-gather, one routing launch (ops.dispatch.ep_local_routing; five ops in the reference), the
    expert kernels, the reduce-scatter and the cast back (tests/distributed/test_exchange.py bounds it).
    """

    name = "allgather"

    def __init__(self):
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}   # graph buckets: (packed, gathered)
        self._zeros: dict[tuple, torch.Tensor] = {}                           # partial sums of a rank without slots
        self._consts: dict[tuple, torch.Tensor] = {}                          # per-token constants (_constant)
        self._retired: list[torch.Tensor] = []     # superseded constants that captured graphs may still read

    def _no_slots(self, rows: int, hidden_size: int, device, static: bool) -> torch.Tensor:
        """Zero partial sums [rows, H] fp32 (cached for graph steps: nothing writes them)."""
        key = (rows, hidden_size, device)
        if not static:
            return torch.zeros(rows, hidden_size, dtype=torch.float32, device=device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(rows, hidden_size, dtype=torch.float32, device=device)
        return self._zeros[key]

    @staticmethod
    def layout(hidden_size: int, dtype: torch.dtype, top_k: int) -> tuple[int, int, int, int]:
        """Bytes of a gathered row: (hidden bytes, codes offset, weights offset, row width), 16-byte aligned."""
        hidden_bytes = hidden_size * dtype.itemsize
        codes = -(-hidden_bytes // 16) * 16                   # k + 1 int64 codes (the last: the floor, 0)
        weights = codes + 8 * (top_k + 1)                     # k fp32 weights
        row = -(-(weights + 4 * top_k) // 16) * 16
        return hidden_bytes, codes, weights, row

    def _views(self, rows: torch.Tensor, hidden_size: int, dtype: torch.dtype, top_k: int):
        """(hidden [N, H], codes [N, k + 1] int64, weights [N, k] fp32): views of packed rows [N, B] uint8."""
        hidden_bytes, codes, weights, _ = self.layout(hidden_size, dtype, top_k)
        return (rows[:, :hidden_bytes].view(dtype), rows[:, codes:weights].view(torch.int64),
                rows[:, weights:weights + 4 * top_k].view(torch.float32))

    def _static_buffers(self, rows: int, world: int, hidden_size: int, dtype: torch.dtype, top_k: int, device):
        key = (rows, world, hidden_size, dtype, top_k, device)
        if key not in self._buffers:         # zeros: the floor column stays 0 (nothing writes it)
            width = self.layout(hidden_size, dtype, top_k)[3]
            self._buffers[key] = (torch.zeros(rows, width, dtype=torch.uint8, device=device),
                                  torch.zeros(world * rows, width, dtype=torch.uint8, device=device))
        return self._buffers[key]

    def _constant(self, key: tuple, rows: int, device, values) -> torch.Tensor:
        """values(arange(n)) for the first `rows` token indices, cached per key (grown as needed)."""
        cached = self._consts.get((key, device))
        if cached is None or cached.shape[0] < rows:
            size = max(rows, 64, 2 * (cached.shape[0] if cached is not None else 0))
            if cached is not None:
                # graphs captured earlier read the old tensor's memory (a graph does not keep its inputs
                # alive): keep it, or a replay of a smaller bucket would read freed memory
                self._retired.append(cached)
            cached = values(torch.arange(size, device=device))
            self._consts[(key, device)] = cached
        return cached[:rows]

    def _offsets(self, experts, rows: int, row_valid: torch.Tensor | None) -> torch.Tensor:
        """1 + the replica pick (t + rank) % M (0 for physical codes), + span on padding rows (row_valid 0):
        [rows] int64. In a static forward computed once per step (by its first layer with this table shape)."""
        runtime = experts.runtime
        _, scale, span = experts.routing_table()
        rank, device, period = runtime.rank, experts.w_gate_up.device, scale or 1
        if row_valid is None:
            return self._constant(("pick", period, rank), rows, device, lambda t: 1 + (t + rank) % period)
        cache = runtime.static_step_cache if runtime.static_step_cache is not None else {}
        key = ("offsets", rows, period, span)
        if key not in cache:
            base = self._constant(("pick+span", period, rank, span), rows, device,
                                  lambda t: 1 + (t + rank) % period + span)                        # [P]
            cache[key] = torch.add(base, row_valid, alpha=-span)                                    # [P]
        return cache[key]

    def _encode(self, experts, ids: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor) -> None:
        """Write the routing codes of `ids` [n, k] into `out` [n, k] (offsets [n]: see _offsets)."""
        _, scale, _ = experts.routing_table()
        if scale:                            # 1 + expert * M + pick (+ span)
            torch.add(offsets.unsqueeze(1), ids, alpha=scale, out=out)
        else:                                # 1 + the physical id physical_ids picks (+ span)
            token_index = self._constant(("token",), ids.shape[0], ids.device, lambda t: t).unsqueeze(1)   # [n, 1]
            torch.add(offsets.unsqueeze(1), experts.physical_ids(ids, token_index, experts.runtime.rank), out=out)

    def __call__(self, experts, hidden, topk_ids, topk_weights, token_counts, row_valid=None):
        runtime = experts.runtime
        group, rank, world = runtime.group.device_group, runtime.rank, runtime.world_size
        num_tokens, top_k = topk_ids.shape
        hidden_size = hidden.shape[1]
        dtype, device = hidden.dtype, hidden.device
        # eager: padded to the step's largest count (known on every rank); graph step: the bucket's rows
        padded_tokens = num_tokens if row_valid is not None else max(token_counts)
        if padded_tokens == 0:                       # no rank has a token: every rank skips alike
            return hidden.new_empty(0, hidden_size)
        table, scale, span = experts.routing_table()
        if row_valid is not None:                    # static shapes: the bucket's buffers, written in place
            packed, gathered = self._static_buffers(padded_tokens, world, hidden_size, dtype, top_k, device)
            send_hidden, send_codes, send_weights = self._views(packed, hidden_size, dtype, top_k)
            send_hidden.copy_(hidden)
            self._encode(experts, topk_ids, self._offsets(experts, num_tokens, row_valid), send_codes[:, :top_k])
            send_weights.copy_(topk_weights)
        else:
            width = self.layout(hidden_size, dtype, top_k)[3]
            packed = torch.zeros(padded_tokens, width, dtype=torch.uint8, device=device)
            gathered = packed.new_empty(world * padded_tokens, width)
            send_hidden, send_codes, send_weights = self._views(packed, hidden_size, dtype, top_k)
            if num_tokens:
                send_hidden[:num_tokens].copy_(hidden)
                self._encode(experts, topk_ids, self._offsets(experts, num_tokens, None),
                             send_codes[:num_tokens, :top_k])
                send_weights[:num_tokens].copy_(topk_weights)
            if num_tokens < padded_tokens:
                send_codes[num_tokens:, :top_k].fill_(1 + span)      # rows past this rank's count route nowhere
        with runtime.timer.time("allgather"):
            all_gather(gathered, packed, group=group)
        all_hidden, all_codes, all_weights = self._views(gathered, hidden_size, dtype, top_k)   # [W*P, ...]
        if experts.w_gate_up.shape[0] == 0:          # this rank holds no slot: it owes nothing
            partial = self._no_slots(world * padded_tokens, hidden_size, device, static=row_valid is not None)
        else:
            # local slots [W*P, k] (choices held elsewhere: weight 0 on a slot read anyway) and fp32 weights
            local_ids, weights = dispatch.ep_local_routing(table, all_codes, all_weights, top_k)
            partial = experts.compute_weighted(all_hidden, local_ids, weights)   # [W*P, H] fp32
        out = torch.empty(padded_tokens, hidden_size, dtype=torch.float32, device=device)  # [P, H]
        with runtime.timer.time("allgather"):
            reduce_scatter(out, partial, group=group)
        return out[:num_tokens].to(dtype)


EXCHANGES = {cls.name: cls for cls in (AllToAllExchange, AllGatherExchange)}

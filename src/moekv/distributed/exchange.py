"""Token dispatch and combine for expert-parallel MoE layers: one interface, two implementations.

Both send each routed token-slot (token t, choice j) to the one rank that computes it (the rank
of the replica `ExpertParallelExperts.physical_ids` picks), run the local experts there, and bring
the weighted sum back to the token's own rank:

- `AllToAllExchange`: variable-size `all_to_all_single` (per-slot counts first, then the token
  rows, then the expert outputs back). Moves only the rows a rank needs; one host sync per layer
  for the split sizes. The choice for large batches (prefill, big decode batches).
- `AllGatherExchange`: every rank all-gathers every rank's tokens and routing (one byte-packed
  gather, padded to the step's largest per-rank count), runs every gathered token-slot through its
  local experts (slots owned elsewhere contribute an exact 0), and a reduce-scatter (fp32 sum)
  hands each rank its tokens' results. Static shapes, two collectives, no count exchange and no
  host sync: meant for small decode batches (the extra compute grows with the world size). Each row
  carries a valid flag, so padding rows (past a rank's count, or a CUDA-graph bucket's padding rows
  given by `row_valid`) route nowhere; in a graph step every rank gathers the bucket's rows.

Numerics match the single-device reference bit for bit for top-2 routing: expert outputs are
rounded to the model dtype exactly as there, and each token's weighted sum is accumulated in
fp32 in ascending expert order (for k > 2 the all-gather path may differ in the last bit).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from moekv.distributed.expert_parallel import ExpertParallelExperts

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


class TokenExchange(ABC):
    """Dispatch -> local experts -> combine for one MoE layer on one rank (a collective call)."""

    name: str

    @abstractmethod
    def __call__(self, experts: "ExpertParallelExperts", hidden: torch.Tensor, topk_ids: torch.Tensor,
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
    name = "allgather"

    def __call__(self, experts, hidden, topk_ids, topk_weights, token_counts, row_valid=None):
        runtime = experts.runtime
        group, rank, world = runtime.group.device_group, runtime.rank, runtime.world_size
        num_tokens, top_k = topk_ids.shape
        hidden_size = hidden.shape[1]
        # eager: padded to the step's largest count (known on every rank); graph step: the bucket's rows
        padded_tokens = num_tokens if row_valid is not None else max(token_counts)
        if padded_tokens == 0:                       # no rank has a token: every rank skips alike
            return hidden.new_empty(0, hidden_size)
        device = hidden.device
        row_bytes = hidden_size * hidden.element_size()
        # one gather moves everything: each row is the token's hidden bytes, then as fp32 bytes its routing
        # (k expert ids, exact in fp32, and k weights) and a valid flag (1: a real token; rows past a rank's
        # count stay zero, so invalid)
        packed = torch.zeros(padded_tokens, row_bytes + 4 * (2 * top_k + 1), dtype=torch.uint8, device=device)
        packed[:num_tokens, :row_bytes] = hidden.contiguous().view(torch.uint8).view(num_tokens, row_bytes)
        flag = row_valid.float().unsqueeze(1) if row_valid is not None else \
            torch.ones(num_tokens, 1, dtype=torch.float32, device=device)
        routing = torch.cat([topk_ids.float(), topk_weights.float(), flag], dim=1)         # [T, 2k+1] fp32
        packed[:num_tokens, row_bytes:] = routing.view(torch.uint8).view(num_tokens, 4 * (2 * top_k + 1))
        gathered = packed.new_empty(world * padded_tokens, packed.shape[1])                 # [W*P, B]
        with runtime.timer.time("allgather"):
            all_gather(gathered, packed, group=group)
        all_hidden = gathered[:, :row_bytes].contiguous().view(hidden.dtype)                # [W*P, H]
        all_routing = gathered[:, row_bytes:].contiguous().view(torch.float32)              # [W*P, 2k+1]
        all_ids = all_routing[:, :top_k].long()                                             # [W*P, k]
        all_weights = all_routing[:, top_k:2 * top_k]                                       # [W*P, k]
        valid = all_routing[:, 2 * top_k:] > 0                                              # [W*P, 1]
        source = torch.arange(world, device=device).repeat_interleave(padded_tokens).unsqueeze(1)   # [W*P, 1]
        token_index = torch.arange(padded_tokens, device=device).repeat(world).unsqueeze(1)         # [W*P, 1]
        physical = experts.physical_ids(all_ids, token_index, source).reshape(-1)           # [W*P*k]
        mine = (experts.slot_rank[physical] == rank) & valid.expand(-1, top_k).reshape(-1)  # [W*P*k]
        # Every gathered token-slot runs through a local slot, contributing an exact 0 where the slot
        # is another rank's: static shapes, no host sync to count this rank's rows. Those rows reuse
        # a slot this rank computes anyway (the first of its own), so the kernels, which read each
        # expert's weights once per call, read no extra expert.
        local = experts.slot_local[physical]                                                # [W*P*k]
        # (index_select with a [1] index: indexing by a 0-dim CUDA tensor would read it back to the host)
        first_mine = torch.argmax(mine.to(torch.int8)).reshape(1)                           # [1]
        reused = torch.where(mine.any(), local.index_select(0, first_mine)[0], torch.zeros_like(local[0]))
        local_ids = torch.where(mine, local, reused)                                        # [W*P*k]
        order = torch.argsort(all_ids.reshape(-1), stable=True)                             # by expert
        tokens = order // top_k                                                             # [W*P*k]
        if experts.w_gate_up.shape[0] == 0:          # this rank holds no slot: it owes nothing
            partial = torch.zeros(world * padded_tokens, hidden_size, dtype=torch.float32, device=device)
        else:
            out_rows = experts.compute(all_hidden.index_select(0, tokens), local_ids[order])   # [W*P*k, H]
            weighted = out_rows.float() * all_weights.reshape(-1)[order].unsqueeze(-1)
            weighted = torch.where(mine[order].unsqueeze(-1), weighted, torch.zeros((), device=device))
            partial = torch.zeros(world * padded_tokens, hidden_size, dtype=torch.float32, device=device)
            partial.index_add_(0, tokens, weighted)                                         # [W*P, H]
        out = torch.empty(padded_tokens, hidden_size, dtype=torch.float32, device=device)  # [P, H]
        with runtime.timer.time("allgather"):
            reduce_scatter(out, partial, group=group)
        return out[:num_tokens].to(hidden.dtype)


EXCHANGES = {cls.name: cls for cls in (AllToAllExchange, AllGatherExchange)}

"""Reference for the expert-parallel all-gather exchange's routing step (the Triton twin is
ops.triton.moe.ep_routing): gathered routing codes -> this rank's local expert slots and weights.

table [C] int64: local slot of each routing code on this rank, -1 where another rank holds it
(distributed.expert_parallel.ExpertParallelExperts.routing_table; entry 0 is 0, the floor column).
codes [N, k + 1] int64 (the last column is the floor code 0), weights [N, k] fp32 (both may be
strided views of the gathered byte rows).

Returns local_ids [N, k] int64 and masked weights [N, k] fp32: a choice this rank holds keeps its
slot and weight; a choice held elsewhere gets weight 0 and the largest local slot any row of the
call uses (a slot the expert kernels read anyway, so it costs no extra weight reads; >= 0 thanks to
the floor column), so it adds an exact 0.
"""

from __future__ import annotations

import torch


def ep_local_routing(table: torch.Tensor, codes: torch.Tensor, weights: torch.Tensor, top_k: int):
    local = table[codes]                                        # [N, k + 1]
    reused = local.amax()                                       # >= 0: the floor column
    local = local[:, :top_k]
    mine = local >= 0                                           # [N, k]
    return torch.where(mine, local, reused), torch.where(mine, weights, 0.0)

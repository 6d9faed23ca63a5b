"""The experts seam of the MoE block (`Experts`) and its local, all-on-this-device implementation.

Offloaded (moe.prefetch) and expert-parallel (distributed) variants subclass `Experts` and are swapped
into `MoEBlock.experts` after the model is built.
"""

from __future__ import annotations

import torch
from torch import nn

from moekv.layers.linear import empty_parameter
from moekv.ops import dispatch


class Experts(nn.Module):
    """Computes sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]).

    Subclasses: LocalExperts here; offloaded and expert-parallel variants elsewhere. They are
    swapped into `MoEBlock.experts` after the model is built.
    """

    num_experts: int
    layer_idx: int

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_ids [T, k] int64, topk_weights [T, k] float32 -> [T, H] in hidden's dtype."""
        raise NotImplementedError


class LocalExperts(Experts):
    """All experts resident, stacked: w_gate_up [E, 2I, H] (gate rows first), w_down [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, layer_idx: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_experts = num_experts
        self.layer_idx = layer_idx
        self.w_gate_up = empty_parameter(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.w_down = empty_parameter(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)

    def forward(self, hidden, topk_ids, topk_weights):
        return dispatch.moe_experts(hidden, self.w_gate_up, self.w_down, topk_ids, topk_weights)   # [T, H]

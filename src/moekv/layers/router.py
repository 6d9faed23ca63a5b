"""Top-k routing: softmax over experts in fp32, top-k, then optional renormalisation.

All four supported families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) route this way: probabilities
first, then top-k, then (Mixtral always; the others when norm_topk_prob) divide by the top-k sum.
"""

from __future__ import annotations

import torch
from torch import nn

from moekv.layers.linear import empty_parameter
from moekv.ops import dispatch
from moekv.ops.reference.layers import route_topk


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), on logits' device.

    Ties between equal probabilities resolve as torch.topk resolves them (as the reference does).
    """
    return route_topk(logits, top_k, renormalize)


class Router(nn.Module):
    """The gate: logits = x W^T with W [E, hidden] (checkpoint name `mlp.gate.weight`)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = empty_parameter(num_experts, hidden_size, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor, expert_load: torch.Tensor | None = None,
                token_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (weights [T, k] float32, ids [T, k] int64); adds the routed slots per
        expert to expert_load [E] int64 when given (token_valid [T]: 0 rows not counted). On CUDA the
        softmax, top-k, renormalisation and count are one kernel (ties: lowest expert index first)."""
        logits = dispatch.skinny_linear(hidden, self.weight)           # [T, E] in the model dtype
        return dispatch.route_topk(logits, self.top_k, self.renormalize, expert_load, token_valid)

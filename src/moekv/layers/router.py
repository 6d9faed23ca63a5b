"""Top-k routing: softmax over experts in fp32, top-k, then optional renormalisation.

All four supported families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) route this way: probabilities
first, then top-k, then (Mixtral always; the others when norm_topk_prob) divide by the top-k sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.layers.linear import empty_parameter


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), on logits' device.

    Ties between equal probabilities resolve as torch.topk resolves them (as the reference does).
    """
    probs = torch.softmax(logits.float(), dim=-1)                      # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)                    # [T, k], [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)          # [T, k]
    return weights, ids


class Router(nn.Module):
    """The gate: logits = x W^T with W [E, hidden] (checkpoint name `mlp.gate.weight`)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = empty_parameter(num_experts, hidden_size, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (weights [T, k] float32, ids [T, k] int64)."""
        logits = F.linear(hidden, self.weight)                         # [T, E] in the model dtype
        return route(logits, self.top_k, self.renormalize)

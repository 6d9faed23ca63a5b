"""The feed-forward blocks: a gated dense MLP, and the routed MoE block (+ optional shared expert).

MoE flow: router -> (weights, ids) -> `self.experts` (layers.experts.LocalExperts by default: stacked
weights through ops.dispatch.moe_experts; offloaded or expert-parallel variants are swapped in from
outside) -> + sigmoid(shared_expert_gate(x)) * shared_expert(x) when the model has a shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.config import ArchConfig, KernelConfig
from moekv.layers.experts import Experts, LocalExperts, UncombinedOutput
from moekv.layers.linear import Linear, has_forward_hooks
from moekv.layers.norm import RMSNorm
from moekv.layers.router import Router
from moekv.ops import dispatch
from moekv.ops.reference.layers import count_expert_load


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused in gate_up_proj [2I, hidden] (gate rows first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)                                           # [T, 2I]
        act = F.silu(gate_up[:, :self.intermediate_size]) * gate_up[:, self.intermediate_size:]   # [T, I]
        return self.down_proj(act)                                                    # [T, hidden]


class MoEBlock(nn.Module):
    """Router + routed experts (+ optional shared expert). `experts` is replaceable (see layers.experts)."""

    def __init__(self, arch: ArchConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        experts, inter, hidden = arch.num_experts, arch.expert_intermediate_size, arch.hidden_size
        self.num_experts = experts
        self.layer_idx = layer_idx
        self.router = Router(hidden, experts, arch.top_k, arch.norm_topk_prob, dtype, device)
        self.experts: Experts = LocalExperts(experts, hidden, inter, layer_idx, dtype, device)
        if arch.shared_expert_intermediate_size > 0:
            self.shared_expert = DenseMLP(hidden, arch.shared_expert_intermediate_size, dtype, device)
            self.shared_expert_gate = Linear(hidden, 1, False, dtype, device)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        # the fused add + norm + route kernel's per-token arrival counters (a router of several programs per token
        # is routed by each token's last program, ops.triton.layer.norm_route): allocated with the model, so they
        # exist before a CUDA graph is captured; every launch leaves them zero
        self.register_buffer("route_counters", torch.zeros(KernelConfig.FUSED_ROUTER_MAX_TOKENS, dtype=torch.int32,
                                                           device=device), persistent=False)

    def forward(self, hidden: torch.Tensor, expert_load: torch.Tensor | None = None,
                token_valid: torch.Tensor | None = None, defer_combine: bool = False
                ) -> torch.Tensor | UncombinedOutput:
        """hidden [T, hidden] -> [T, hidden]; adds routed slots per expert to expert_load [E] (int64).
        token_valid [T] int64 (0: a padding row of a CUDA-graph bucket, not counted); None: all count.
        defer_combine: may return the routed output un-combined (see _routed; the caller keeps hooks away)."""
        if isinstance(self.router, Router):      # counts inside the routing kernel (on device, no sync)
            topk_weights, topk_ids = self.router(hidden, expert_load, token_valid)    # [T, k], [T, k]
        else:                                    # a stand-in router (moe.prefetch.trace): count here
            topk_weights, topk_ids = self.router(hidden)                              # [T, k], [T, k]
            if expert_load is not None:
                count_expert_load(topk_ids, expert_load, token_valid)
        return self._routed(hidden, topk_ids, topk_weights, defer_combine)

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                         expert_load: torch.Tensor | None = None, token_valid: torch.Tensor | None = None,
                         defer_combine: bool = False) -> tuple[torch.Tensor | UncombinedOutput, torch.Tensor] | None:
        """(self(norm(residual + x)), residual + x) with the add, the norm, the router GEMV and the top-k in one
        launch (ops.dispatch.add_rms_norm_route; routers of several programs per token: with route_counters, or two
        launches with KernelConfig.fused_route_fold off), or None where that does not apply: the fused decode layer off,
        more than KernelConfig.FUSED_ROUTER_MAX_TOKENS tokens, a stand-in router, forward hooks on the norm, the
        router or this block (they would not run)."""
        if (not dispatch.fused_decode_layer() or x.shape[0] > KernelConfig.FUSED_ROUTER_MAX_TOKENS
                or not isinstance(self.router, Router) or has_forward_hooks(self, self.router, norm)):
            return None
        router = self.router
        normed, residual, topk_weights, topk_ids = dispatch.add_rms_norm_route(
            x, residual, norm.weight, norm.eps, router.weight, router.top_k, router.renormalize, expert_load,
            token_valid, None, self.route_counters)                                   # [T, H] x2, [T, k] x2
        return self._routed(normed, topk_ids, topk_weights, defer_combine), residual

    def _routed(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                defer_combine: bool = False) -> torch.Tensor | UncombinedOutput:
        """The experts' weighted sum (+ the shared expert). defer_combine: an UncombinedOutput instead, for the next
        residual add + RMSNorm to sum (KernelConfig.fused_moe_combine), where the experts give one (the decode
        kernels) and nothing here needs the sum: no shared expert, no hooks on the experts."""
        if defer_combine and self.shared_expert is None and not has_forward_hooks(self.experts):
            pending = self.experts.uncombined(hidden, topk_ids, topk_weights)
            if pending is not None:
                return pending
        out = self.experts(hidden, topk_ids, topk_weights)                            # [T, hidden]
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden))                     # [T, 1]
            out = out + gate * self.shared_expert(hidden)                             # [T, hidden]
        return out

"""The routed experts' weighted sum as a step of its own, and that step fused into the next residual add + RMSNorm
(pure PyTorch, CPU and CUDA): the twins of ops.triton.moe.decode's per-slot outputs and combine, and of
ops.triton.layer.combine_norm.

An MoE block's routed output is out[t] = sum_j w[t, j] * y[t*k + j] with y the expert output of slot t*k + j.
The Triton decode path keeps y un-summed as `partial [S, T*k, H]` (fp32, S K-splits of the down projection:
y = sum_s partial[s]) and sums in a fixed order: per slot j = 0 .. k-1 the splits s = 0 .. S-1 from zero, then
acc = acc + w[t, j] * y (a rounded product, then a rounded add: no multiply-add contraction), rounded once to the
model dtype. The functions here sum in that same order, so on every device they give the kernels' combine bit
for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekv.core.fp8 import Fp8Weight
from moekv.ops.reference.layers import fused_add_rms_norm
from moekv.ops.reference.moe import moe_activation_reference


def check_partials(partial: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    """ValueError unless partial is [S >= 1, T*k, H] and topk_weights [T, k] of floats (residual: [T, H])."""
    if partial.dim() != 3 or topk_weights.dim() != 2 or partial.shape[0] < 1:
        raise ValueError(f"MoE combine: partial must be [splits, T*k, H] and topk_weights [T, k], got "
                         f"{list(partial.shape)} and {list(topk_weights.shape)}")
    num_tokens, top_k = topk_weights.shape
    if partial.shape[1] != num_tokens * top_k:
        raise ValueError(f"MoE combine: partial has {partial.shape[1]} slot rows, topk_weights "
                         f"{list(topk_weights.shape)} needs T*k = {num_tokens * top_k}")
    if not (partial.is_floating_point() and topk_weights.is_floating_point()):
        raise ValueError(f"MoE combine: partial and topk_weights must be floats, got {partial.dtype} / "
                         f"{topk_weights.dtype}")
    if residual is not None and tuple(residual.shape) != (num_tokens, partial.shape[2]):
        raise ValueError(f"MoE combine: residual must be [T, H] = {[num_tokens, partial.shape[2]]}, got "
                         f"{list(residual.shape)}")


def moe_expert_partials(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """Every token-slot's expert output, not yet weighted or summed: [1, T*k, H] fp32, row t*k + j =
    down_e(act[t*k + j]) with e = topk_ids[t, j] and act rounded once to hidden's dtype (as the decode kernel
    stores it), the down projection in fp32. One split: moe_combine of it with the routing weights is the
    routed output (moe_experts_reference up to where that rounds each expert's output to the model dtype)."""
    act = moe_activation_reference(hidden, w_gate_up, topk_ids).float()               # [T*k, I]
    down = w_down.dequantize() if isinstance(w_down, Fp8Weight) else w_down.float()    # [E, H, I]
    out = torch.empty((act.shape[0], down.shape[1]), dtype=torch.float32, device=hidden.device)   # [T*k, H]
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():                                     # host sync (reference)
        rows = (flat_ids == expert).nonzero().squeeze(1)
        out[rows] = F.linear(act[rows], down[expert])
    return out.unsqueeze(0)                                                            # [1, T*k, H]


def moe_combine(partial: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partial [S, T*k, H], topk_weights [T, k] -> [T, H] in dtype: sum_j w[t, j] * sum_s partial[s, t*k + j],
    in fp32, in the order of the module docstring."""
    check_partials(partial, topk_weights)
    splits, _, hidden = partial.shape
    num_tokens, top_k = topk_weights.shape
    rows = partial.float().view(splits, num_tokens, top_k, hidden)                      # [S, T, k, H]
    weights = topk_weights.float()
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=partial.device)
    for j in range(top_k):
        expert_out = torch.zeros_like(acc)
        for split in range(splits):
            expert_out = expert_out + rows[split, :, j]                                 # [T, H]
        acc = acc + weights[:, j:j + 1] * expert_out
    return acc.to(dtype)


def compose_moe_combine_add_rms_norm(combine, add_norm, partial, topk_weights, residual, norm_weight, eps):
    """moe_combine_add_rms_norm from its two parts (the reference's, or ops.dispatch's own kernels)."""
    check_partials(partial, topk_weights, residual)
    return add_norm(combine(partial, topk_weights, residual.dtype), residual, norm_weight, eps)


def moe_combine_add_rms_norm(partial: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) with x = moe_combine(partial, topk_weights, residual.dtype): the
    MoE block's routed output summed, rounded to the model dtype, added to the residual (rounded again) and
    normalised -- the next layer's input norm (or the model's final norm) reading the un-combined experts."""
    return compose_moe_combine_add_rms_norm(moe_combine, fused_add_rms_norm, partial, topk_weights, residual,
                                            norm_weight, eps)

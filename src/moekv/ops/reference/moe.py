"""Reference expert compute for a routed MoE block (pure PyTorch, CPU and CUDA).

Expert weights are stacked: w_gate_up [E, 2I, H] (rows 0..I-1 the gate projection, I..2I-1 the up
projection) and w_down [E, H, I]. This is the layout the fused Triton kernel reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts_reference(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                          topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j].

    hidden [T, H]; topk_ids [T, k] int64; topk_weights [T, k] (any float dtype) -> [T, H] in
    hidden's dtype. Token slots are sorted by expert so each expert runs one matmul over a
    contiguous segment; the per-expert counts come to the host once (this is the reference path,
    the Triton kernel avoids that sync). The weighted sum accumulates in fp32.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)                                          # [T*k]
    order = torch.argsort(flat_ids, stable=True)                             # [T*k] slots grouped by expert
    slot_token = order // top_k                                              # [T*k] token of each sorted slot
    slot_weight = topk_weights.reshape(-1).float().index_select(0, order)    # [T*k]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()        # host sync (reference only)
    x = hidden.index_select(0, slot_token)                                   # [T*k, H]
    expert_out = torch.empty_like(x)                                         # [T*k, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        segment = x[start:start + count]                                     # [n, H]
        gate_up = F.linear(segment, w_gate_up[expert])                       # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]                # [n, I]
        expert_out[start:start + count] = F.linear(act, w_down[expert])     # [n, H]
        start += count
    weighted = expert_out.float() * slot_weight.unsqueeze(-1)                # [T*k, H] fp32
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, slot_token, weighted)                                  # [T, H]
    return out.to(hidden.dtype)

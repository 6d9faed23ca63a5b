"""Reference expert compute for a routed MoE block (pure PyTorch, CPU and CUDA).

Expert weights are stacked: w_gate_up [E, 2I, H] (rows 0..I-1 the gate projection, I..2I-1 the up
projection) and w_down [E, H, I]. This is the layout the fused Triton kernel reads. Either may be an
FP8 weight (moekv.core.fp8.Fp8Weight: float8_e4m3fn codes of that shape + block scales, W8A16): each
expert's weights are then dequantized in fp32 and its matmuls run in fp32 (the kernel's dequantize-in-
registers with fp32 accumulation), rounding where the 16-bit path rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekv.core.fp8 import Fp8Weight, fake_quantize_rows


def moe_experts_reference(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight,
                          topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          out_dtype: torch.dtype | None = None, act_fp8: bool = False) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j].

    hidden [T, H]; topk_ids [T, k] int64; topk_weights [T, k] (any float dtype) -> [T, H] in
    out_dtype (None: hidden's; torch.float32: the fp32 sum, unrounded). Token slots are sorted by
    expert so each expert runs one matmul over a contiguous segment; the per-expert counts come to
    the host once (this is the reference path, the Triton kernel avoids that sync). The weighted sum
    accumulates in fp32. act_fp8 (FP8 weights only, W8A8): each token's hidden row and each slot's activation
    row (after its rounding to the model dtype) are quantized to e4m3 with a per-row scale (core.fp8.quantize_rows)
    before their matmul, as ops.triton.moe.grouped's A8 kernels read them.
    """
    if act_fp8 and not (isinstance(w_gate_up, Fp8Weight) and isinstance(w_down, Fp8Weight)):
        raise ValueError("act_fp8 (W8A8) needs FP8 expert weights")
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
        if isinstance(w_gate_up, Fp8Weight):                                 # W8A16: fp32 matmuls
            rows = fake_quantize_rows(segment) if act_fp8 else segment.float()
            gate_up = F.linear(rows, w_gate_up[expert].dequantize())          # [n, 2I] fp32
            act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden.dtype)   # [n, I]
        else:
            gate_up = F.linear(segment, w_gate_up[expert])                   # [n, 2I]
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]            # [n, I]
        if isinstance(w_down, Fp8Weight):
            rows = fake_quantize_rows(act) if act_fp8 else act.float()
            expert_out[start:start + count] = F.linear(rows, w_down[expert].dequantize()).to(x.dtype)
        else:
            expert_out[start:start + count] = F.linear(act, w_down[expert])  # [n, H]
        start += count
    weighted = expert_out.float() * slot_weight.unsqueeze(-1)                # [T*k, H] fp32
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, slot_token, weighted)                                  # [T, H]
    return out.to(out_dtype or hidden.dtype)


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token-slots by expert and pad each expert's run to a multiple of block_m (device ops only).

    topk_ids [T, k] -> (sorted_slots [P] int32, block_experts [P / block_m] int32,
    num_padded [1] int32) with N = T*k slots (slot t*k + j is token t's j-th choice) and
    P = padded_capacity(N, num_experts, block_m) (known on the host from the shapes alone).
    Expert e's slots, ascending, fill rows padded_start[e] .. padded_start[e] + count[e]; the rest of
    its run up to the next multiple of block_m, and every row from num_padded on, hold N (no slot).
    Block b of block_m rows belongs to expert block_experts[b], or -1 past num_padded.
    No host synchronisation: counts come from index_add_, not bincount (which syncs on CUDA).
    """
    flat_ids = topk_ids.reshape(-1)                                                   # [N]
    num_slots = flat_ids.numel()
    device = flat_ids.device
    capacity = padded_capacity(num_slots, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids))                        # [E]
    padded = (counts + block_m - 1) // block_m * block_m                             # [E]
    padded_end = torch.cumsum(padded, 0)                                              # [E]
    padded_start = padded_end - padded                                                # [E]
    count_start = torch.cumsum(counts, 0) - counts                                    # [E]
    order = torch.argsort(flat_ids, stable=True)                                      # [N] slots by expert
    sorted_experts = flat_ids.index_select(0, order)                                  # [N]
    rank = torch.arange(num_slots, device=device) - count_start.index_select(0, sorted_experts)   # [N]
    rows = padded_start.index_select(0, sorted_experts) + rank                        # [N]
    sorted_slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.index_copy_(0, rows, order.to(torch.int32))                          # [P]
    num_padded = padded_end[-1:].to(torch.int32)                                      # [1]
    block_start = torch.arange(0, capacity, block_m, device=device)                   # [P / block_m]
    block_experts = torch.searchsorted(padded_end, block_start, right=True)           # [P / block_m]
    block_experts = torch.where(block_start < padded_end[-1], block_experts, -1).to(torch.int32)
    return sorted_slots, block_experts, num_padded


def padded_capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """Rows the aligned layout needs at most: every non-empty expert (at most min(N, E) of them)
    wastes fewer than block_m rows of padding; rounded up to whole blocks."""
    rows = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_activation_reference(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, topk_ids: torch.Tensor
                             ) -> torch.Tensor:
    """The first half of the expert compute, per token-slot: act [T*k, I] in hidden's dtype,
    act[t*k + j] = silu(x_t W_gate_e^T) * (x_t W_up_e^T) with e = topk_ids[t, j], computed in fp32.
    (The twin of the first kernel of the Triton decode and grouped paths, for localising errors.)"""
    top_k = topk_ids.shape[1]
    inter = w_gate_up.shape[1] // 2
    x = hidden.float().repeat_interleave(top_k, dim=0)                                # [T*k, H]
    full = w_gate_up.dequantize() if isinstance(w_gate_up, Fp8Weight) else w_gate_up.float()   # [E, 2I, H]
    weights = full.index_select(0, topk_ids.reshape(-1))                              # [T*k, 2I, H]
    gate_up = torch.bmm(weights, x.unsqueeze(-1)).squeeze(-1)                         # [T*k, 2I]
    return (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden.dtype)        # [T*k, I]


def moe_experts_rowwise(hidden: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight,
                        topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """moe_experts_reference's contract, computed one token-slot at a time: the batch-invariant mode's path where
    the Triton kernels do not run (KernelConfig.batch_invariant on the CPU). Each slot's gate_up and down products
    are fp32 matrix-vector products of that slot alone (as ops.reference.invariant_linear), its activation and
    expert output rounded to the model dtype where the grouped kernels round them, the weighted sum over the k
    slots in fp32 in slot order: a token's result does not depend on which or how many tokens share the step
    (its limits on the CPU: ops.reference.invariant_linear's docstring)."""
    num_tokens, hidden_size = hidden.shape
    inter = w_gate_up.shape[1] // 2
    dtype = hidden.dtype
    out = torch.empty(num_tokens, hidden_size, dtype=out_dtype or dtype, device=hidden.device)
    weights = topk_weights.float()
    ids = topk_ids.tolist()                                                  # host sync (reference only)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if e not in cache:
            cache[e] = tuple(w[e].dequantize() if isinstance(w, Fp8Weight) else w[e].float()
                             for w in (w_gate_up, w_down))                  # [2I, H], [H, I] fp32
        return cache[e]

    for t in range(num_tokens):
        x = hidden[t].float()                                                # [H] (a fresh fp32 copy)
        acc = torch.zeros(hidden_size, dtype=torch.float32, device=hidden.device)
        for j, e in enumerate(ids[t]):
            gate_up_w, down_w = expert(e)
            gate_up = torch.mv(gate_up_w, x)                                 # [2I] fp32
            act = (F.silu(gate_up[:inter]) * gate_up[inter:]).to(dtype)     # [I] model dtype
            y = torch.mv(down_w, act.float()).to(dtype)                      # [H] model dtype
            acc = acc + weights[t, j] * y.float()
        out[t] = acc.to(out.dtype)
    return out

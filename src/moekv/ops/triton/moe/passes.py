"""Expert compute in passes over slot tensors: the launch pieces of moe.decode / moe.grouped, run with
the configuration of the *resident* shape (E experts) so every pass matches the resident kernels bit
for bit (see moe/prefetch/compute.py, which uses these through ops.dispatch.moe_expert_passes).

    passes = DecodePasses(hidden, top_k, num_experts, inter)     # or GroupedPasses
    passes.buffer                                   # the per-(token, choice) outputs of all passes
    passes.run(w_gate_up, w_down, slot_ids, target) # one pass into target (shaped like buffer)
    passes.keep_rows(target, rows)                  # after a pass of some experts: keep their rows
    passes.result(topk_weights)                     # [T, H]: the weighted sum over all passes, once
"""

from __future__ import annotations

import torch
import triton

from moekv.ops.reference.moe import padded_capacity
from moekv.ops.triton.moe import decode as moe_decode
from moekv.ops.triton.moe import grouped as moe_grouped
from moekv.ops.triton.moe.align import moe_align
from moekv.ops.triton.moe.configs import get_config


class DecodePasses:
    """Decode path: act, down partials [split, T*k, H] fp32, one combine at the end."""

    def __init__(self, hidden: torch.Tensor, top_k: int, num_experts: int, inter: int):
        self.hidden, self.top_k, self.inter = hidden, top_k, inter
        num_tokens, hidden_size = hidden.shape
        cfg = get_config("decode", num_experts, hidden_size, inter, num_tokens, hidden.dtype, hidden.device)
        self.config = {part: dict(cfg[part]) for part in ("gate_up", "down")}
        down = self.config["down"]
        split_k = down.get("SPLIT_K") or moe_decode.default_split_k(
            num_tokens, top_k, num_experts, hidden_size, inter, down["BLOCK_N"], down["BLOCK_K"])
        k_per_split = triton.cdiv(triton.cdiv(inter, split_k), down["BLOCK_K"]) * down["BLOCK_K"]
        down["SPLIT_K"] = triton.cdiv(inter, k_per_split)
        self.k_per_split = k_per_split
        self.buffer = torch.empty((down["SPLIT_K"], num_tokens * top_k, hidden_size), dtype=torch.float32,
                                  device=hidden.device)                                 # [split, T*k, H]

    def run(self, w_gate_up, w_down, slot_ids, partial) -> None:
        hidden = self.hidden
        num_tokens, hidden_size = hidden.shape
        act = moe_decode.decode_activation(hidden, w_gate_up, slot_ids, self.config)   # [T*k, I]
        down = {k: v for k, v in self.config["down"].items() if k != "SPLIT_K"}
        grid = (num_tokens * self.top_k, -(-hidden_size // down["BLOCK_N"]), partial.shape[0])
        weight, scale_args, quant = moe_decode.weight_args(w_down)
        moe_decode._decode_down_kernel[grid](
            act, weight, slot_ids.contiguous(), partial, scale_args[0], num_tokens, hidden_size, self.inter,
            self.k_per_split, act.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), partial.stride(0),
            partial.stride(1), *scale_args[1:], **moe_decode._common(num_tokens, self.top_k, hidden), **down, **quant)

    def keep_rows(self, target, rows) -> None:
        self.buffer[:, rows] = target[:, rows]

    def result(self, topk_weights) -> torch.Tensor:
        return moe_decode.combine(self.buffer, topk_weights, torch.empty_like(self.hidden))   # [T, H]


class GroupedPasses:
    """Grouped path: align, act, down outputs [T*k, H] in the model dtype, one combine at the end."""

    def __init__(self, hidden: torch.Tensor, top_k: int, num_experts: int, inter: int):
        self.hidden, self.top_k, self.inter = hidden, top_k, inter
        num_tokens, hidden_size = hidden.shape
        cfg = get_config("grouped", num_experts, hidden_size, inter, num_tokens, hidden.dtype, hidden.device, top_k)
        self.config = {"BLOCK_M": cfg["BLOCK_M"], **{part: dict(cfg[part]) for part in ("gate_up", "down")}}
        self.buffer = torch.empty((num_tokens * top_k, hidden_size), dtype=hidden.dtype,
                                  device=hidden.device)                                 # [T*k, H]

    def run(self, w_gate_up, w_down, slot_ids, expert_out) -> None:
        hidden = self.hidden
        num_tokens, hidden_size = hidden.shape
        num_slots = w_gate_up.shape[0]
        block_m, part = self.config["BLOCK_M"], self.config["down"]
        num_rows = num_tokens * self.top_k
        aligned = moe_align(slot_ids, num_slots, block_m)
        act = moe_grouped.grouped_activation(hidden, w_gate_up, slot_ids, self.config, aligned)   # [N, I]
        sorted_slots, block_experts, num_padded = aligned
        num_row_blocks = padded_capacity(num_rows, num_slots, block_m) // block_m
        grid = (num_row_blocks * -(-hidden_size // part["BLOCK_N"]),)
        weight, scale_args, quant = moe_decode.weight_args(w_down)
        moe_grouped._grouped_down_kernel[grid](
            act, weight, sorted_slots, block_experts, num_padded, expert_out, scale_args[0], num_rows, hidden_size,
            self.inter, num_row_blocks, act.stride(0), weight.stride(0), weight.stride(1), weight.stride(2),
            expert_out.stride(0), *scale_args[1:], BLOCK_M=block_m,
            UPCAST=moe_decode.upcast_dots(hidden.dtype, hidden.device), **part, **quant)

    def keep_rows(self, target, rows) -> None:
        self.buffer[rows] = target[rows]

    def result(self, topk_weights) -> torch.Tensor:
        return moe_decode.combine(self.buffer.unsqueeze(0), topk_weights, torch.empty_like(self.hidden))   # [T, H]

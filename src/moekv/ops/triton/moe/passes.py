"""Expert compute in passes over slot tensors: the launch pieces of moe.decode / moe.grouped, run with
the configuration of the *resident* shape (E experts) so every pass matches the resident kernels bit
for bit (see moe/prefetch/compute.py, which uses these through ops.dispatch.moe_expert_passes).

    passes = DecodePasses(hidden, top_k, num_experts, inter, weights)   # or GroupedPasses; weights: the
                                    # (w_gate_up, w_down) the passes read, FP8 ones take the FP8 configuration
    passes.buffer                                   # the per-(token, choice) outputs of all passes
    passes.run(w_gate_up, w_down, local_ids, slot_pool, target)   # one pass into target (like buffer);
            # local_ids [T, k]: each choice's slot among the layer's S, slot_pool [S]: its row of w [N, ...]
    passes.keep_rows(target, rows)                  # after a pass of some experts: keep their rows
    passes.put_rows(rows, values)                   # rows [n] (flat token*k + choice) computed elsewhere:
            # values [n, H] (the CPU-split misses of moe/prefetch/cpu_split.py)
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


def _formats(weights) -> tuple[str | None, tuple | None]:
    """(tuned-config weight format, (w_gate_up, w_down)) of the weights the passes read (None: 16-bit)."""
    if weights is None:
        return None, None
    return moe_decode.weight_format(weights[0]), weights


def _cap_block_k(config: dict, weights, hidden_size: int, inter: int) -> None:
    """FP8 scale blocks narrower than the reduced size cap BLOCK_K, as the resident launch does."""
    if weights is not None:
        config["gate_up"] = moe_decode.fp8_block_k(config["gate_up"], weights[0], hidden_size)
        config["down"] = moe_decode.fp8_block_k(config["down"], weights[1], inter)


class DecodePasses:
    """Decode path: act, down partials [split, T*k, H] fp32, one combine at the end (either variant:
    decode.decode_config)."""

    def __init__(self, hidden: torch.Tensor, top_k: int, num_experts: int, inter: int, weights=None):
        self.hidden, self.top_k, self.inter = hidden, top_k, inter
        num_tokens, hidden_size = hidden.shape
        w_gate_up, w_down = weights if weights is not None else (None, None)
        self.config = moe_decode.decode_config(hidden, num_experts, inter, w_gate_up, w_down)
        down, split_k, self.k_per_split = moe_decode.down_splits(self.config["down"], num_tokens, top_k,
                                                                 num_experts, hidden_size, inter)
        self.config["down"] = dict(down, SPLIT_K=split_k)
        self.buffer = torch.empty((split_k, num_tokens * top_k, hidden_size), dtype=torch.float32,
                                  device=hidden.device)                                 # [split, T*k, H]

    def run(self, w_gate_up, w_down, local_ids, slot_pool, partial) -> None:
        slot_ids = slot_pool[local_ids]                                                 # [T, k] pool slots
        act = moe_decode.decode_activation(self.hidden, w_gate_up, slot_ids, self.config)   # [T*k, I]
        down = {k: v for k, v in self.config["down"].items() if k != "SPLIT_K"}
        moe_decode.down_partials(act, w_down, slot_ids, partial, self.k_per_split, down, self.config["VARIANT"],
                                 self.hidden)

    def keep_rows(self, target, rows) -> None:
        self.buffer[:, rows] = target[:, rows]

    def put_rows(self, rows, values) -> None:
        """Rows computed outside the kernels: the whole value in the first K-split partial, 0 in the others."""
        self.buffer[:, rows] = 0.0
        self.buffer[0, rows] = values.float()

    def result(self, topk_weights) -> torch.Tensor:
        return moe_decode.combine(self.buffer, topk_weights, torch.empty_like(self.hidden))   # [T, H]


class GroupedPasses:
    """Grouped path: align, act, down outputs [T*k, H] in the model dtype, one combine at the end."""

    def __init__(self, hidden: torch.Tensor, top_k: int, num_experts: int, inter: int, weights=None):
        self.hidden, self.top_k, self.inter = hidden, top_k, inter
        num_tokens, hidden_size = hidden.shape
        fmt, weights = _formats(weights)
        cfg = get_config("grouped", num_experts, hidden_size, inter, num_tokens, hidden.dtype, hidden.device, top_k,
                         weights=fmt)
        self.config = {"BLOCK_M": cfg["BLOCK_M"], **{part: dict(cfg[part]) for part in ("gate_up", "down")}}
        _cap_block_k(self.config, weights, hidden_size, inter)
        self.buffer = torch.empty((num_tokens * top_k, hidden_size), dtype=hidden.dtype,
                                  device=hidden.device)                                 # [T*k, H]

    def run(self, w_gate_up, w_down, local_ids, slot_pool, expert_out) -> None:
        """The rows aligned by local slot (S groups at most); each block's slot is then translated to its
        pool row for the weight reads (a row's value does not depend on the other rows of its tile)."""
        hidden = self.hidden
        num_tokens, hidden_size = hidden.shape
        num_slots = slot_pool.shape[0]
        block_m, part = self.config["BLOCK_M"], self.config["down"]
        num_rows = num_tokens * self.top_k
        sorted_slots, block_experts, num_padded = moe_align(local_ids, num_slots, block_m)
        block_experts = torch.where(block_experts >= 0, slot_pool[block_experts.clamp(min=0).long()],
                                    -1).to(torch.int32)
        num_row_blocks = padded_capacity(num_rows, num_slots, block_m) // block_m
        act = self._activation(w_gate_up, sorted_slots, block_experts, num_padded, num_row_blocks)   # [N, I]
        grid = (num_row_blocks * -(-hidden_size // part["BLOCK_N"]),)
        weight, scale_args, quant = moe_decode.weight_args(w_down)
        moe_grouped._grouped_down_kernel[grid](
            act, weight, sorted_slots, block_experts, num_padded, expert_out, scale_args[0], act, num_rows,
            hidden_size, self.inter, num_row_blocks, act.stride(0), weight.stride(0), weight.stride(1),
            weight.stride(2), expert_out.stride(0), *scale_args[1:], BLOCK_M=block_m,
            UPCAST=moe_decode.upcast_dots(hidden.dtype, hidden.device), A8=False, **part, **quant)

    def _activation(self, w_gate_up, sorted_slots, block_experts, num_padded, num_row_blocks) -> torch.Tensor:
        """The gate_up launch of moe.grouped.grouped_activation over an alignment given in slots: act [T*k, I]."""
        hidden = self.hidden if self.hidden.stride(-1) == 1 else self.hidden.contiguous()
        num_tokens, hidden_size = hidden.shape
        part = self.config["gate_up"]
        act = torch.empty((num_tokens * self.top_k, self.inter), dtype=hidden.dtype, device=hidden.device)
        weight, scale_args, quant = moe_decode.weight_args(w_gate_up)
        grid = (num_row_blocks * triton.cdiv(self.inter, part["BLOCK_N"]),)
        moe_grouped._grouped_gate_up_kernel[grid](
            hidden, weight, sorted_slots, block_experts, num_padded, act, scale_args[0], hidden,
            num_tokens * self.top_k, hidden_size, self.inter, num_row_blocks, hidden.stride(0), weight.stride(0),
            weight.stride(1), weight.stride(2), act.stride(0), *scale_args[1:], TOP_K=self.top_k,
            BLOCK_M=self.config["BLOCK_M"], UPCAST=moe_decode.upcast_dots(hidden.dtype, hidden.device), A8=False,
            **part, **quant)
        return act

    def keep_rows(self, target, rows) -> None:
        self.buffer[rows] = target[rows]

    def put_rows(self, rows, values) -> None:
        """Rows computed outside the kernels (rounded to the buffer's dtype, as the down kernel's output)."""
        self.buffer[rows] = values.to(self.buffer.dtype)

    def result(self, topk_weights) -> torch.Tensor:
        return moe_decode.combine(self.buffer.unsqueeze(0), topk_weights, torch.empty_like(self.hidden))   # [T, H]

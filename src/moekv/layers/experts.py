"""The experts seam of the MoE block (`Experts`) and its local, all-on-this-device implementation.

Offloaded (moe.prefetch) and expert-parallel (distributed) variants subclass `Experts` and are swapped
into `MoEBlock.experts` after the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moekv.core.fp8 import FP8_DTYPE, Fp8Weight, quantize_per_expert
from moekv.errors import ConfigError
from moekv.layers.linear import empty_parameter
from moekv.ops import dispatch


@dataclass(frozen=True)
class UncombinedOutput:
    """An MoE block's routed output before its weighted sum: partial [S, T*k, H] (fp32 K-split sums of each
    token-slot's expert output, ops.dispatch.moe_expert_partials) and topk_weights [T, k]. The next residual
    add + RMSNorm sums it in its own launch (RMSNorm.add_norm -> ops.dispatch.moe_combine_add_rms_norm);
    `combine()` gives the [T, H] tensor the block would have returned (the same values, bit for bit)."""

    partial: torch.Tensor
    topk_weights: torch.Tensor
    dtype: torch.dtype

    def combine(self) -> torch.Tensor:
        return dispatch.moe_combine(self.partial, self.topk_weights, self.dtype)          # [T, H]


def combined(x: torch.Tensor | UncombinedOutput) -> torch.Tensor:
    """x as a tensor: an UncombinedOutput summed (dispatch.moe_combine), a tensor as it is."""
    return x.combine() if isinstance(x, UncombinedOutput) else x


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

    def uncombined(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                   ) -> UncombinedOutput | None:
        """forward's result before its weighted sum, where these experts can give it; None: call forward."""
        return None


class StackedExpertWeights:
    """w_gate_up [S, 2I, H] (gate rows first) and w_down [S, H, I] stacked over S slots, 16-bit or FP8.

    FP8 (`to_fp8`): w_gate_up / w_down hold float8_e4m3fn codes and w_gate_up_scale / w_down_scale their fp32
    block scales (moekv.core.fp8); the fused MoE kernels read them as W8A16. Mixed into LocalExperts (S = E)
    and the expert-parallel experts (S = this rank's slots)."""

    # set by the module's __init__ (no class-level values: nn.Module would refuse the parameters then)
    w_gate_up: nn.Parameter
    w_down: nn.Parameter
    w_gate_up_scale: nn.Parameter | None            # FP8 only: fp32 block scales
    w_down_scale: nn.Parameter | None
    weight_blocks: tuple | None                     # FP8 only: ((bn, bk) of w_gate_up, (bn, bk) of w_down)

    @property
    def quantized(self) -> bool:
        return self.w_gate_up.dtype == FP8_DTYPE

    def weights(self) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight]:
        """(w_gate_up, w_down) as ops.dispatch.moe_experts takes them: tensors, or Fp8Weight records."""
        if not self.quantized:
            return self.w_gate_up, self.w_down
        return (Fp8Weight(self.w_gate_up, self.w_gate_up_scale, self.weight_blocks[0]),
                Fp8Weight(self.w_down, self.w_down_scale, self.weight_blocks[1]))

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor with one row per slot: the weights, and their scales when FP8 (what moving a slot moves)."""
        tensors = [self.w_gate_up, self.w_down]
        return tensors + [self.w_gate_up_scale, self.w_down_scale] if self.quantized else tensors

    def to_fp8(self, w_gate_up: Fp8Weight | None = None, w_down: Fp8Weight | None = None,
               device: torch.device | None = None) -> None:
        """Hold the experts in FP8: the given codes and scales (a checkpoint's), or, when None, these experts'
        own weights quantized per output channel. device: where they go (default: the weights')."""
        w_gate_up = w_gate_up or quantize_per_expert(self.w_gate_up.data)
        w_down = w_down or quantize_per_expert(self.w_down.data)
        for name, new in (("w_gate_up", w_gate_up), ("w_down", w_down)):
            if tuple(new.shape) != tuple(getattr(self, name).shape):
                raise ConfigError(f"FP8 {name} of shape {list(new.shape)} for experts of "
                                  f"{list(getattr(self, name).shape)}")
        device = device if device is not None else self.w_gate_up.device
        self.w_gate_up = self.w_down = None
        self.w_gate_up = nn.Parameter(w_gate_up.codes.to(device), requires_grad=False)
        self.w_down = nn.Parameter(w_down.codes.to(device), requires_grad=False)
        self.w_gate_up_scale = nn.Parameter(w_gate_up.scale.to(device), requires_grad=False)
        self.w_down_scale = nn.Parameter(w_down.scale.to(device), requires_grad=False)
        self.weight_blocks = (tuple(w_gate_up.block), tuple(w_down.block))


class LocalExperts(StackedExpertWeights, Experts):
    """All experts resident, stacked: w_gate_up [E, 2I, H] (gate rows first), w_down [E, H, I]; 16-bit or FP8
    (StackedExpertWeights)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, layer_idx: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_experts = num_experts
        self.layer_idx = layer_idx
        self.w_gate_up = empty_parameter(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.w_down = empty_parameter(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)
        self.w_gate_up_scale = self.w_down_scale = None   # FP8 only: fp32 block scales
        self.weight_blocks = None                         # FP8 only: ((bn, bk) of w_gate_up, (bn, bk) of w_down)

    def forward(self, hidden, topk_ids, topk_weights):
        return dispatch.moe_experts(hidden, *self.weights(), topk_ids, topk_weights)   # [T, H]

    def uncombined(self, hidden, topk_ids, topk_weights):
        """On the decode kernels (dispatch.moe_experts_path == "decode": CUDA, T up to the decode limit): their first
        two launches only, the combine left to the caller; elsewhere None (the reference and the grouped path round
        each expert's output before the sum: not this contract)."""
        weights = self.weights()
        if dispatch.moe_experts_path(hidden, self.num_experts, self.w_down.shape[2], weights) != "decode":
            return None
        return UncombinedOutput(dispatch.moe_expert_partials(hidden, *weights, topk_ids), topk_weights, hidden.dtype)


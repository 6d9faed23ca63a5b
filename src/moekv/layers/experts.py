"""The experts seam of the MoE block (`Experts`) and its local, all-on-this-device implementation.

Offloaded (moe.prefetch) and expert-parallel (distributed) variants subclass `Experts` and are swapped
into `MoEBlock.experts` after the model is built.
"""

from __future__ import annotations

import torch
from torch import nn

from moekv.core.fp8 import FP8_DTYPE, Fp8Weight, quantize_per_expert
from moekv.errors import ConfigError
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
    """All experts resident, stacked: w_gate_up [E, 2I, H] (gate rows first), w_down [E, H, I].

    FP8 (`to_fp8`): w_gate_up / w_down hold float8_e4m3fn codes and w_gate_up_scale / w_down_scale their
    fp32 block scales (moekv.core.fp8); the fused MoE kernels read them as W8A16.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, layer_idx: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_experts = num_experts
        self.layer_idx = layer_idx
        self.w_gate_up = empty_parameter(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.w_down = empty_parameter(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)
        self.w_gate_up_scale = self.w_down_scale = None   # FP8 only: fp32 block scales
        self.weight_blocks = None                         # FP8 only: ((bn, bk) of w_gate_up, (bn, bk) of w_down)

    @property
    def quantized(self) -> bool:
        return self.w_gate_up.dtype == FP8_DTYPE

    def weights(self) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight]:
        """(w_gate_up, w_down) as ops.dispatch.moe_experts takes them: tensors, or Fp8Weight records."""
        if not self.quantized:
            return self.w_gate_up, self.w_down
        return (Fp8Weight(self.w_gate_up, self.w_gate_up_scale, self.weight_blocks[0]),
                Fp8Weight(self.w_down, self.w_down_scale, self.weight_blocks[1]))

    def to_fp8(self, w_gate_up: Fp8Weight | None = None, w_down: Fp8Weight | None = None) -> None:
        """Hold the experts in FP8: the given codes and scales (a checkpoint's), or, when None, these experts'
        own weights quantized per output channel."""
        w_gate_up = w_gate_up or quantize_per_expert(self.w_gate_up.data)
        w_down = w_down or quantize_per_expert(self.w_down.data)
        for name, new in (("w_gate_up", w_gate_up), ("w_down", w_down)):
            if tuple(new.shape) != tuple(getattr(self, name).shape):
                raise ConfigError(f"FP8 {name} of shape {list(new.shape)} for experts of "
                                  f"{list(getattr(self, name).shape)}")
        device = self.w_gate_up.device
        self.w_gate_up = self.w_down = None
        self.w_gate_up = nn.Parameter(w_gate_up.codes.to(device), requires_grad=False)
        self.w_down = nn.Parameter(w_down.codes.to(device), requires_grad=False)
        self.w_gate_up_scale = nn.Parameter(w_gate_up.scale.to(device), requires_grad=False)
        self.w_down_scale = nn.Parameter(w_down.scale.to(device), requires_grad=False)
        self.weight_blocks = (tuple(w_gate_up.block), tuple(w_down.block))

    def forward(self, hidden, topk_ids, topk_weights):
        return dispatch.moe_experts(hidden, *self.weights(), topk_ids, topk_weights)   # [T, H]


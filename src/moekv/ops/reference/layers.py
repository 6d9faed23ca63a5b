"""Reference per-layer elementwise ops of the decoder (pure PyTorch, CPU and CUDA): RMSNorm with and
without the residual add, rotary embedding of q and k, and top-k routing with the expert-load count.

These are the model's own math (the Hugging Face order and rounding points); the Triton kernels in
ops.triton.{norm,rotary,routing} fuse each into one launch and round at the same points.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> weight * (x / sqrt(mean(x^2) + eps)) over the last dimension.

    The statistics run in fp32 and the normalised value is rounded to x's dtype before the weight
    multiply (the Hugging Face order); the result has the promoted dtype of weight and x.
    """
    x_fp32 = x.float()                                                  # [..., N]
    variance = x_fp32.pow(2).mean(-1, keepdim=True)                      # [..., 1]
    normed = (x_fp32 * torch.rsqrt(variance + eps)).to(x.dtype)         # [..., N]
    return weight * normed


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): x, residual [..., N] of one dtype.

    The sum is rounded to the dtype first (as `hidden = hidden + out` does), and the norm reads it.
    """
    new_residual = residual + x                                          # [..., N]
    return rms_norm(new_residual, weight, eps), new_residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] -> [T, H, D] rotated ("rotate_half" convention)."""
    cos = cos.unsqueeze(1)                                                 # [T, 1, D]
    sin = sin.unsqueeze(1)                                                 # [T, 1, D]
    return x * cos + rotate_half(x) * sin


def apply_rotary_qk(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hkv, D]; cos/sin [T, D] -> (rotated query, rotated key), new tensors."""
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)


def count_expert_load(ids: torch.Tensor, expert_load: torch.Tensor, token_valid: torch.Tensor | None = None
                      ) -> None:
    """expert_load [E] int64 += routed slots per expert of ids [T, k]; token_valid [T] (0: not counted)."""
    flat_ids = ids.reshape(-1)                                                   # [T*k]
    if token_valid is None:
        counts = torch.ones_like(flat_ids, dtype=expert_load.dtype)
    else:
        counts = token_valid.to(expert_load.dtype).unsqueeze(1).expand_as(ids).reshape(-1)   # [T*k]
    expert_load.index_add_(0, flat_ids, counts)                                  # on device, no sync


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, expert_load: torch.Tensor | None = None,
               token_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), on logits' device.

    Softmax over experts in fp32, top-k, then (renormalize) divide by the top-k sum. When
    expert_load [E] int64 is given, adds each token's k slots to it (tokens with token_valid == 0
    are not counted). Ties between equal probabilities resolve as torch.topk resolves them (its
    order among equals is unspecified; the Triton kernel takes the lowest expert index first).
    """
    probs = torch.softmax(logits.float(), dim=-1)                      # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)                    # [T, k], [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)          # [T, k]
    if expert_load is not None:
        count_expert_load(ids, expert_load, token_valid)
    return weights, ids

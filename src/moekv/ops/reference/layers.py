"""Reference per-layer elementwise ops of the decoder (pure PyTorch, CPU and CUDA): RMSNorm with and
without the residual add, rotary embedding of q and k, and top-k routing with the expert-load count; and
the two cross-op fusions of a decode layer, as the compositions of those: add + RMSNorm + router + top-k
(`add_rms_norm_route`) and q/k norm + rotary + the KV write (`qk_norm_rotary_write`).

These are the model's own math (the Hugging Face order and rounding points); the Triton kernels in
ops.triton.layer.{norm,rotary,routing,norm_route,rotary_write} fuse each into one launch and round at the
same points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekv.ops.reference.lowbit import stage_decode_tokens


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


def compose_add_rms_norm_route(add_norm, linear, route, x, residual, norm_weight, eps, router_weight, top_k,
                               renormalize, expert_load=None, token_valid=None, logits_out=None, route_counters=None):
    """add_rms_norm_route from its three parts (the reference's, or ops.dispatch's own kernels); route_counters
    is not used (the fused kernel's, left zero)."""
    normed, new_residual = add_norm(x, residual, norm_weight, eps)                    # [T, H] x2
    logits = linear(normed, router_weight)                                             # [T, E]
    if logits_out is not None:
        logits_out.copy_(logits)
    weights, ids = route(logits, top_k, renormalize, expert_load, token_valid)         # [T, k] x2
    return normed, new_residual, weights, ids


def add_rms_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       router_weight: torch.Tensor, top_k: int, renormalize: bool,
                       expert_load: torch.Tensor | None = None, token_valid: torch.Tensor | None = None,
                       logits_out: torch.Tensor | None = None, route_counters: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (normed [T, H], residual + x [T, H], weights [T, k] float32, ids [T, k] int64).

    fused_add_rms_norm, then the router's logits normed @ router_weight[E, H]^T in the model dtype (F.linear;
    copied to logits_out [T, E] when given), then route_topk with the expert-load count: the post-attention
    half of an MoE decoder layer up to its experts. route_counters ([>= T] int32 zeros, the MoE block's) changes
    nothing here: the Triton kernel's arrival counters for routing a large router in its own launch (left zero).
    """
    return compose_add_rms_norm_route(fused_add_rms_norm, F.linear, route_topk, x, residual, norm_weight, eps,
                                      router_weight, top_k, renormalize, expert_load, token_valid, logits_out)


def compose_qk_norm_rotary_write(norm, rotary, query, key, value, cos, sin, key_cache=None, value_cache=None,
                                 slots=None, q_norm_weight=None, k_norm_weight=None, eps=1e-6, clip=None, flags=None,
                                 key_copy=None, value_copy=None, *, stage=None):
    """qk_norm_rotary_write from its parts (the reference's rms_norm / apply_rotary_qk / stage_decode_tokens, or
    ops.dispatch's); `stage` (the checked write) defaults to ops.reference.lowbit.stage_decode_tokens."""
    num_tokens, num_q, head_dim = query.shape
    num_kv = key.shape[1]
    full = q_norm_weight is not None and q_norm_weight.numel() != head_dim
    if full:
        query = norm(query.reshape(num_tokens, num_q * head_dim), q_norm_weight, eps).reshape(query.shape)
        key = norm(key.reshape(num_tokens, num_kv * head_dim), k_norm_weight, eps).reshape(key.shape)
    if clip is not None:
        query, key, value = (t.clamp(-clip, clip) for t in (query, key, value))
    if q_norm_weight is not None and not full:
        query = norm(query, q_norm_weight, eps)                                        # [T, Hq, D]
        key = norm(key, k_norm_weight, eps)                                            # [T, Hkv, D]
    query, key = rotary(query, key, cos, sin)
    if flags is not None:
        if key_cache is None or key_copy is None or value_copy is None:
            raise ValueError("the checked write (flags) needs key / value rows, slots and key_copy / value_copy")
        stage = stage_decode_tokens if stage is None else stage
        # rounded to the rows' dtype first: what is checked is what is stored; rows [S, Hkv, D] as [S, 1, Hkv, D]
        stage(key.to(key_cache.dtype), value.to(value_cache.dtype), key_cache.unsqueeze(1), value_cache.unsqueeze(1),
              slots, flags, key_copy, value_copy)
    elif key_cache is not None:
        key_cache.index_copy_(0, slots, key.to(key_cache.dtype))
        value_cache.index_copy_(0, slots, value.to(value_cache.dtype))
    return query, key


def qk_norm_rotary_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, key_cache: torch.Tensor | None = None,
                         value_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                         q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                         eps: float = 1e-6, clip: float | None = None, flags: torch.Tensor | None = None,
                         key_copy: torch.Tensor | None = None, value_copy: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key / value [T, Hkv, D] (views of a fused qkv projection) -> (rotated query, rotated
    key), new tensors; with key_cache / value_cache [S, Hkv, D] and slots [T] int64 also writes the rotated
    key and the (clipped) value of token t to row slots[t] of the caches (the full-precision cache's write;
    without a cache the value is not needed and not returned).

    Checked write (flags [T] bool, key_copy / value_copy [T, Hkv, D] of the caches' dtype; kvcache.base.
    FusedWriteTarget): the rotated key and the value are rounded to the caches' dtype, then written as
    ops.reference.lowbit.stage_decode_tokens writes them -- a token with a NaN / Inf anywhere in its key or
    value rows sets flags[t] (never clears it) and is written as zeros, both rows; the rows as written also go
    to key_copy[t] / value_copy[t]. The returned key stays the rotated key as computed.

    In the attention layer's order: q/k norm over the whole projection (a weight of Hq*D / Hkv*D values, OLMoE),
    then clipping of q, k and v to +-clip, then the per-head norm (a weight of D values, Qwen3-MoE), then rotary.
    A norm weight of D values with one head is both (the same math).
    """
    return compose_qk_norm_rotary_write(rms_norm, apply_rotary_qk, query, key, value, cos, sin, key_cache,
                                        value_cache, slots, q_norm_weight, k_norm_weight, eps, clip, flags, key_copy,
                                        value_copy)

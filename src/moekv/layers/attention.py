"""Grouped-query self-attention with RoPE and optional q/k RMSNorm; the KV cache does the rest.

The layer projects, normalises, clips and rotates, then hands q [T, Hq, D] and the new tokens'
k/v [T, Hkv, D] to `kv_cache.attention(layer, ...)`. It never reads or writes pages itself, so a
low-bit page format or a Triton kernel slots in without touching this file. With the fused decode
layer on (KernelConfig.fused_decode_layer) the norm / clip / rotary steps are one launch, and a format
that offers a `fused_write_target` (full precision: its page rows, every step; low-bit: its staging rows
with the non-finite check, decode steps prepared by begin_step) gets its keys and values written by that
same launch, then `attention_prewritten`; the rows are the format's to name, not the layer's. Forward hooks
on q_norm / k_norm (their outputs must exist) keep the unfused path and `attention`.
"""

from __future__ import annotations

import torch
from torch import nn

from moekv.config import ArchConfig
from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import KVCache
from moekv.layers.linear import Linear, has_forward_hooks
from moekv.layers.norm import RMSNorm
from moekv.layers.rotary import apply_rotary_qk
from moekv.ops import dispatch


class Attention(nn.Module):
    """q, k and v come from one fused projection qkv_proj [(Hq + 2 Hkv) * D, hidden].

    qk_norm "head" (Qwen3-MoE): RMSNorm over each head's D values, weight [D].
    qk_norm "full" (OLMoE): RMSNorm over the whole q (Hq*D) and k (Hkv*D) projections.
    """

    def __init__(self, arch: ArchConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim ** -0.5
        self.clip_qkv = arch.clip_qkv
        self.qk_norm = arch.qk_norm
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, arch.attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, arch.hidden_size, arch.attention_out_bias, dtype, device)
        if arch.qk_norm == "head":
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device)
        elif arch.qk_norm == "full":
            self.q_norm = RMSNorm(self.q_size, arch.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.kv_size, arch.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden]; cos/sin [T, D] -> [T, hidden]."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)                                               # [T, (Hq+2Hkv)*D]
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if dispatch.fused_decode_layer() and not has_forward_hooks(self.q_norm, self.k_norm):
            target = kv_cache.fused_write_target(self.layer_idx, meta)
            if target is not None or (self.qk_norm is not None and self.clip_qkv is None):
                return self._forward_fused(query, key, value, cos, sin, kv_cache, meta, target)
        if self.qk_norm == "full":
            query = self.q_norm(query)                                            # [T, Hq*D]
            key = self.k_norm(key)                                                # [T, Hkv*D]
        if self.clip_qkv is not None:
            query = query.clamp(-self.clip_qkv, self.clip_qkv)
            key = key.clamp(-self.clip_qkv, self.clip_qkv)
            value = value.clamp(-self.clip_qkv, self.clip_qkv)
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)          # [T, Hq, D]
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)           # [T, Hkv, D]
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)       # [T, Hkv, D]
        if self.qk_norm == "head":
            query = self.q_norm(query)                                            # [T, Hq, D]
            key = self.k_norm(key)                                                # [T, Hkv, D]
        query, key = apply_rotary_qk(query, key, cos, sin)                        # [T, Hq, D], [T, Hkv, D]
        out = kv_cache.attention(self.layer_idx, query, key, value, meta, self.scale)   # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))                  # [T, hidden]

    def _forward_fused(self, query, key, value, cos, sin, kv_cache, meta, target):
        """The same math with q/k norm, clipping, rotary and (target: the cache's rows) the KV write in one
        launch (ops.dispatch.qk_norm_rotary_write); without a target the cache stores k / v itself."""
        num_tokens = query.shape[0]
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)          # [T, Hq, D] (views)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)           # [T, Hkv, D]
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)       # [T, Hkv, D]
        norms = {} if self.q_norm is None else dict(q_norm_weight=self.q_norm.weight,
                                                    k_norm_weight=self.k_norm.weight, eps=self.q_norm.eps)
        write = {} if target is None else dict(
            key_cache=target.key_rows, value_cache=target.value_rows, slots=target.slots, flags=target.flags,
            key_copy=target.key_copy, value_copy=target.value_copy)     # flags None: the plain write
        query, key = dispatch.qk_norm_rotary_write(query, key, value, cos, sin, clip=self.clip_qkv, **norms,
                                                   **write)             # [T, Hq, D], [T, Hkv, D]
        if target is not None:
            out = kv_cache.attention_prewritten(self.layer_idx, query, meta, self.scale)   # [T, Hq, D]
        else:
            out = kv_cache.attention(self.layer_idx, query, key, value, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))                  # [T, hidden]

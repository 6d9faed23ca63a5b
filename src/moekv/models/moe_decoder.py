"""The MoE decoder shared by Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

    input_ids [T] -> embed -> L x (norm -> attention -> +residual -> norm -> MoE | dense MLP -> +residual)
    -> final norm -> hidden [T, H];  compute_logits(hidden [N, H]) -> [N, V] float32

Tokens of all sequences of a step are flattened into T; `positions` gives each token's absolute
position in its own sequence and `meta` (built by the engine) tells the KV cache where each
sequence's pages are. Per-architecture differences are ArchConfig flags.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.config import ArchConfig
from moekv.kvcache.base import AttentionMetadata, KVCache
from moekv.layers.attention import Attention
from moekv.layers.linear import Embedding, Linear
from moekv.layers.moe import DenseMLP, MoEBlock
from moekv.layers.norm import RMSNorm
from moekv.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = arch.is_moe_layer(layer_idx)
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.attn = Attention(arch, layer_idx, dtype, device)
        self.post_attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        if self.is_moe:
            self.mlp: nn.Module = MoEBlock(arch, layer_idx, dtype, device)
        else:
            self.mlp = DenseMLP(arch.hidden_size, arch.dense_intermediate_size, dtype, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, expert_load: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; expert_load [E] is this layer's row of the model's counter."""
        hidden = hidden + self.attn(self.input_norm(hidden), cos, sin, kv_cache, meta)   # [T, H]
        normed = self.post_attn_norm(hidden)                                              # [T, H]
        if self.is_moe:
            return hidden + self.mlp(normed, expert_load, meta.token_valid)               # [T, H]
        return hidden + self.mlp(normed)                                                  # [T, H]


class MoEForCausalLM(nn.Module):
    """A decoder-only MoE language model; parameters start empty (see models.loader to fill them).

    expert_load [num_layers, num_experts] int64 counts routed token-slots per expert since the last
    reset_expert_load(), accumulated on the device without host synchronisation (dense layers: 0).
    """

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, device)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, dtype, device) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, False,
                                                                    dtype, device)
        self.register_buffer("expert_load", torch.zeros(arch.num_layers, arch.num_experts, dtype=torch.int64,
                                                        device=device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> final hidden states [T, H] (after the final norm)."""
        hidden = self.embed_tokens(input_ids)                                    # [T, H]
        cos, sin = self.rotary(positions, hidden.dtype)                          # [T, D] each
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, kv_cache, meta, self.expert_load[layer.layer_idx])   # [T, H]
        return self.norm(hidden)                                                 # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight   # [V, H]
        return F.linear(hidden, weight).float()                                  # [N, V]

    def reset_expert_load(self) -> None:
        self.expert_load.zero_()

"""The MoE decoder shared by Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

    input_ids [T] -> embed -> L x (norm -> attention -> +residual -> norm -> MoE | dense MLP -> +residual)
    -> final norm -> hidden [T, H];  compute_logits(hidden [N, H]) -> [N, V] float32

Each "+residual -> norm" is one fused op (RMSNorm.add_norm: one Triton kernel on CUDA): a layer
returns its MLP output and the running residual, and the next layer's input norm (or the final
norm) adds them. The sums are rounded to the model dtype exactly where `hidden = hidden + out` did.
In an MoE layer at decode sizes the post-attention add + norm also computes the router logits and the
top-k in the same launch (MoEBlock.add_norm_forward), and the attention's q/k norm + rotary writes the
full-precision KV cache (Attention._forward_fused): KernelConfig.fused_decode_layer, docs/moe-kernels.md
"Kernels per decode layer". With KernelConfig.fused_moe_combine an MoE layer on the decode kernels returns its
routed output un-combined (layers.experts.UncombinedOutput) and the next norm sums it in its own launch.

Tokens of all sequences of a step are flattened into T; `positions` gives each token's absolute
position in its own sequence and `meta` (built by the engine) tells the KV cache where each
sequence's pages are. Per-architecture differences are ArchConfig flags.
"""

from __future__ import annotations

import torch
from torch import nn

from moekv.config import ArchConfig
from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import KVCache
from moekv.layers.attention import Attention
from moekv.layers.experts import UncombinedOutput, combined
from moekv.layers.linear import Embedding, Linear, has_forward_hooks
from moekv.layers.moe import DenseMLP, MoEBlock
from moekv.layers.norm import RMSNorm
from moekv.layers.rotary import RotaryEmbedding
from moekv.ops import dispatch


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
        """hidden [T, H] -> [T, H]; expert_load [E] is this layer's row of the model's counter. The
        whole output hidden state (what forward hooks on a layer see); the model itself runs
        forward_residual, which leaves the last residual add to the next norm."""
        mlp_out, residual = self.forward_residual(hidden, None, cos, sin, kv_cache, meta, expert_load)
        return residual + mlp_out                                                         # [T, H]

    def forward_residual(self, hidden: torch.Tensor | UncombinedOutput, residual: torch.Tensor | None,
                         cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                         expert_load: torch.Tensor, defer_combine: bool = False
                         ) -> tuple[torch.Tensor | UncombinedOutput, torch.Tensor]:
        """-> (mlp_out [T, H], residual [T, H]); this layer's output hidden state is residual + mlp_out
        (added by the next norm). hidden [T, H]: the previous layer's mlp_out, or with residual None
        the layer's input itself (the embedding). expert_load [E]: this layer's row of the counter.
        defer_combine: an MoE layer may return mlp_out as an UncombinedOutput (RMSNorm.add_norm sums it)."""
        if residual is None:
            residual = hidden                                                             # [T, H]
            normed = self.input_norm(hidden)                                              # [T, H]
        else:
            normed, residual = self.input_norm.add_norm(hidden, residual)                 # [T, H] x2
        attn_out = self.attn(normed, cos, sin, kv_cache, meta)                            # [T, H]
        if self.is_moe:                     # add + norm + router + top-k in one launch where it applies
            fused = self.mlp.add_norm_forward(attn_out, residual, self.post_attn_norm, expert_load, meta.token_valid,
                                              defer_combine)
            if fused is not None:
                return fused                                                              # [T, H] x2
        normed, residual = self.post_attn_norm.add_norm(attn_out, residual)               # [T, H] x2
        if self.is_moe:
            defer = defer_combine and not has_forward_hooks(self.mlp)                     # hooks see a tensor
            return self.mlp(normed, expert_load, meta.token_valid, defer_combine=defer), residual   # [T, H]
        return self.mlp(normed), residual                                                 # [T, H]


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
        residual = None
        defer = dispatch.fused_moe_combine()     # MoE layers may leave their combine to the next norm
        for layer in self.layers:
            load = self.expert_load[layer.layer_idx]                             # [E]
            if layer._forward_hooks or layer._forward_pre_hooks:                 # hooks see whole hidden states
                if residual is not None:
                    hidden, residual = residual + combined(hidden), None         # [T, H]
                hidden = layer(hidden, cos, sin, kv_cache, meta, load)           # [T, H]
            else:
                hidden, residual = layer.forward_residual(hidden, residual, cos, sin, kv_cache, meta,
                                                          load, defer)           # [T, H] x2
        if residual is None:                                                     # no layers
            return self.norm(hidden)                                             # [T, H]
        return self.norm.add_norm(hidden, residual)[0]                           # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight   # [V, H]
        return dispatch.skinny_linear(hidden, weight).float()                   # [N, V] (F.linear unless the skinny GEMM is on)

    def reset_expert_load(self) -> None:
        self.expert_load.zero_()

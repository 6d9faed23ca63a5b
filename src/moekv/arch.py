"""The architecture record of a checkpoint (ArchConfig): what a model *is*, normalised from the Hugging Face
config spellings (models/hf_config.py builds it). The user-facing switches live in config.py, which re-exports
this class."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moekv.errors import ConfigError


@dataclass(frozen=True)
class ArchConfig:
    """The architecture of a checkpoint, normalised from any of the Hugging Face config spellings.

    One dataclass describes all supported MoE decoders; per-architecture differences are flags.
    """

    architecture: str                   # "mixtral" | "qwen2_moe" | "qwen3_moe" | "olmoe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool                # renormalise the top-k routing weights to sum to 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False        # bias on q/k/v projections (Qwen2-MoE; Qwen3-MoE/OLMoE if configured)
    attention_out_bias: bool = False    # bias on the output projection o_proj (Qwen3-MoE/OLMoE attention_bias)
    clip_qkv: float | None = None       # OLMoE: clamp q, k, v to [-clip_qkv, clip_qkv] after the q/k norm
    qk_norm: str = "none"               # "none" | "head" (RMSNorm over head_dim, Qwen3) | "full" (over all heads, OLMoE)
    shared_expert_intermediate_size: int = 0   # 0: no shared expert (Qwen2-MoE has one, with a sigmoid gate)
    dense_layers: tuple[int, ...] = ()  # layers that use a dense MLP instead of experts
    dense_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None # "bf16" | "fp16" | "fp32" as config.json states it; None if absent
    weight_quantization: str | None = None   # "fp8": config.json's quantization_config (quant_method "fp8")
    weight_block_size: tuple[int, int] | None = None   # its weight_block_size (block-wise scales), else None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "num_experts", "top_k", "expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.top_k > self.num_experts:
            raise ConfigError(f"model config: num_experts_per_tok ({self.top_k}) exceeds the number of experts "
                              f"({self.num_experts})")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ConfigError(f"model config: clip_qkv must be positive or None, got {self.clip_qkv!r}")
        if self.checkpoint_dtype not in (None, "bf16", "fp16", "fp32"):
            raise ConfigError(f"model config: checkpoint_dtype must be bf16, fp16, fp32 or None, "
                              f"got {self.checkpoint_dtype!r}")
        if self.qk_norm not in ("none", "head", "full"):
            raise ConfigError(f"model config: qk_norm must be none, head or full, got {self.qk_norm!r}")
        if self.weight_quantization not in (None, "fp8"):
            raise ConfigError(f"model config: weight_quantization must be fp8 or None, got {self.weight_quantization!r}")
        block = self.weight_block_size
        if block is not None and not (isinstance(block, tuple) and len(block) == 2
                                      and all(isinstance(b, int) and b >= 1 for b in block)):
            raise ConfigError(f"model config: weight_block_size must be two positive integers, got {block!r}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

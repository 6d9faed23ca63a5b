"""Which checkpoints moekv runs, and named architecture shapes for random-weight benchmarks.

All supported families share one decoder (models.moe_decoder); their differences are ArchConfig
flags filled by models.hf_config. Imports of the model code are lazy.
"""

from __future__ import annotations

from typing import Any

from moekv.config import ArchConfig
from moekv.errors import UnsupportedModelError

# Hugging Face `architectures` entry -> moekv family name.
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
# Hugging Face `model_type` -> family (used when `architectures` is absent or names no supported class).
MODEL_TYPES = {family: family for family in ARCHITECTURES.values()}


def resolve_architecture(hf_config: dict[str, Any], source: str = "config.json") -> str:
    """The moekv family of a Hugging Face config dict; UnsupportedModelError if none applies."""
    names = hf_config.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = hf_config.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    found = f"architectures={list(names)!r}, model_type={model_type!r}"
    supported = ", ".join(sorted(ARCHITECTURES))
    raise UnsupportedModelError(f"{source}: unsupported model ({found}); moekv supports {supported}")


def model_class(architecture: str):
    """The nn.Module class that implements a family (all share MoEForCausalLM today)."""
    if architecture not in MODEL_TYPES:
        raise UnsupportedModelError(f"no model class for architecture {architecture!r}; "
                                    f"supported: {', '.join(sorted(MODEL_TYPES))}")
    from moekv.models.moe_decoder import MoEForCausalLM

    return MoEForCausalLM


# Public shapes of well-known checkpoints, for build_random_model (benchmarks without weights).
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(
        architecture="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=14336,
        norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768),
    "qwen1.5-moe-a2.7b": dict(
        architecture="qwen2_moe", vocab_size=151936, hidden_size=2048, num_layers=24, num_heads=16,
        num_kv_heads=16, head_dim=128, num_experts=60, top_k=4, expert_intermediate_size=1408,
        norm_topk_prob=False, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192,
        attention_bias=True, shared_expert_intermediate_size=5632),
    "qwen3-30b-a3b": dict(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, num_experts=128, top_k=8, expert_intermediate_size=768,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        qk_norm="head"),
    "olmoe-1b-7b": dict(
        architecture="olmoe", vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16,
        num_kv_heads=16, head_dim=128, num_experts=64, top_k=8, expert_intermediate_size=1024,
        norm_topk_prob=False, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        qk_norm="full"),
}


def named_arch(name: str, **overrides: Any) -> ArchConfig:
    """ArchConfig of a named shape (e.g. "mixtral-8x7b"), fields optionally overridden (num_layers=2)."""
    if name not in NAMED_SHAPES:
        raise UnsupportedModelError(f"unknown model shape {name!r}; known: {', '.join(sorted(NAMED_SHAPES))}")
    return ArchConfig(**{**NAMED_SHAPES[name], **overrides})

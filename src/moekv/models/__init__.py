"""Model runtime: Hugging Face config reading, safetensors loading, and the MoE decoder."""

from moekv.models.hf_config import read_arch_config
from moekv.models.loader import build_random_model, load_model
from moekv.models.moe_decoder import MoEForCausalLM
from moekv.models.registry import NAMED_SHAPES, named_arch

__all__ = ["read_arch_config", "load_model", "build_random_model", "MoEForCausalLM", "NAMED_SHAPES",
           "named_arch"]

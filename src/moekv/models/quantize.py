"""FP8 weights for a built model: which modules take them, and quantizing a 16-bit model at load time.

The projections and the routed experts hold FP8 (moekv.core.fp8: float8_e4m3fn codes + fp32 scales; W8A16):
every layer's fused qkv and o projections, its routed experts (LocalExperts), a shared expert's and a dense
layer's MLP. The embedding, the norms, the router, the shared-expert gate and the logits head stay 16-bit,
as in the FP8 checkpoints of DeepSeek-V3, Qwen3 and Mixtral (the router's top-k is sensitive and small).
"""

from __future__ import annotations

from typing import Iterator

from torch import nn

from moekv.layers.experts import LocalExperts
from moekv.layers.moe import DenseMLP, MoEBlock


def fp8_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The Linear and LocalExperts modules of a MoEForCausalLM that may hold FP8 weights."""
    for layer in model.layers:
        yield from fp8_layer_modules(layer)


def fp8_layer_modules(layer: nn.Module) -> Iterator[nn.Module]:
    """Those of one decoder layer."""
    yield layer.attn.qkv_proj
    yield layer.attn.o_proj
    mlp = layer.mlp
    if isinstance(mlp, MoEBlock):
        if isinstance(mlp.experts, LocalExperts):
            yield mlp.experts
        if mlp.shared_expert is not None:
            yield mlp.shared_expert.gate_up_proj
            yield mlp.shared_expert.down_proj
    elif isinstance(mlp, DenseMLP):
        yield mlp.gate_up_proj
        yield mlp.down_proj


def quantize_model(model: nn.Module) -> nn.Module:
    """Quantize every 16-bit FP8-capable module per output channel (modules already FP8 are kept); in place."""
    for layer in model.layers:
        quantize_layer(layer)
    return model


def quantize_layer(layer: nn.Module) -> None:
    """quantize_model for one decoder layer (the loader runs it as each layer has loaded)."""
    for module in fp8_layer_modules(layer):
        if not module.quantized:
            module.to_fp8()


def is_quantized(model: nn.Module) -> bool:
    """Whether any module of the model holds FP8 weights."""
    return any(module.quantized for module in fp8_modules(model))

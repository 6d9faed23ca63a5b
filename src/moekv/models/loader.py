"""Build a MoEForCausalLM from a Hugging Face checkpoint folder, or with random weights.

Checkpoint tensor names -> moekv parameters (per layer `model.layers.{i}.`):
  self_attn.{q,k,v}_proj.{weight,bias}  -> attn.qkv_proj (concatenated on the output dim)
  self_attn.o_proj, self_attn.{q,k}_norm -> attn.o_proj, attn.{q,k}_norm
  {mlp|block_sparse_moe}.gate.weight     -> mlp.router.weight [E, H]
  experts, fused (transformers 5 in memory): experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
  experts, per expert (what checkpoints on disk hold): experts.{e}.{gate_proj,up_proj,down_proj}.weight
           or Mixtral's experts.{e}.{w1,w3,w2}.weight               -> mlp.experts.w_gate_up [E, 2I, H], mlp.experts.w_down [E, H, I]
  mlp.shared_expert.*, mlp.shared_expert_gate (Qwen2-MoE)            -> mlp.shared_expert (gate|up fused)
  mlp.{gate,up,down}_proj (dense layers)                             -> mlp.gate_up_proj, mlp.down_proj
FP8 checkpoints (config.json quantization_config, quant_method "fp8"): the projections and experts whose
tensors are float8_e4m3fn stay FP8 with their scales (block-wise `weight_scale_inv`, or per-tensor /
per-channel `weight_scale`; models.checkpoint); any other FP8 tensor (e.g. a router) is dequantized.
quantization="fp8" quantizes the remaining 16-bit projections and experts per output channel (models.quantize),
each decoder layer as soon as it has loaded.

Memory: the model is built inside layers.linear.deferred_parameters() (parameters on the meta device), and each
parameter gets its storage on the target device just before its tensors are copied; an FP8 projection or expert
receives its codes and scales directly. So loading an FP8 checkpoint never allocates the 16-bit model, and
quantizing at load holds at most one layer's 16-bit projections next to the FP8 ones.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moekv.config import ArchConfig, canonical_model_dtype, canonical_quantization, torch_dtype
from moekv.core.fp8 import Fp8Weight, concat_rows
from moekv.errors import ConfigError
from moekv.layers.linear import Linear, deferred_parameters, materialize
from moekv.layers.moe import DenseMLP, MoEBlock
from moekv.layers.norm import RMSNorm
from moekv.models.checkpoint import CheckpointReader
from moekv.models.hf_config import read_arch_config
from moekv.models.moe_decoder import DecoderLayer, MoEForCausalLM
from moekv.models.quantize import quantize_layer, quantize_model
from moekv.models.registry import model_class

_PROGRESS_BYTES = 1 << 30        # show a progress bar for checkpoints of 1 GiB or more ...
_PROGRESS_SHARDED_BYTES = 100 << 20   # ... or sharded ones of 100 MiB or more
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Per-expert tensor names: (gate, up, down) in the transformers layout, then Mixtral's original one.
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def load_model(model_dir: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               max_model_len: int | None = None, progress: bool | None = None,
               quantization: str | None = None) -> MoEForCausalLM:
    """Load a checkpoint folder (config.json + safetensors) into a MoEForCausalLM on `device`.

    dtype: None (or "auto") = the checkpoint's dtype from config.json, bf16 when it names none.
    max_model_len: the longest sequence to run (lets a sliding-window checkpoint load; see hf_config).
    progress: force the tqdm bar on or off; None shows it for large checkpoints only.
    quantization: None (weights as stored: an FP8 checkpoint's FP8 tensors stay FP8) or "fp8" (also quantize
    the 16-bit projections and experts per output channel).
    """
    quantization = canonical_quantization(quantization)
    arch = read_arch_config(model_dir, max_model_len=max_model_len)
    dtype = _resolve_dtype(dtype, arch)
    device = _resolve_device(device)
    with CheckpointReader(model_dir, fp8_block=arch.weight_block_size) as reader:
        with deferred_parameters():              # parameters get storage only as they load (FP8: never 16-bit)
            model = model_class(arch.architecture)(arch, dtype=dtype, device=device)
        if progress is None:
            progress = reader.total_bytes >= _PROGRESS_BYTES or (
                len(reader.files) > 1 and reader.total_bytes >= _PROGRESS_SHARDED_BYTES)
        with torch.no_grad(), tqdm(total=len(reader.keys()), desc="loading weights", unit="tensor",
                                   disable=not progress) as bar:
            _WeightCopier(reader, bar, device, quantize=quantization == "fp8").load(model)
        unloaded = [name for name, param in model.named_parameters() if param.is_meta]
        if unloaded:
            raise ConfigError(f"{model_dir}: no checkpoint tensor was loaded into {', '.join(unloaded[:5])}")
        ignored = [key for key in reader.unused_keys() if not key.endswith(_IGNORED_SUFFIXES)
                   and not (arch.tie_word_embeddings and key == "lm_head.weight")
                   and 0 not in reader.shape(key)]
        if ignored:
            shown = ", ".join(ignored[:5]) + (", ..." if len(ignored) > 5 else "")
            warnings.warn(f"{model_dir}: ignored {len(ignored)} checkpoint tensor(s) moekv does not use: {shown}",
                          RuntimeWarning, stacklevel=2)
    return model.eval()


def build_random_model(arch: ArchConfig, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                       seed: int = 0, quantization: str | None = None) -> MoEForCausalLM:
    """A model with random weights and no checkpoint (benchmarks of named shapes, tests).

    Weights ~ N(0, 0.02), RMSNorm weights 1, biases 0; deterministic for a given seed and device.
    quantization "fp8": then quantized as load_model(quantization="fp8") does (per output channel).
    """
    quantization = canonical_quantization(quantization)
    device = _resolve_device(device)
    model = model_class(arch.architecture)(arch, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in norm_weights:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
        if quantization == "fp8":
            quantize_model(model)
    return model.eval()


def _resolve_dtype(dtype: torch.dtype | str | None, arch: ArchConfig) -> torch.dtype:
    if isinstance(dtype, str):
        name = canonical_model_dtype(dtype)
        dtype = None if name == "auto" else torch_dtype(name)
    if dtype is None:
        return torch_dtype(arch.checkpoint_dtype or "bf16")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"model dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype


def _resolve_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device} was asked for but CUDA is not available")
    return device


class _WeightCopier:
    """Copies checkpoint tensors into a model's parameters, checking every shape. The model was built inside
    deferred_parameters(): a parameter gets its storage on `device` just before its tensors are copied, an FP8
    one is replaced by its codes and scales (its 16-bit form is never allocated). quantize: each decoder layer
    is quantized to FP8 as soon as it has loaded (at most one layer's 16-bit projections exist at a time)."""

    def __init__(self, reader: CheckpointReader, bar, device: torch.device, quantize: bool = False):
        self.reader = reader
        self.bar = bar
        self.device = device
        self.quantize = quantize

    def copy(self, target: torch.Tensor, key: str) -> None:
        target.copy_(self.reader.get(key, tuple(target.shape)))
        self.bar.update(1)

    def copy_param(self, module: torch.nn.Module, name: str, key: str) -> None:
        self.copy(materialize(module, name, self.device), key)

    def load(self, model: MoEForCausalLM) -> None:
        self.copy_param(model.embed_tokens, "weight", "model.embed_tokens.weight")
        for layer in model.layers:
            self.load_layer(layer, f"model.layers.{layer.layer_idx}.")
            if self.quantize:
                quantize_layer(layer)
        self.copy_param(model.norm, "weight", "model.norm.weight")
        if model.lm_head is not None:
            self.copy_param(model.lm_head, "weight", "lm_head.weight")

    def load_layer(self, layer: DecoderLayer, prefix: str) -> None:
        self.copy_param(layer.input_norm, "weight", prefix + "input_layernorm.weight")
        self.copy_param(layer.post_attn_norm, "weight", prefix + "post_attention_layernorm.weight")
        attn = layer.attn
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        self.load_linear(attn.qkv_proj, [f"{prefix}self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj")],
                         sizes)
        if attn.qkv_proj.bias is not None:
            bias = materialize(attn.qkv_proj, "bias", self.device)
            for part, name in zip(bias.split(sizes, dim=0), ("q_proj", "k_proj", "v_proj")):
                self.copy(part, f"{prefix}self_attn.{name}.bias")
        self.load_linear(attn.o_proj, [prefix + "self_attn.o_proj.weight"])
        if attn.o_proj.bias is not None:
            self.copy_param(attn.o_proj, "bias", prefix + "self_attn.o_proj.bias")
        if attn.q_norm is not None:
            self.copy_param(attn.q_norm, "weight", prefix + "self_attn.q_norm.weight")
            self.copy_param(attn.k_norm, "weight", prefix + "self_attn.k_norm.weight")
        if isinstance(layer.mlp, MoEBlock):
            self.load_moe(layer.mlp, prefix)
        else:
            self.load_dense(layer.mlp, prefix + "mlp.")

    def load_linear(self, linear: Linear, keys: list[str], sizes: list[int] | None = None) -> None:
        """A linear layer's weight from checkpoint tensors stacked along the output dim (q|k|v, gate|up; sizes:
        their rows, None: equal parts); kept FP8 when all of them are FP8."""
        sizes = sizes or [linear.out_features // len(keys)] * len(keys)
        if all(self.reader.is_fp8(key) for key in keys):
            linear.to_fp8(concat_rows([self.reader.get_fp8(key, (rows, linear.in_features))
                                       for key, rows in zip(keys, sizes)]), device=self.device)
            self.bar.update(len(keys))
            return
        for part, key in zip(materialize(linear, "weight", self.device).split(sizes, dim=0), keys):
            self.copy(part, key)

    def load_dense(self, mlp: DenseMLP, prefix: str) -> None:
        self.load_linear(mlp.gate_up_proj, [prefix + "gate_proj.weight", prefix + "up_proj.weight"])
        self.load_linear(mlp.down_proj, [prefix + "down_proj.weight"])

    def load_moe(self, moe: MoEBlock, layer_prefix: str) -> None:
        # transformers 5 renames Mixtral's `block_sparse_moe` to `mlp`; accept both.
        prefix = layer_prefix + "mlp."
        if not self.reader.has(prefix + "gate.weight") and self.reader.has(layer_prefix + "block_sparse_moe.gate.weight"):
            prefix = layer_prefix + "block_sparse_moe."
        self.copy_param(moe.router, "weight", prefix + "gate.weight")
        if self.load_fp8_experts(moe, prefix):
            pass
        elif self.reader.has(prefix + "experts.gate_up_proj"):
            self.copy_param(moe.experts, "w_gate_up", prefix + "experts.gate_up_proj")
            self.copy_param(moe.experts, "w_down", prefix + "experts.down_proj")
        else:
            gate_name, up_name, down_name = next(
                (names for names in _PER_EXPERT_NAMES if self.reader.has(f"{prefix}experts.0.{names[0]}.weight")),
                _PER_EXPERT_NAMES[0])   # neither present: the copy below reports the transformers name missing
            w_gate_up = materialize(moe.experts, "w_gate_up", self.device)
            w_down = materialize(moe.experts, "w_down", self.device)
            for expert in range(moe.num_experts):
                gate, up = w_gate_up[expert].chunk(2, dim=0)                           # [I, H] each
                self.copy(gate, f"{prefix}experts.{expert}.{gate_name}.weight")
                self.copy(up, f"{prefix}experts.{expert}.{up_name}.weight")
                self.copy(w_down[expert], f"{prefix}experts.{expert}.{down_name}.weight")
        if moe.shared_expert is not None:
            self.load_dense(moe.shared_expert, prefix + "shared_expert.")
            self.copy_param(moe.shared_expert_gate, "weight", prefix + "shared_expert_gate.weight")

    def load_fp8_experts(self, moe: MoEBlock, prefix: str) -> bool:
        """The routed experts as FP8 when the checkpoint holds them so (fused or per-expert tensors); False
        when it does not (they load as 16-bit tensors)."""
        experts = moe.experts
        gate_up_shape, down_shape = tuple(experts.w_gate_up.shape), tuple(experts.w_down.shape)
        if self.reader.is_fp8(prefix + "experts.gate_up_proj"):
            experts.to_fp8(self.reader.get_fp8(prefix + "experts.gate_up_proj", gate_up_shape),
                           self.reader.get_fp8(prefix + "experts.down_proj", down_shape), device=self.device)
            self.bar.update(2)
            return True
        names = next((names for names in _PER_EXPERT_NAMES if self.reader.has(f"{prefix}experts.0.{names[0]}.weight")),
                     None)
        if names is None or not self.reader.is_fp8(f"{prefix}experts.0.{names[0]}.weight"):
            return False
        inter, hidden = gate_up_shape[1] // 2, gate_up_shape[2]
        gate_ups, downs = [], []
        for expert in range(moe.num_experts):
            key = f"{prefix}experts.{expert}."
            gate_ups.append(concat_rows([self.reader.get_fp8(key + names[0] + ".weight", (inter, hidden)),
                                         self.reader.get_fp8(key + names[1] + ".weight", (inter, hidden))]))
            downs.append(self.reader.get_fp8(key + names[2] + ".weight", down_shape[1:]))
            self.bar.update(3)
        experts.to_fp8(*(_stack(parts) for parts in (gate_ups, downs)), device=self.device)
        return True


def _stack(parts: list[Fp8Weight]) -> Fp8Weight:
    """Per-expert FP8 weights -> one [E, ...] FP8 weight (the experts' blocks must agree)."""
    blocks = {part.block for part in parts}
    if len(blocks) != 1:
        raise ConfigError(f"FP8 experts of one layer have different scale blocks {sorted(blocks)}")
    return Fp8Weight(torch.stack([p.codes for p in parts]), torch.stack([p.scale for p in parts]), parts[0].block)

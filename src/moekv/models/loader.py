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
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moekv.config import ArchConfig, canonical_model_dtype, torch_dtype
from moekv.errors import ConfigError
from moekv.layers.moe import DenseMLP, MoEBlock
from moekv.layers.norm import RMSNorm
from moekv.models.checkpoint import CheckpointReader
from moekv.models.hf_config import read_arch_config
from moekv.models.moe_decoder import DecoderLayer, MoEForCausalLM
from moekv.models.registry import model_class

_PROGRESS_BYTES = 1 << 30        # show a progress bar for checkpoints of 1 GiB or more ...
_PROGRESS_SHARDED_BYTES = 100 << 20   # ... or sharded ones of 100 MiB or more
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Per-expert tensor names: (gate, up, down) in the transformers layout, then Mixtral's original one.
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def load_model(model_dir: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               max_model_len: int | None = None, progress: bool | None = None) -> MoEForCausalLM:
    """Load a checkpoint folder (config.json + safetensors) into a MoEForCausalLM on `device`.

    dtype: None (or "auto") = the checkpoint's dtype from config.json, bf16 when it names none.
    max_model_len: the longest sequence to run (lets a sliding-window checkpoint load; see hf_config).
    progress: force the tqdm bar on or off; None shows it for large checkpoints only.
    """
    arch = read_arch_config(model_dir, max_model_len=max_model_len)
    dtype = _resolve_dtype(dtype, arch)
    device = _resolve_device(device)
    with CheckpointReader(model_dir) as reader:
        model = model_class(arch.architecture)(arch, dtype=dtype, device=device)
        if progress is None:
            progress = reader.total_bytes >= _PROGRESS_BYTES or (
                len(reader.files) > 1 and reader.total_bytes >= _PROGRESS_SHARDED_BYTES)
        with torch.no_grad(), tqdm(total=len(reader.keys()), desc="loading weights", unit="tensor",
                                   disable=not progress) as bar:
            _WeightCopier(reader, bar).load(model)
        ignored = [key for key in reader.unused_keys() if not key.endswith(_IGNORED_SUFFIXES)
                   and not (arch.tie_word_embeddings and key == "lm_head.weight")
                   and 0 not in reader.shape(key)]
        if ignored:
            shown = ", ".join(ignored[:5]) + (", ..." if len(ignored) > 5 else "")
            warnings.warn(f"{model_dir}: ignored {len(ignored)} checkpoint tensor(s) moekv does not use: {shown}",
                          RuntimeWarning, stacklevel=2)
    return model.eval()


def build_random_model(arch: ArchConfig, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                       seed: int = 0) -> MoEForCausalLM:
    """A model with random weights and no checkpoint (benchmarks of named shapes, tests).

    Weights ~ N(0, 0.02), RMSNorm weights 1, biases 0; deterministic for a given seed and device.
    """
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
    """Copies checkpoint tensors into a model's (empty) parameters, checking every shape."""

    def __init__(self, reader: CheckpointReader, bar):
        self.reader = reader
        self.bar = bar

    def copy(self, target: torch.Tensor, key: str) -> None:
        target.copy_(self.reader.get(key, tuple(target.shape)))
        self.bar.update(1)

    def load(self, model: MoEForCausalLM) -> None:
        self.copy(model.embed_tokens.weight, "model.embed_tokens.weight")
        for layer in model.layers:
            self.load_layer(layer, f"model.layers.{layer.layer_idx}.")
        self.copy(model.norm.weight, "model.norm.weight")
        if model.lm_head is not None:
            self.copy(model.lm_head.weight, "lm_head.weight")

    def load_layer(self, layer: DecoderLayer, prefix: str) -> None:
        self.copy(layer.input_norm.weight, prefix + "input_layernorm.weight")
        self.copy(layer.post_attn_norm.weight, prefix + "post_attention_layernorm.weight")
        attn = layer.attn
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        for part, name in zip(attn.qkv_proj.weight.split(sizes, dim=0), ("q_proj", "k_proj", "v_proj")):
            self.copy(part, f"{prefix}self_attn.{name}.weight")
        if attn.qkv_proj.bias is not None:
            for part, name in zip(attn.qkv_proj.bias.split(sizes, dim=0), ("q_proj", "k_proj", "v_proj")):
                self.copy(part, f"{prefix}self_attn.{name}.bias")
        self.copy(attn.o_proj.weight, prefix + "self_attn.o_proj.weight")
        if attn.o_proj.bias is not None:
            self.copy(attn.o_proj.bias, prefix + "self_attn.o_proj.bias")
        if attn.q_norm is not None:
            self.copy(attn.q_norm.weight, prefix + "self_attn.q_norm.weight")
            self.copy(attn.k_norm.weight, prefix + "self_attn.k_norm.weight")
        if isinstance(layer.mlp, MoEBlock):
            self.load_moe(layer.mlp, prefix)
        else:
            self.load_dense(layer.mlp, prefix + "mlp.")

    def load_dense(self, mlp: DenseMLP, prefix: str) -> None:
        gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)                     # [I, H] each
        self.copy(gate, prefix + "gate_proj.weight")
        self.copy(up, prefix + "up_proj.weight")
        self.copy(mlp.down_proj.weight, prefix + "down_proj.weight")

    def load_moe(self, moe: MoEBlock, layer_prefix: str) -> None:
        # transformers 5 renames Mixtral's `block_sparse_moe` to `mlp`; accept both.
        prefix = layer_prefix + "mlp."
        if not self.reader.has(prefix + "gate.weight") and self.reader.has(layer_prefix + "block_sparse_moe.gate.weight"):
            prefix = layer_prefix + "block_sparse_moe."
        self.copy(moe.router.weight, prefix + "gate.weight")
        if self.reader.has(prefix + "experts.gate_up_proj"):
            self.copy(moe.experts.w_gate_up, prefix + "experts.gate_up_proj")
            self.copy(moe.experts.w_down, prefix + "experts.down_proj")
        else:
            gate_name, up_name, down_name = next(
                (names for names in _PER_EXPERT_NAMES if self.reader.has(f"{prefix}experts.0.{names[0]}.weight")),
                _PER_EXPERT_NAMES[0])   # neither present: the copy below reports the transformers name missing
            for expert in range(moe.num_experts):
                gate, up = moe.experts.w_gate_up[expert].chunk(2, dim=0)               # [I, H] each
                self.copy(gate, f"{prefix}experts.{expert}.{gate_name}.weight")
                self.copy(up, f"{prefix}experts.{expert}.{up_name}.weight")
                self.copy(moe.experts.w_down[expert], f"{prefix}experts.{expert}.{down_name}.weight")
        if moe.shared_expert is not None:
            self.load_dense(moe.shared_expert, prefix + "shared_expert.")
            self.copy(moe.shared_expert_gate.weight, prefix + "shared_expert_gate.weight")

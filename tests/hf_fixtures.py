"""Tiny random Hugging Face MoE checkpoints built with transformers' own classes, plus greedy
drivers for moekv (through the paged KV cache) and for transformers (the reference).

Reusable by any test: `make_checkpoint(tmp_path, "qwen2_moe")` returns (folder, transformers model).
transformers is a test-only dependency; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def hf_config(family: str, *, vocab_size: int = 160, hidden_size: int = 64, num_layers: int = 2,
              num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None, num_experts: int = 4,
              top_k: int = 2, intermediate_size: int = 32, initializer_range: float = 0.1,
              max_position_embeddings: int = 256, **extra: Any):
    """A transformers config of `family` at toy size; `extra` passes family-specific fields
    (norm_topk_prob, shared_expert_intermediate_size, mlp_only_layers, decoder_sparse_step,
    attention_bias, clip_qkv, tie_word_embeddings, rope_theta, ...)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    for key in [k for k in extra if k in common]:      # e.g. eos_token_id=[2, 7]
        common[key] = extra.pop(key)
    if head_dim is not None:
        common["head_dim"] = head_dim
    if "rope_theta" in extra:
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": float(extra.pop("rope_theta"))}
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=intermediate_size,
                                          num_local_experts=num_experts, num_experts_per_tok=top_k, **extra)
    if family == "qwen2_moe":
        extra.setdefault("shared_expert_intermediate_size", 48)
        extra.setdefault("intermediate_size", 40)      # dense layers (mlp_only_layers / decoder_sparse_step)
        return transformers.Qwen2MoeConfig(**common, moe_intermediate_size=intermediate_size,
                                           num_experts=num_experts, num_experts_per_tok=top_k, **extra)
    if family == "qwen3_moe":
        extra.setdefault("intermediate_size", 40)
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=intermediate_size,
                                           num_experts=num_experts, num_experts_per_tok=top_k, **extra)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=intermediate_size, num_experts=num_experts,
                                        num_experts_per_tok=top_k, **extra)
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def build_hf_model(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The transformers *ForCausalLM of `config` with seeded random weights, in eval mode."""
    import transformers

    cls = {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM, "olmoe": transformers.OlmoeForCausalLM}[config.model_type]
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    return cls(config).to(dtype).eval()


def save_checkpoint(model, path: Path, layout: str = "per_expert", max_shard_size: str | int | None = None) -> Path:
    """Write `model` as a checkpoint folder.

    layout "per_expert": save_pretrained (transformers 5 writes one tensor per expert, e.g.
    `mlp.experts.{e}.gate_proj.weight`, and Mixtral's `block_sparse_moe.experts.{e}.w1.weight`).
    layout "fused": the in-memory transformers 5 names, `mlp.experts.gate_up_proj` [E, 2I, H] and
    `mlp.experts.down_proj` [E, H, I], in one model.safetensors.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if layout == "per_expert":
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(path, **kwargs)
    elif layout == "fused":
        if max_shard_size is not None:
            raise ValueError("the fused layout is written as a single file")
        state = {key: value.contiguous() for key, value in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.config.dtype = next(model.parameters()).dtype
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        raise ValueError(f"layout must be per_expert or fused, got {layout!r}")
    return path


def make_checkpoint(tmp_path: Path, family: str, layout: str = "per_expert", seed: int = 0,
                    dtype: torch.dtype = torch.float32, max_shard_size: str | int | None = None,
                    name: str = "ckpt", **config_kwargs: Any):
    """(checkpoint folder, transformers model) for a tiny random `family` model."""
    model = build_hf_model(hf_config(family, **config_kwargs), seed=seed, dtype=dtype)
    return save_checkpoint(model, Path(tmp_path) / name, layout, max_shard_size), model


# -- greedy drivers -------------------------------------------------------------------------------

@torch.no_grad()
def moekv_greedy(model, prompts: list[list[int]], max_new_tokens: int, page_size: int = 4,
                 prefill_chunk: int | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding of all prompts in ONE batch through KVCacheManager + FullPrecisionKVCache.

    Each step carries every unfinished sequence: its next prefill chunk (whole prompt when
    prefill_chunk is None) or its one decode token. Returns (generated tokens per prompt,
    logits per prompt [len(prompt) + max_new_tokens - 1, V] float32: one row for every token fed).
    """
    from moekv.core.attention_metadata import AttentionMetadata
    from moekv.kvcache.base import KVCacheSpec
    from moekv.kvcache.formats.full_precision import FullPrecisionKVCache
    from moekv.kvcache.manager import KVCacheManager, pages_needed

    arch, device = model.arch, model.device
    dtype = model.embed_tokens.weight.dtype
    spec = KVCacheSpec(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                       page_size=page_size, dtype=dtype)
    longest = max(len(p) for p in prompts) + max_new_tokens
    num_pages = len(prompts) * pages_needed(longest, page_size) + 1
    cache = FullPrecisionKVCache(spec, num_pages, device)
    manager = KVCacheManager(num_pages, page_size, on_pages_freed=cache.pages_freed)
    tokens = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    generated: list[list[int]] = [[] for _ in prompts]
    logits_rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    while True:
        batch = []                                                   # (seq, start, end)
        for seq, toks in enumerate(tokens):
            if len(generated[seq]) < max_new_tokens:
                end = len(toks) if prefill_chunk is None else min(len(toks), cached[seq] + prefill_chunk)
                batch.append((seq, cached[seq], end))
        if not batch:
            break
        for seq, _, end in batch:
            manager.grow(f"seq{seq}", end)
        meta = AttentionMetadata.build(
            query_lens=[end - start for _, start, end in batch], context_lens=[start for _, start, _ in batch],
            block_tables=[manager.block_table(f"seq{seq}") for seq, _, _ in batch],
            page_size=page_size, device=device, request_ids=[f"seq{seq}" for seq, _, _ in batch])
        input_ids = torch.tensor([t for seq, s, e in batch for t in tokens[seq][s:e]], dtype=torch.long,
                                 device=device)                      # [T]
        positions = torch.tensor([p for _, s, e in batch for p in range(s, e)], dtype=torch.long,
                                 device=device)                      # [T]
        logits = model.compute_logits(model(input_ids, positions, cache, meta))   # [T, V]
        row = 0
        for seq, start, end in batch:
            rows = logits[row:row + end - start]
            row += end - start
            logits_rows[seq].append(rows.cpu())
            cached[seq] = end
            if end == len(tokens[seq]):
                next_token = int(rows[-1].argmax())
                generated[seq].append(next_token)
                tokens[seq].append(next_token)
    for seq in range(len(prompts)):
        manager.free(f"seq{seq}")
    return generated, [torch.cat(rows) for rows in logits_rows]


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers (full recompute each step; no cache, no stopping)."""
    tokens = list(prompt)
    device = next(hf_model.parameters()).device
    for _ in range(max_new_tokens):
        logits = hf_model(torch.tensor([tokens], device=device)).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), V] float32 for one sequence."""
    device = next(hf_model.parameters()).device
    return hf_model(torch.tensor([tokens], device=device)).logits[0].float().cpu()


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """max |a - b| <= rel * max |expected| (tolerance relative to the logit scale)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= rel * scale, f"max abs logit error {err:.3g} > {rel:g} * logit scale {scale:.3g}"


def assert_each_logits_close(actual: list[torch.Tensor], expected: list[torch.Tensor], rel: float = 1e-4) -> None:
    """assert_logits_close for each pair of two equally long lists (e.g. moekv_greedy's logits of each prompt)."""
    assert len(actual) == len(expected), (len(actual), len(expected))
    for ours, theirs in zip(actual, expected):
        assert_logits_close(ours, theirs, rel)


def assert_half_close(actual: torch.Tensor, hf_fp32, hf_half, tokens: list[int]) -> None:
    """Half-precision moekv logits are about as close to fp32 transformers as half-precision
    transformers is: error <= 2x transformers' own half-precision error (or 1% of the logit scale)."""
    reference = hf_logits(hf_fp32, tokens)
    scale = reference.abs().max().item()
    ours = (actual.float() - reference).abs().max().item()
    theirs = (hf_logits(hf_half, tokens) - reference).abs().max().item()
    assert torch.isfinite(actual).all()
    assert ours <= max(2 * theirs, 1e-2 * scale), f"moekv error {ours:.3g}, transformers' own {theirs:.3g}"

"""moekv's MoE decoder against transformers on tiny random checkpoints (fp32).

Every case runs several ragged prompts (one of a single token) in ONE batch through the paged KV
cache: prefill, then one-token decode steps. Logits over prompt + generated tokens must match
transformers' within 1e-4 of the logit scale, and the greedy continuations must be identical.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moekv.models import load_model
from tests.hf_fixtures import (assert_half_close, assert_logits_close, hf_greedy, hf_logits, make_checkpoint,
                               moekv_greedy)

PROMPTS = [[5, 6, 7, 8, 9], [11], [3, 4, 10, 20, 30, 40, 50, 60, 70], [100, 101, 102]]
NEW_TOKENS = 6

# (id, family, expert layout, shard size, transformers config overrides)
CASES = [
    ("mixtral-hd64-gqa1-top2-w1w2w3", "mixtral", "per_expert", None,
     dict(hidden_size=128, num_heads=2, num_kv_heads=2, top_k=2)),
    ("mixtral-hd80-gqa4-top1-fused", "mixtral", "fused", None,
     dict(num_heads=4, num_kv_heads=1, head_dim=80, top_k=1)),
    ("qwen2-hd64-gqa2-top4-shared-dense-layer", "qwen2_moe", "per_expert", None,
     dict(num_layers=3, num_heads=2, num_kv_heads=1, head_dim=64, num_experts=8, top_k=4,
          mlp_only_layers=[1])),
    ("qwen2-hd96-gqa1-top2-renorm-sparse-step-fused", "qwen2_moe", "fused", None,
     dict(num_heads=4, num_kv_heads=4, head_dim=96, top_k=2, norm_topk_prob=True, decoder_sparse_step=2)),
    ("qwen3-hd96-gqa2-top4-renorm-fused", "qwen3_moe", "fused", None,
     dict(num_heads=4, num_kv_heads=2, head_dim=96, num_experts=8, top_k=4, norm_topk_prob=True,
          mlp_only_layers=[0])),
    ("qwen3-hd64-gqa4-top2-tied-sharded", "qwen3_moe", "per_expert", "60KB",
     dict(num_heads=4, num_kv_heads=1, head_dim=64, top_k=2, tie_word_embeddings=True)),
    ("olmoe-hd64-gqa2-top2", "olmoe", "per_expert", None,
     dict(hidden_size=128, num_heads=2, num_kv_heads=1, top_k=2)),
    ("olmoe-hd16-gqa1-top4-renorm-clip-bias-fused", "olmoe", "fused", None,
     dict(num_heads=4, num_kv_heads=4, num_experts=6, top_k=4, norm_topk_prob=True, clip_qkv=0.3,
          attention_bias=True)),
]


@pytest.mark.parametrize("family,layout,shard,overrides", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_logits_and_greedy_match_transformers(tmp_path, family, layout, shard, overrides):
    path, hf_model = make_checkpoint(tmp_path, family, layout, max_shard_size=shard, **overrides)
    if shard is not None:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    model = load_model(path)
    assert model.embed_tokens.weight.dtype == torch.float32
    generated, logits = moekv_greedy(model, PROMPTS, NEW_TOKENS)
    for prompt, tokens, moekv_logits in zip(PROMPTS, generated, logits):
        assert_logits_close(moekv_logits, hf_logits(hf_model, prompt + tokens[:-1]))
        assert tokens == hf_greedy(hf_model, prompt, NEW_TOKENS)


def test_chunked_prefill_mixed_with_decode_matches_whole_prefill(tmp_path):
    """Prompts fed 2 tokens per step while shorter ones already decode: same logits and tokens."""
    path, _ = make_checkpoint(tmp_path, "qwen2_moe", num_heads=4, num_kv_heads=2, mlp_only_layers=[1])
    model = load_model(path)
    whole_tokens, whole_logits = moekv_greedy(model, PROMPTS, NEW_TOKENS, page_size=4)
    chunk_tokens, chunk_logits = moekv_greedy(model, PROMPTS, NEW_TOKENS, page_size=3, prefill_chunk=2)
    assert chunk_tokens == whole_tokens
    for chunked, whole in zip(chunk_logits, whole_logits):
        assert_logits_close(chunked, whole)


def test_expert_load_counts_routed_slots_per_layer(tmp_path):
    path, _ = make_checkpoint(tmp_path, "qwen3_moe", num_layers=3, num_experts=8, top_k=2, mlp_only_layers=[1])
    model = load_model(path)
    assert model.expert_load.shape == (3, 8) and model.expert_load.dtype == torch.int64
    moekv_greedy(model, PROMPTS, 1)                        # one prefill step of all prompts
    num_tokens = sum(len(p) for p in PROMPTS)
    assert model.expert_load.sum(dim=1).tolist() == [num_tokens * 2, 0, num_tokens * 2]
    moekv_greedy(model, PROMPTS, 2)                        # prefill + one decode step, accumulated
    assert model.expert_load[0].sum().item() == (2 * num_tokens + len(PROMPTS)) * 2
    model.reset_expert_load()
    assert model.expert_load.sum().item() == 0


@pytest.mark.parametrize("checkpoint_dtype,load_dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16),
                                                          (torch.float32, torch.float16)],
                         ids=["bf16-checkpoint-auto", "fp32-checkpoint-as-bf16", "fp32-checkpoint-as-fp16"])
def test_half_precision_loading_smoke(tmp_path, checkpoint_dtype, load_dtype):
    path, hf_model = make_checkpoint(tmp_path, "mixtral", dtype=checkpoint_dtype, num_kv_heads=1)
    model = load_model(path, dtype=load_dtype)
    expected_dtype = load_dtype or checkpoint_dtype
    assert {p.dtype for p in model.parameters()} == {expected_dtype}
    generated, logits = moekv_greedy(model, PROMPTS[:2], 3)
    hf_half = copy.deepcopy(hf_model).to(expected_dtype)
    hf_fp32 = hf_model.float()
    for prompt, tokens, moekv_logits in zip(PROMPTS[:2], generated, logits):
        assert moekv_logits.dtype == torch.float32
        assert_half_close(moekv_logits, hf_fp32, hf_half, prompt + tokens[:-1])

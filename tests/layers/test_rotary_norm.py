"""RoPE (rotate_half convention, per-token positions) and RMSNorm against transformers' functions."""

from __future__ import annotations

import torch

from moekv.layers.norm import RMSNorm
from moekv.layers.rotary import RotaryEmbedding, apply_rotary


def test_rotary_matches_transformers():
    from transformers.models.mixtral.modeling_mixtral import apply_rotary_pos_emb

    head_dim, theta = 80, 10000.0
    positions = torch.tensor([0, 1, 2, 0, 7, 300])             # two sequences' positions, flattened
    rotary = RotaryEmbedding(head_dim, theta, "cpu")
    cos, sin = rotary(positions, torch.float32)
    q, k = torch.randn(6, 4, head_dim), torch.randn(6, 2, head_dim)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    # transformers layout: [batch, heads, seq, dim] with cos [batch, seq, dim]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None],
                                        emb.sin()[None])
    assert torch.allclose(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(apply_rotary(q[:1], cos[:1], sin[:1]), q[:1])    # position 0 is the identity


def test_rotation_preserves_norm_and_relative_positions():
    rotary = RotaryEmbedding(16, 500.0, "cpu")
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(pos_q, pos_k):
        cos_q, sin_q = rotary(torch.tensor([pos_q]), torch.float64)
        cos_k, sin_k = rotary(torch.tensor([pos_k]), torch.float64)
        return (apply_rotary(q.double(), cos_q, sin_q) * apply_rotary(k.double(), cos_k, sin_k)).sum()

    assert torch.allclose(score(5, 3), score(12, 10))
    cos, sin = rotary(torch.tensor([9]), torch.float32)
    assert torch.allclose(apply_rotary(q, cos, sin).norm(), q.norm(), atol=1e-5)


def test_rmsnorm_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    x = torch.randn(5, 3, 32)
    weight = torch.randn(32)
    ours = RMSNorm(32, 1e-6, torch.float32, "cpu")
    ours.weight.copy_(weight)
    ref = Qwen3MoeRMSNorm(32, eps=1e-6)
    ref.weight.data.copy_(weight)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    ours_bf16 = RMSNorm(32, 1e-6, torch.bfloat16, "cpu")
    ours_bf16.weight.copy_(weight)
    assert torch.equal(ours_bf16(x.bfloat16()), ref.bfloat16()(x.bfloat16()))

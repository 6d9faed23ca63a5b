"""The same model on a CUDA device: fp32 matches transformers (on the CPU), bf16 stays close -- with the
torch per-layer ops, with the fused Triton ones (KernelConfig.fused_layer_ops, ops.dispatch.override) and with
those plus the cross-op fusions of the decode layer (KernelConfig.fused_decode_layer: the CUDA default), and with the
MoE combine summed by the next norm on top (KernelConfig.fused_moe_combine, opt-in)."""

from __future__ import annotations

import copy

import pytest
import torch

from moekv.models import load_model
from moekv.ops import dispatch
from tests.hf_fixtures import (assert_half_close, assert_logits_close, hf_greedy, hf_logits, make_checkpoint,
                               moekv_greedy)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 6, 7, 8, 9], [11], [3, 4, 10, 20, 30, 40, 50, 60, 70]]


@pytest.mark.parametrize("family,overrides", [
    ("mixtral", dict(num_kv_heads=1, head_dim=80)),
    ("qwen2_moe", dict(mlp_only_layers=[1], top_k=4, num_experts=8)),
    ("qwen3_moe", dict(head_dim=96, norm_topk_prob=True)),
    ("olmoe", dict(clip_qkv=0.3, attention_bias=True)),
])
@pytest.mark.parametrize("fused,fused_decode,fused_combine", [(False, False, False), (True, False, False),
                                                              (True, True, False), (True, True, True)],
                         ids=["torch-layer-ops", "fused-layer-ops", "fused-decode-layer", "fused-moe-combine"])
def test_cuda_matches_transformers(tmp_path, monkeypatch, family, overrides, fused, fused_decode, fused_combine):
    torch.backends.cuda.matmul.allow_tf32 = False
    with dispatch.override(fused_layer_ops=fused, fused_decode_layer=fused_decode, fused_moe_combine=fused_combine):
        path, hf_model = make_checkpoint(tmp_path, family, **overrides)
        model = load_model(path, device="cuda")
        assert model.device.type == "cuda" and model.expert_load.device.type == "cuda"
        generated, logits = moekv_greedy(model, PROMPTS, 5)
        for prompt, tokens, moekv_logits in zip(PROMPTS, generated, logits):
            assert_logits_close(moekv_logits, hf_logits(hf_model, prompt + tokens[:-1]))
            assert tokens == hf_greedy(hf_model, prompt, 5)
        bf16 = load_model(path, dtype=torch.bfloat16, device="cuda")
        bf16_tokens, bf16_logits = moekv_greedy(bf16, PROMPTS, 5)
        hf_bf16 = copy.deepcopy(hf_model).to(device="cuda", dtype=torch.bfloat16)
        for prompt, tokens, moekv_logits in zip(PROMPTS, bf16_tokens, bf16_logits):
            assert_half_close(moekv_logits, hf_model, hf_bf16, prompt + tokens[:-1])

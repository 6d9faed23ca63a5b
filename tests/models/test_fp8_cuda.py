"""FP8 models on a CUDA device (the W8A16 Triton kernels in the whole model, eager and under CUDA-graph
decode): logits match the same checkpoint through the CPU reference path, and graph steps give the eager
steps' tokens."""

from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.models import load_model
from tests.fp8_fixtures import fp8_checkpoint
from tests.hf_fixtures import assert_each_logits_close, make_checkpoint, moekv_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 6, 7, 8, 9], [11], [3, 4, 10, 20, 30, 40, 50, 60, 70]]


@pytest.mark.parametrize("family,layout,block", [("qwen3_moe", "block", (16, 32)), ("mixtral", "tensor", None),
                                                 ("qwen2_moe", "channel", None)])
def test_fp8_on_cuda_matches_cpu_reference(tmp_path, family, layout, block):
    torch.backends.cuda.matmul.allow_tf32 = False
    source, _ = make_checkpoint(tmp_path, family, name="bf16")
    folder = fp8_checkpoint(source, tmp_path / "fp8", layout, block or (128, 128))
    reference = load_model(folder, dtype="fp32")                                      # CPU: the PyTorch twins
    expected_tokens, expected = moekv_greedy(reference, PROMPTS, 4)
    model = load_model(folder, dtype="fp32", device="cuda")                          # CUDA: the Triton kernels
    tokens, logits = moekv_greedy(model, PROMPTS, 4)
    assert tokens == expected_tokens
    assert_each_logits_close(logits, expected, rel=1e-4)
    bf16 = load_model(folder, dtype="bf16", device="cuda")
    _, bf16_logits = moekv_greedy(bf16, PROMPTS, 4)
    assert_each_logits_close(bf16_logits, expected, rel=3e-2)


def test_fp8_graph_decode_matches_eager(tmp_path):
    source, _ = make_checkpoint(tmp_path, "qwen3_moe", name="bf16")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for graphs in (True, False):
        llm = LLM(model=str(source), dtype="bf16", device="cuda", quantization="fp8", cuda_graphs=graphs)
        outputs[graphs] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        if graphs:
            assert llm.engine.runner.graph_steps > 0, llm.engine.runner.graph_fallback_reason
    assert outputs[True] == outputs[False]

"""FP8 weights through the offline API and the CLI: `LLM(quantization="fp8")`, FP8 checkpoints loaded as
they are, `--quantization fp8` parsed, expert offloading of FP8 experts (host copies stay FP8), and the clear
acceptance of FP8 experts with expert parallelism (run under torchrun in tests/distributed)."""

from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.cli import build_parser
from moekv.config import EngineConfig, ModelConfig, OffloadConfig, ParallelConfig
from moekv.errors import ConfigError
from moekv.models import load_model
from moekv.models.quantize import is_quantized
from moekv.moe.prefetch import install_routing
from tests.fp8_fixtures import fp8_checkpoint
from tests.hf_fixtures import make_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-fp8")
    source, _ = make_checkpoint(root, "qwen3_moe", name="bf16")
    return source, fp8_checkpoint(source, root / "fp8", "block", (16, 32))


def test_llm_quantization_fp8_and_fp8_checkpoint(checkpoints):
    source, fp8_dir = checkpoints
    prompts = [[5, 6, 7, 8], [9]]
    quantized = LLM(model=str(source), dtype="fp32", device="cpu", quantization="fp8")
    assert is_quantized(quantized.engine.model) and quantized.engine.config.model.quantization == "fp8"
    outs = quantized.generate(prompts, GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    checkpoint = LLM(model=str(fp8_dir), dtype="fp32", device="cpu")        # FP8 as stored, no flag needed
    experts = checkpoint.engine.model.layers[0].mlp.experts
    assert experts.quantized and experts.weight_blocks == ((16, 32), (16, 32))
    # the engine's tokens are the model's own greedy continuation (FP8 path end to end)
    model = load_model(fp8_dir, dtype="fp32")
    from tests.hf_fixtures import moekv_greedy
    expected, _ = moekv_greedy(model, prompts, 6)
    assert [o.outputs[0].token_ids for o in checkpoint.generate(prompts, GREEDY)] == expected


def test_quantization_config_errors(checkpoints):
    source, fp8_dir = checkpoints
    with pytest.raises(ConfigError, match="unknown quantization 'int4'"):
        ModelConfig(model="x", quantization="int4")
    assert ModelConfig(model="x", quantization="none").quantization is None
    assert ModelConfig(model="x", quantization="FP8").quantization == "fp8"
    EngineConfig(model=ModelConfig(model="x", quantization="fp8"), offload=OffloadConfig(cpu_offload_experts=True))
    # FP8 experts with expert parallelism: accepted (tests/distributed/test_expert_parallel.py runs them)
    config = EngineConfig(model=ModelConfig(model="x", quantization="fp8"),
                          parallel=ParallelConfig(expert_parallel_size=2))
    assert config.model.quantization == "fp8" and config.parallel.expert_parallel_size == 2


def test_fp8_checkpoint_offloads_with_fp8_host_copies(checkpoints):
    """An FP8 checkpoint (block scales) with expert offloading: host copies and slots stay FP8 (the kernels or
    the reference compute from them), greedy tokens equal the resident FP8 model's."""
    _, fp8_dir = checkpoints
    prompts = [[5, 6, 7, 8], [9]]
    resident = LLM(model=str(fp8_dir), dtype="fp32", device="cpu")
    expected = [o.outputs[0].token_ids for o in resident.generate(prompts, GREEDY)]
    offloaded = LLM(model=str(fp8_dir), dtype="fp32", device="cpu", cpu_offload_experts=True, expert_cache_size=2)
    assert [o.outputs[0].token_ids for o in offloaded.generate(prompts, GREEDY)] == expected
    layer = offloaded.engine.routing.offload.layers[0]
    assert layer.host.fp8 and layer.host.gate_up.block == (16, 32)
    assert offloaded.engine.routing_stats()["offload"]["misses"] > 0
    runtime = install_routing(load_model(fp8_dir), OffloadConfig(cpu_offload_experts=True, host_format="fp8"), "cpu")
    assert runtime.stats()["offload"]["host_format"] == "fp8"


def test_cli_parses_quantization():
    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert parser.parse_args([*command, "--quantization", "fp8"]).quantization == "fp8"
        assert parser.parse_args(command).quantization is None
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--quantization", "int8"])
    assert parser.parse_args(["eval", "weights", "--context", "64"]).context == 64

"""Loader failures: one test per case, each checking the error type and what its message names."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moekv.errors import ConfigError, ModelLoadError, UnsupportedModelError
from moekv.models import build_random_model, load_model, named_arch
from tests.hf_fixtures import make_checkpoint, moekv_greedy


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("base"), "qwen3_moe", num_layers=1)
    return path


@pytest.fixture
def checkpoint(base_checkpoint, tmp_path):
    """A fresh copy of the base checkpoint that a test may damage."""
    return shutil.copytree(base_checkpoint, tmp_path / "ckpt")


def rewrite_weights(path, edit):
    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_base_checkpoint_loads_without_warnings(checkpoint, recwarn):
    load_model(checkpoint)
    assert not [w for w in recwarn if "ignored" in str(w.message)]


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_path_is_a_file(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "weights.safetensors")


def test_no_config_json(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(checkpoint)


def test_unknown_architecture(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="DeepseekV3ForCausalLM.*supports"):
        load_model(checkpoint)


def test_no_safetensors_files_mentions_pickles(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="no safetensors weights.*pytorch_model.bin.*never loads pickled"):
        load_model(checkpoint)


@pytest.mark.parametrize("name, match", [
    ("model.layers.0.self_attn.k_norm.weight", r"missing tensor 'model.layers.0.self_attn.k_norm.weight'.*\[16\]"),
    ("model.layers.0.mlp.experts.3.up_proj.weight",
     r"'model.layers.0.mlp.experts.3.up_proj.weight' \(expected shape \[32, 64\]"),
], ids=["attention", "expert"])
def test_missing_tensor(checkpoint, name, match):
    rewrite_weights(checkpoint, lambda state: state.pop(name))
    with pytest.raises(ModelLoadError, match=match):
        load_model(checkpoint)


def test_misshaped_tensor(checkpoint):
    def edit(state):
        state["model.layers.0.mlp.gate.weight"] = torch.zeros(5, 64)
    rewrite_weights(checkpoint, edit)
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.gate.weight' in model.safetensors has shape "
                                             r"\[5, 64\], expected \[4, 64\]"):
        load_model(checkpoint)


def test_truncated_safetensors(checkpoint):
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or unreadable safetensors file .*model.safetensors"):
        load_model(checkpoint)


def test_garbage_safetensors_header(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\xff" * 256)
    with pytest.raises(ModelLoadError, match="corrupt or unreadable safetensors file"):
        load_model(checkpoint)


def test_index_naming_a_missing_shard(checkpoint):
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(checkpoint)


def test_extra_tensors_are_ignored_with_a_warning(checkpoint):
    def edit(state):
        state["model.layers.0.mlp.experts.99.bonus.weight"] = torch.zeros(2)
    rewrite_weights(checkpoint, edit)
    with pytest.warns(RuntimeWarning, match="ignored 1 checkpoint tensor.*experts.99.bonus"):
        load_model(checkpoint)


def test_bad_dtype_and_device(checkpoint):
    with pytest.raises(ConfigError, match="dtype"):
        load_model(checkpoint, dtype=torch.float64)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            load_model(checkpoint, device="cuda")


def test_build_random_model_is_seeded():
    arch = named_arch("qwen3-30b-a3b", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, num_experts=8, top_k=2, expert_intermediate_size=24)
    first = build_random_model(arch, dtype=torch.float32, seed=3)
    second = build_random_model(arch, dtype=torch.float32, seed=3)
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(a, b), name
    w_gate_up = first.layers[0].mlp.experts.w_gate_up
    assert w_gate_up.shape == (8, 48, 32) and abs(w_gate_up.std().item() - 0.02) < 0.003
    assert torch.equal(first.layers[0].attn.q_norm.weight, torch.ones(16))
    assert not any(p.requires_grad for p in first.parameters())
    generated, logits = moekv_greedy(first, [[1, 2, 3], [4]], 2)
    assert all(len(tokens) == 2 for tokens in generated) and all(torch.isfinite(x).all() for x in logits)

"""config.json -> ArchConfig for the four families, in transformers 4.x and 5.x spellings."""

from __future__ import annotations

import json

import pytest

from moekv.errors import ModelLoadError, UnsupportedModelError
from moekv.models.hf_config import arch_config_from_dict, read_arch_config
from tests.hf_fixtures import hf_config


def v5_dict(family, **kwargs):
    """The config.json transformers 5 writes for a tiny `family` model."""
    config = hf_config(family, **kwargs)
    config.architectures = [{"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                             "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[family]]
    return json.loads(config.to_json_string())


def to_v4_spelling(cfg):
    """Rewrite a 5.x config dict in the 4.x spelling: top-level rope_theta, rope_scaling, torch_dtype."""
    cfg = dict(cfg)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype", None) or "bfloat16"
    return cfg


def test_mixtral_fields():
    arch = arch_config_from_dict(v5_dict("mixtral", num_heads=4, num_kv_heads=1, head_dim=80, top_k=1))
    assert (arch.architecture, arch.num_heads, arch.num_kv_heads, arch.head_dim) == ("mixtral", 4, 1, 80)
    assert arch.norm_topk_prob is True and arch.top_k == 1 and arch.num_experts == 4
    assert arch.rope_theta == 1e6 and arch.rms_norm_eps == 1e-5 and arch.qk_norm == "none"
    assert not arch.attention_bias and arch.shared_expert_intermediate_size == 0 and arch.dense_layers == ()
    assert arch.eos_token_ids == (2,) and arch.bos_token_id == 1


def test_qwen2_moe_fields():
    arch = arch_config_from_dict(v5_dict("qwen2_moe", num_layers=4, mlp_only_layers=[0], decoder_sparse_step=2))
    assert arch.attention_bias and not arch.attention_out_bias
    assert arch.shared_expert_intermediate_size == 48 and arch.expert_intermediate_size == 32
    assert arch.dense_layers == (0, 2) and arch.dense_intermediate_size == 40   # mlp_only + odd steps
    assert arch.norm_topk_prob is False and arch.head_dim == 16


def test_qwen3_moe_fields():
    arch = arch_config_from_dict(v5_dict("qwen3_moe", head_dim=96, norm_topk_prob=True, attention_bias=True,
                                         tie_word_embeddings=True))
    assert arch.qk_norm == "head" and arch.head_dim == 96 and arch.norm_topk_prob
    assert arch.attention_bias and arch.attention_out_bias and arch.tie_word_embeddings
    assert arch.shared_expert_intermediate_size == 0


def test_olmoe_fields():
    arch = arch_config_from_dict(v5_dict("olmoe", clip_qkv=0.5))
    assert arch.qk_norm == "full" and arch.clip_qkv == 0.5 and arch.norm_topk_prob is False
    assert arch.expert_intermediate_size == 32 and arch.rms_norm_eps == 1e-5


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_v4_and_v5_spellings_agree(family):
    v5 = v5_dict(family, rope_theta=50000.0)
    v4 = to_v4_spelling(v5)
    v4["eos_token_id"] = [2]                              # a list is read like an int
    arch4, arch5 = arch_config_from_dict(v4), arch_config_from_dict(v5)
    assert arch4.rope_theta == arch5.rope_theta == 50000.0
    assert arch4.checkpoint_dtype == "bf16" and arch4.eos_token_ids == (2,)
    assert arch4 == type(arch5)(**{**arch5.__dict__, "checkpoint_dtype": "bf16"})


def test_model_type_fallback_and_eos_list():
    cfg = v5_dict("qwen3_moe", eos_token_id=[2, 7])
    del cfg["architectures"]
    arch = arch_config_from_dict(cfg)
    assert arch.architecture == "qwen3_moe" and arch.eos_token_ids == (2, 7)


def test_unknown_architecture_names_it_and_lists_supported():
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*MixtralForCausalLM"):
        arch_config_from_dict(cfg)


@pytest.mark.parametrize("key,params", [("rope_scaling", {"type": "yarn", "factor": 4.0}),
                                        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
                                        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5})])
def test_scaled_rope_is_refused(key, params):
    cfg = v5_dict("mixtral")
    cfg[key] = params
    with pytest.raises(UnsupportedModelError, match="RoPE scaling type"):
        arch_config_from_dict(cfg)


def test_linear_rope_with_factor_one_is_plain_rope():
    cfg = to_v4_spelling(v5_dict("mixtral"))
    cfg["rope_scaling"] = {"type": "linear", "factor": 1.0}
    assert arch_config_from_dict(cfg).rope_theta == 1e6


def test_sliding_window_narrower_than_max_length():
    mixtral = v5_dict("mixtral", max_position_embeddings=256)
    mixtral["sliding_window"] = 128
    with pytest.raises(UnsupportedModelError, match="sliding_window=128.*max_model_len <= 128"):
        arch_config_from_dict(mixtral)
    assert arch_config_from_dict(mixtral, max_model_len=128).max_position_embeddings == 256
    qwen = v5_dict("qwen2_moe", max_position_embeddings=256)
    qwen.update(sliding_window=64)                        # ignored unless use_sliding_window
    arch_config_from_dict(qwen)
    qwen.update(use_sliding_window=True)
    with pytest.raises(UnsupportedModelError, match="sliding_window=64"):
        arch_config_from_dict(qwen)


def test_missing_field_and_unsupported_activation():
    cfg = v5_dict("olmoe")
    del cfg["num_experts_per_tok"]
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        arch_config_from_dict(cfg)
    cfg = v5_dict("mixtral", hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="gelu"):
        arch_config_from_dict(cfg)


def test_read_arch_config_from_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v5_dict("qwen3_moe")))
    assert read_arch_config(tmp_path).architecture == "qwen3_moe"
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        read_arch_config(tmp_path)

"""The bundled checkpoint models/tiny-shakespeare-moe: shape, size, validation perplexity and expert load.

The perplexity on the committed validation slice is recomputed on the CPU in fp32 with the same function the
training script used to write ``eval.json`` (``tools/train_tiny_moe.py:slice_eval``, defined in
``tools/tiny_moe_eval.py``) and must match within 1%.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from moekv import datasets

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "tiny-shakespeare-moe"
MAX_BYTES = 25_000_000
MIN_EXPERT_LOAD = 0.02


def _config() -> dict:
    return json.loads((MODEL / "config.json").read_text())


def test_config_shape():
    cfg = _config()
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert cfg["model_type"] == "mixtral"
    assert cfg["num_local_experts"] == 8
    assert cfg["num_experts_per_tok"] == 2
    assert cfg["num_attention_heads"] == 8
    assert cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 64
    assert cfg["num_hidden_layers"] >= 4
    assert cfg["max_position_embeddings"] >= 2048
    assert 2000 <= cfg["vocab_size"] <= 4096
    assert (cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16"


def test_checkpoint_size():
    files = {p.name: p.stat().st_size for p in MODEL.iterdir() if p.is_file()}
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "MODEL_CARD.md", "eval.json", "validation_slice.txt"]:
        assert name in files, name
    assert sum(files.values()) <= MAX_BYTES, files


def test_safetensors_are_bf16():
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(MODEL / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    assert dtypes == {"BF16"}, dtypes
    assert any("experts" in k for k in keys)


def test_validation_slice_matches_split(tmp_path, monkeypatch):
    sl = datasets.validation_slice()
    assert 60_000 <= len(sl.encode("utf-8")) <= datasets.SLICE_BYTES
    assert sl.endswith("\n")
    # validation_text on an explicit corpus: the last 10% of its characters
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a" * 90 + "b" * 10)
    assert datasets.validation_text(corpus) == "b" * 10
    monkeypatch.setenv(datasets.CORPUS_ENV, str(corpus))
    assert datasets.validation_text() == "b" * 10
    # no corpus anywhere -> the committed slice
    monkeypatch.setenv(datasets.CORPUS_ENV, str(tmp_path / "missing.txt"))
    assert datasets.validation_text() == sl
    with pytest.raises(FileNotFoundError):
        datasets.validation_text(tmp_path / "missing.txt")
    # the real corpus, when present, reproduces the committed slice
    monkeypatch.delenv(datasets.CORPUS_ENV)
    if datasets.default_corpus_path().is_file():
        val = datasets.validation_text()
        assert val.startswith(sl) and datasets.make_slice(val) == sl


def _train_module():
    spec = importlib.util.spec_from_file_location("train_tiny_moe", REPO / "tools" / "train_tiny_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def slice_result():
    pytest.importorskip("transformers")
    return _train_module().slice_eval(MODEL, "cpu")


def test_slice_perplexity_matches_eval_json(slice_result):
    ref = json.loads((MODEL / "eval.json").read_text())
    assert slice_result["window"] == ref["window"]
    assert slice_result["tokens"] == ref["tokens"]
    assert abs(slice_result["perplexity"] / ref["perplexity"] - 1) < 0.01, (slice_result["perplexity"],
                                                                          ref["perplexity"])


def test_every_expert_gets_routed_tokens(slice_result):
    load = slice_result["expert_load"]
    assert len(load) == _config()["num_hidden_layers"]
    for layer, row in enumerate(load):
        assert len(row) == 8
        assert min(row) >= MIN_EXPERT_LOAD, (layer, row)


def test_loads_with_auto_classes():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    assert tok.bos_token == tok.eos_token == "<|endoftext|>"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "Speak."}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "USER:\nSpeak.\n\nASSISTANT:\n"
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    assert type(model).__name__ == "MixtralForCausalLM"


def test_moekv_logits_and_greedy_match_transformers():
    """The same checkpoint in moekv (paged KV cache, chunked prefill then decode) and in transformers, fp32."""
    transformers = pytest.importorskip("transformers")
    import torch

    from moekv.models.loader import load_model
    from moekv.tokenizer import Tokenizer
    from tests.hf_fixtures import assert_logits_close, hf_greedy, hf_logits, moekv_greedy

    prompt = Tokenizer(MODEL).encode(datasets.validation_slice()[:700])             # ~200 tokens
    ours = load_model(MODEL, dtype=torch.float32, device="cpu")
    generated, logits = moekv_greedy(ours, [prompt], max_new_tokens=12, page_size=16, prefill_chunk=64)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    assert_logits_close(logits[0], hf_logits(theirs, prompt + generated[0][:-1]))
    assert generated[0] == hf_greedy(theirs, prompt, 12)

"""record_attention: the post-RoPE q/k/v of a transformers model's real attention, recorded in one forward pass
(tiny random Mixtral built locally; nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from moekv.eval.hf_record import record_attention, smollm2_gguf
from moekv.eval.kv_runner import sampled_attention
from tests.hf_fixtures import build_hf_model, hf_config


def test_records_every_layer_and_leaves_the_outputs_unchanged():
    model = build_hf_model(hf_config("mixtral", num_layers=3, num_heads=4, num_kv_heads=2, hidden_size=64))
    ids = torch.randint(3, 160, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits[0]
    before = model.config._attn_implementation
    record, logits = record_attention(model, ids)
    assert model.config._attn_implementation == before
    assert torch.allclose(logits, plain, atol=1e-5)
    assert sorted(record.layers) == [0, 1, 2]
    q, k, v = record.tensors(0)
    assert q.shape == (40, 4, 16) and k.shape == v.shape == (40, 2, 16) and q.dtype == torch.float32
    assert record.scale == pytest.approx(16 ** -0.5)
    # the recorded tensors are the attention's inputs: causal attention over them is layer 0's attention output
    attn = model.model.layers[0].self_attn
    captured = {}
    handle = attn.o_proj.register_forward_hook(lambda mod, args, out: captured.setdefault("x", args[0][0]))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    handle.remove()
    positions = torch.arange(40)
    ours = sampled_attention(q, k, v, positions, record.scale).reshape(40, -1)
    assert torch.allclose(ours, captured["x"], atol=1e-5)
    # keys carry RoPE: the same token at two positions gives two different recorded keys
    same = torch.full((1, 8), 7)
    record2, _ = record_attention(model, same)
    keys = record2.tensors(0)[1]
    assert not torch.allclose(keys[0], keys[5])


def test_rejects_a_batch():
    model = build_hf_model(hf_config("mixtral", num_layers=1))
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        record_attention(model, torch.zeros(2, 4, dtype=torch.long))


def test_smollm2_gguf_is_none_or_a_file():
    path = smollm2_gguf()
    assert path is None or (path.is_file() and path.suffix == ".gguf")

"""FP8 checkpoints of both layouts load as FP8 and match their dequantize-then-compute reference.

Fixtures (tests/fp8_fixtures.py) are tiny random checkpoints converted by hand with safetensors: block-wise
`weight_scale_inv` (DeepSeek-V3 / Qwen3 FP8), per-tensor `weight_scale` + `input_scale` (FP8 Mixtral) and
per-channel `weight_scale`. The reference is the same checkpoint with every FP8 tensor replaced by codes *
scale: in fp32 the two must agree to fp32 rounding (W8A16 with fp32 activations dequantizes exactly as the
reference did), in bf16 to bf16 rounding of the weights.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from moekv.core.fp8 import FP8_DTYPE, quantize_fp8
from moekv.errors import ModelLoadError, UnsupportedModelError
from moekv.models import load_model
from moekv.models.quantize import fp8_modules, is_quantized
from tests.fp8_fixtures import dequantized_checkpoint, fp8_checkpoint
from tests.hf_fixtures import assert_each_logits_close, make_checkpoint, moekv_greedy

PROMPTS = [[5, 6, 7, 8, 9], [11, 12]]

# (id, family, layout, block, hf config overrides): q rows 64, kv rows 32, 2I = 64 with the defaults
CASES = [
    ("qwen3-block128", "qwen3_moe", "block", (128, 128), {}),              # the real block (one per tiny tensor)
    ("qwen3-block16x32-aligned", "qwen3_moe", "block", (16, 32), {}),      # several blocks, kept block-wise
    ("mixtral-block24x32-unaligned", "mixtral", "block", (24, 32), {}),    # rows not multiples of 24: row-wise
    ("mixtral-per-tensor", "mixtral", "tensor", None, {}),
    ("qwen2-per-channel-shared-dense", "qwen2_moe", "channel", None, dict(num_layers=3, mlp_only_layers=[1])),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    made = {}
    for case_id, family, layout, block, overrides in CASES:
        source, _ = make_checkpoint(root, family, name=f"{case_id}-bf16", **overrides)
        fp8 = fp8_checkpoint(source, root / case_id, layout, block or (128, 128))
        made[case_id] = (source, fp8, dequantized_checkpoint(fp8, root / f"{case_id}-ref"))
    return made


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp8_checkpoint_matches_dequantized_reference(case, checkpoints):
    case_id, family, layout, block, _ = case
    _, fp8_dir, ref_dir = checkpoints[case_id]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # no "ignored tensors": scales all consumed
        model = load_model(fp8_dir, dtype="fp32")
    reference = load_model(ref_dir, dtype="fp32")
    modules = list(fp8_modules(model))
    assert modules and all(m.quantized for m in modules)
    layer = model.layers[0]
    assert layer.mlp.router.weight.dtype == torch.float32 and model.embed_tokens.weight.dtype == torch.float32
    expected_block = {"qwen3-block16x32-aligned": (16, 32), "mixtral-block24x32-unaligned": (1, 32),
                      "qwen3-block128": (1, 128)}.get(case_id, (1, 64))
    assert layer.attn.qkv_proj.weight_block == expected_block
    assert layer.mlp.experts.weight_blocks[0] == expected_block
    tokens, logits = moekv_greedy(model, PROMPTS, 4)
    ref_tokens, ref_logits = moekv_greedy(reference, PROMPTS, 4)
    assert tokens == ref_tokens
    assert_each_logits_close(logits, ref_logits, rel=1e-5)


def test_fp8_checkpoint_in_bf16_matches_bf16_reference(checkpoints):
    _, fp8_dir, _ = checkpoints["qwen3-block16x32-aligned"]
    model = load_model(fp8_dir, dtype="bf16")
    reference = load_model(dequantized_checkpoint(fp8_dir, fp8_dir.parent / "bf16-ref", torch.bfloat16),
                           dtype="bf16")
    assert model.layers[0].mlp.experts.w_gate_up.dtype == FP8_DTYPE
    _, logits = moekv_greedy(model, PROMPTS, 3)
    _, ref_logits = moekv_greedy(reference, PROMPTS, 3)
    assert_each_logits_close(logits, ref_logits, rel=3e-2)


def test_quantize_at_load_is_per_channel_and_close_to_bf16(checkpoints):
    source, _, _ = checkpoints["qwen3-block16x32-aligned"]
    full = load_model(source, dtype="fp32")
    model = load_model(source, dtype="fp32", quantization="fp8")
    assert is_quantized(model) and not is_quantized(full)
    experts = model.layers[1].mlp.experts
    expected = quantize_fp8(full.layers[1].mlp.experts.w_gate_up[2])        # per output channel
    assert experts.weight_blocks[0] == (1, full.arch.hidden_size)
    assert torch.equal(experts.w_gate_up[2].view(torch.uint8), expected.codes.view(torch.uint8))
    assert torch.equal(experts.w_gate_up_scale[2], expected.scale)
    qkv = model.layers[0].attn.qkv_proj
    assert torch.equal(qkv.weight.view(torch.uint8), quantize_fp8(full.layers[0].attn.qkv_proj.weight).codes.view(torch.uint8))
    _, logits = moekv_greedy(model, PROMPTS, 1)
    _, ref_logits = moekv_greedy(full, PROMPTS, 1)
    for ours, theirs in zip(logits, ref_logits):     # e4m3 (3 mantissa bits) per weight, two random layers
        cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
        assert (ours - theirs).abs().max() <= 0.1 * theirs.abs().max()
        assert cosine > 0.99


def test_fp8_load_errors(checkpoints, tmp_path):
    _, fp8_dir, _ = checkpoints["qwen3-block16x32-aligned"]
    config = json.loads((fp8_dir / "config.json").read_text())
    for quant, error, match in (({"quant_method": "gptq", "bits": 4}, UnsupportedModelError, "gptq"),
                                ({"quant_method": "fp8", "fmt": "e5m2"}, UnsupportedModelError, "e5m2"),
                                ({"quant_method": "fp8", "weight_block_size": [128]}, ModelLoadError, "two positive")):
        bad = tmp_path / f"bad-{quant.get('fmt', quant['quant_method'])}-{len(quant)}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        (bad / "model.safetensors").symlink_to(fp8_dir / "model.safetensors")
        with pytest.raises(error, match=match):
            load_model(bad)
    # block scales but no weight_block_size; an FP8 tensor without any scale
    no_block = tmp_path / "no-block"
    no_block.mkdir()
    (no_block / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    (no_block / "model.safetensors").symlink_to(fp8_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="weight_block_size"):
        load_model(no_block)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    no_scale = tmp_path / "no-scale"
    no_scale.mkdir()
    (no_scale / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(no_scale / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="o_proj.weight.*has no scale"):
        load_model(no_scale)


def _record_materialized(monkeypatch):
    """Every parameter the loader gives storage (module, name), in order."""
    import moekv.models.loader as loader

    made, original = [], loader.materialize

    def materialize(module, name, device):
        if getattr(module, name).is_meta:
            made.append((module, name))
        return original(module, name, device)

    monkeypatch.setattr(loader, "materialize", materialize)
    return made


def test_fp8_checkpoint_never_allocates_16_bit_projections(checkpoints, monkeypatch):
    """Parameters get storage only as they load, so an FP8 checkpoint's projections and experts exist as codes
    and scales only: their 16-bit form is never allocated (loading peaks at the FP8 model, not the 16-bit one)."""
    _, fp8_dir, _ = checkpoints["qwen3-block16x32-aligned"]
    made = _record_materialized(monkeypatch)
    model = load_model(fp8_dir, dtype="fp32")
    fp8 = {id(m) for m in fp8_modules(model)}
    assert fp8 and not [name for module, name in made if id(module) in fp8]
    assert {name for _, name in made} >= {"weight"}                   # embedding, norms, router, head: 16-bit
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())


def test_quantize_at_load_holds_one_16_bit_layer_at_a_time(checkpoints, monkeypatch):
    """quantization="fp8" quantizes each layer as soon as it has loaded: whenever a projection is quantized, no
    other layer holds a 16-bit projection (the whole 16-bit model never exists)."""
    source, _, _ = checkpoints["qwen2-per-channel-shared-dense"]
    from moekv.layers.experts import LocalExperts
    from moekv.layers.linear import Linear

    seen, model_box = [], []
    originals = {cls: cls.to_fp8 for cls in (Linear, LocalExperts)}

    def watch(cls):
        def to_fp8(self, *args, **kwargs):
            if model_box:
                layers = [i for i, layer in enumerate(model_box[0].layers)
                          for m in fp8_modules_of(layer) if m is not self and not m.quantized
                          and not any(p.is_meta for p in m.parameters())]
                seen.append(set(layers))
            return originals[cls](self, *args, **kwargs)
        return to_fp8

    from moekv.models.quantize import fp8_layer_modules as fp8_modules_of
    import moekv.models.loader as loader

    build = loader.model_class

    def model_class(name):
        cls = build(name)

        def make(*args, **kwargs):
            model_box.append(cls(*args, **kwargs))
            return model_box[0]
        return make

    monkeypatch.setattr(loader, "model_class", model_class)
    for cls in originals:
        monkeypatch.setattr(cls, "to_fp8", watch(cls))
    model = load_model(source, dtype="fp32", quantization="fp8")
    assert is_quantized(model) and all(m.quantized for m in fp8_modules(model))
    assert len(seen) == len(list(fp8_modules(model)))
    assert all(len(layers) <= 1 for layers in seen), seen        # only the layer being quantized is 16-bit

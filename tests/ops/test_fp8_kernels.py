"""FP8 (W8A16) kernels against their PyTorch twins: the fused MoE decode and grouped paths and the dense
fp8_linear, on CUDA or under Triton's CPU interpreter (tiny shapes); and the reference itself against
dequantize-then-compute in the model dtype. Random and adversarial weights: channels of very different
magnitudes, codes at the e4m3 limits (+-448), spikes, experts and channels that are all zero."""

from __future__ import annotations

import pytest
import torch

from moekv.core.fp8 import FP8_DTYPE, Fp8Weight, quantize_fp8
from moekv.ops import dispatch
from moekv.ops.reference.fp8_linear import fp8_linear as fp8_linear_reference
from moekv.ops.reference.moe import moe_activation_reference, moe_experts_reference
from moekv.ops.triton.layer.fp8_linear import fp8_linear
from moekv.ops.triton.moe import decode as moe_decode
from moekv.ops.triton.moe import grouped as moe_grouped
from tests.ops.helpers import assert_close
from tests.ops.test_moe_kernels import routing

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DECODE_CONFIG = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 32}, "down": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2}}
GROUPED_CONFIG = {"BLOCK_M": 16, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2},
                  "down": {"BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2}}


def fp8_weight(shape, block, gen, kind="random") -> Fp8Weight:
    """random: N(0, 1) / sqrt(K); heavy: channel magnitudes from 1e-2 to 10 (and expert 0 all zero); extreme: codes at +-448, zeros and
    subnormals with varied scales; spiky: one huge value per expert (its channel's other values underflow)."""
    weight = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    if kind == "heavy":
        weight = weight * torch.logspace(-2, 1, shape[-2])[:, None]
    elif kind == "spiky":
        weight[..., 1, 2] = 1e4
    if kind == "extreme":
        codes = torch.tensor([448.0, -448.0, 0.0, 2.0 ** -9, -(2.0 ** -9), 1.0, -0.5, 240.0])
        codes = codes[torch.randint(0, len(codes), shape, generator=gen)].to(FP8_DTYPE)
        quantized = quantize_fp8(weight, block)
        scale = torch.rand(quantized.scale.shape, generator=gen) * 1e-2 + 1e-4
        return Fp8Weight(codes, scale, quantized.block)
    quantized = quantize_fp8(weight, block)
    if kind == "heavy" and len(shape) == 3:         # one expert entirely zero
        quantized.codes[0].zero_()
    return quantized


def fp8_case(num_tokens, top_k, num_experts, hidden, inter, dtype, block, kind="random", pattern="random", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w_gate_up = fp8_weight((num_experts, 2 * inter, hidden), block, gen, kind)
    w_down = fp8_weight((num_experts, hidden, inter), block, gen, kind)
    ids, weights = routing(num_tokens, top_k, num_experts, gen, pattern)
    return x, w_gate_up, w_down, ids, weights


def _to(device, *tensors_or_weights):
    out = []
    for t in tensors_or_weights:
        out.append(Fp8Weight(t.codes.to(device), t.scale.to(device), t.block) if isinstance(t, Fp8Weight)
                   else t.to(device))
    return out


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (T, k, E, H, I, weights, routing, block, dtype); blocks: None per channel, the checkpoints' 128 x 128 (one
# block here: K tiles capped at it), 16 x 32 (several blocks both ways), 1 x 48 (K blocks ending mid-tile)
CASES = [
    (1, 2, 4, 64, 48, "random", "random", None, BF16),
    (1, 2, 4, 64, 48, "random", "random", (128, 128), FP32),
    (5, 2, 4, 64, 48, "heavy", "hot", (16, 32), BF16),
    (5, 2, 4, 64, 48, "heavy", "hot", None, FP16),
    (3, 2, 4, 64, 48, "extreme", "random", (16, 32), FP32),
    (3, 2, 4, 64, 48, "extreme", "random", (1, 48), BF16),
    (4, 2, 4, 64, 48, "spiky", "sparse", (16, 32), FP16),
    (4, 2, 4, 64, 48, "spiky", "sparse", None, FP32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}E{c[2]}H{c[3]}I{c[4]}-{c[5]}-{c[6]}-{c[7]}-{c[8]}")
def test_moe_fp8_kernels_match_reference(case, device):
    num_tokens, top_k, num_experts, hidden, inter, kind, pattern, block, dtype = case
    x, w_gate_up, w_down, ids, weights = _to(device, *fp8_case(num_tokens, top_k, num_experts, hidden, inter,
                                                                 dtype, block, kind, pattern))
    expected = moe_experts_reference(x, w_gate_up, w_down, ids, weights)
    decode = moe_decode.moe_experts_decode(x, w_gate_up, w_down, ids, weights, config=DECODE_CONFIG)
    grouped = moe_grouped.moe_experts_grouped(x, w_gate_up, w_down, ids, weights, config=GROUPED_CONFIG)
    assert_close(decode, expected, dtype)
    assert_close(grouped, expected, dtype)
    act = moe_decode.decode_activation(x, w_gate_up, ids, DECODE_CONFIG)
    assert_close(act, moe_activation_reference(x.float(), w_gate_up, ids), dtype)


@pytest.mark.parametrize("kind", ["random", "heavy", "extreme", "spiky"])
def test_moe_fp8_reference_matches_dequantize_then_16_bit(kind):
    """The W8A16 reference (fp32 matmuls on dequantized experts) agrees with dequantizing to bf16 and running
    the 16-bit reference, to bf16 precision; and with the fp32 reference on fp32-dequantized weights, exactly."""
    x, w_gate_up, w_down, ids, weights = fp8_case(6, 2, 4, 64, 48, torch.bfloat16, (16, 32), kind)
    ours = moe_experts_reference(x, w_gate_up, w_down, ids, weights)
    bf16 = moe_experts_reference(x, w_gate_up.dequantize(torch.bfloat16), w_down.dequantize(torch.bfloat16), ids,
                                 weights)
    assert ours.dtype == torch.bfloat16
    assert_close(ours, bf16, torch.bfloat16)
    x32 = x.float()
    exact = moe_experts_reference(x32, w_gate_up.dequantize(), w_down.dequantize(), ids, weights)
    assert torch.allclose(moe_experts_reference(x32, w_gate_up, w_down, ids, weights), exact, rtol=1e-6, atol=1e-6 * exact.abs().max())


@pytest.mark.parametrize("rows,kind,bias,block,dtype", [
    (1, "random", False, None, BF16), (1, "random", True, (128, 128), FP16), (5, "heavy", True, (16, 32), FP32),
    (40, "extreme", True, (16, 32), BF16), (40, "extreme", False, None, FP32), (3, "spiky", False, (1, 48), BF16)],
    ids=str)
def test_fp8_linear_matches_reference(rows, kind, bias, block, dtype, device):
    gen = torch.Generator().manual_seed(rows)
    weight = fp8_weight((72, 96), block, gen, kind)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    b = torch.randn(72, generator=gen).to(dtype) if bias else None
    x, weight = _to(device, x, weight)
    b = None if b is None else b.to(device)
    expected = fp8_linear_reference(x, weight, b)
    assert_close(fp8_linear(x, weight, b, config={"BLOCK_N": 32, "BLOCK_K": 32}), expected, dtype)
    assert_close(fp8_linear(x, weight, b), expected, dtype)                      # default launch shape
    dense = torch.nn.functional.linear(x.float(), weight.dequantize().to(x.device), None if b is None else b.float())
    assert_close(expected, dense, dtype)


def test_dispatch_takes_fp8_and_falls_back_for_narrow_blocks(device):
    x, w_gate_up, w_down, ids, weights = _to(device, *fp8_case(3, 2, 4, 64, 48, torch.float32, (16, 32)))
    expected = moe_experts_reference(x, w_gate_up, w_down, ids, weights)
    with dispatch.override(backend="triton"):
        assert_close(dispatch.moe_experts(x, w_gate_up, w_down, ids, weights), expected, torch.float32)
        # scale blocks 24 wide (not a multiple of 16, narrower than K): the kernels cannot tile them
        narrow = _to(device, *fp8_case(3, 2, 4, 64, 48, torch.float32, (16, 24)))
        with pytest.warns(RuntimeWarning, match="no Triton MoE kernel"):
            out = dispatch.moe_experts(*narrow)
        assert torch.equal(out, moe_experts_reference(*narrow))
        linear_weight = fp8_weight((40, 64), (16, 24), torch.Generator().manual_seed(0))
        linear_weight = _to(device, linear_weight)[0]
        with pytest.warns(RuntimeWarning, match="no Triton FP8 linear"):
            out = dispatch.fp8_linear(x, linear_weight)
        assert torch.equal(out, fp8_linear_reference(x, linear_weight))


def test_fp8_tuned_configs_have_their_own_file(tmp_path, monkeypatch):
    """FP8 experts read the weights=fp8 table, and the 16-bit one where they have none."""
    import json

    from moekv.ops.triton.moe import configs as moe_configs

    sixteen = {"decode_max_tokens": 8, "decode": {"1": {"gate_up": {"BLOCK_N": 64}, "down": {}}}, "grouped": {}}
    fp8 = {"decode_max_tokens": 32, "decode": {"1": {"gate_up": {"BLOCK_N": 128}, "down": {}}}, "grouped": {}}
    assert moe_configs.config_filename(4, 32, 16, torch.bfloat16, "cpu", "fp8") == \
        "E=4,H=32,I=16,dtype=bf16,weights=fp8,device=cpu.json"
    (tmp_path / moe_configs.config_filename(4, 32, 16, torch.bfloat16, "cpu")).write_text(json.dumps(sixteen))
    monkeypatch.setattr(moe_configs, "CONFIG_DIR", tmp_path)
    for clear in (moe_configs.load_tuned.cache_clear, moe_configs._cached_config.cache_clear):
        clear()
    try:
        assert moe_configs.decode_max_tokens(4, 32, 16, torch.bfloat16, "cpu", "fp8") == 8      # falls back
        (tmp_path / moe_configs.config_filename(4, 32, 16, torch.bfloat16, "cpu", "fp8")).write_text(json.dumps(fp8))
        moe_configs.load_tuned.cache_clear()
        moe_configs._cached_config.cache_clear()
        assert moe_configs.decode_max_tokens(4, 32, 16, torch.bfloat16, "cpu", "fp8") == 32
        assert moe_configs.decode_max_tokens(4, 32, 16, torch.bfloat16, "cpu") == 8
        assert moe_configs.get_config("decode", 4, 32, 16, 1, torch.bfloat16, "cpu", weights="fp8")["gate_up"] == \
            {"BLOCK_N": 128}
        x, w_gate_up, _, _, _ = fp8_case(1, 2, 4, 32, 16, torch.bfloat16, None)
        assert moe_decode._resolve_config(x, w_gate_up, None)["gate_up"]["BLOCK_N"] == 128
    finally:
        moe_configs.load_tuned.cache_clear()
        moe_configs._cached_config.cache_clear()

"""The GEMV ("fma") variant of the MoE decode launches (ops.triton.moe.decode_fma) against the PyTorch twins.

On CUDA, else under Triton's CPU interpreter (tiny shapes, tiles chosen so each call runs a few dozen programs).
FP8 experts (per output channel: one scale per reduced row, applied after the loop; 16 x 32, 1 x 48 and 128 x 128
blocks: scales per K tile) and 16-bit ones; T = 1 to 4 with random, hot (one expert for every token), sparse and
repeated (both slots of a token on one expert) routing; hidden and intermediate sizes that are not multiples of
the tiles (K tails, clamped rows); adversarial weights from test_fp8_kernels (heavy channels, e4m3 extremes, a
few huge values, an all-zero expert). Then the config plumbing: VARIANT from the tuned table or the call, the
fallback to "dot", the per-slot partials the fused combine + norm reads, and the expert passes of the offload.
"""

from __future__ import annotations

import json

import pytest
import torch

from moekv.core.fp8 import Fp8Weight
from moekv.ops.reference import moe_combine as ref_combine
from moekv.ops.reference.moe import moe_activation_reference, moe_experts_reference
from moekv.ops.triton.moe import configs as moe_configs
from moekv.ops.triton.moe import decode as moe_decode
from moekv.ops.triton.moe import decode_fma
from moekv.ops.triton.moe.passes import DecodePasses
from tests.ops.helpers import assert_close
from tests.ops.test_fp8_kernels import _to, fp8_case
from tests.ops.test_moe_kernels import moe_case

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def fma_config(gate_up=(16, 32), down=(16, 16), split_k=2, warps=2) -> dict:
    """Small tiles (few programs under the interpreter); (BLOCK_N, BLOCK_K) per launch."""
    return {"VARIANT": "fma",
            "gate_up": {"BLOCK_N": gate_up[0], "BLOCK_K": gate_up[1], "num_warps": warps, "num_stages": 1},
            "down": {"BLOCK_N": down[0], "BLOCK_K": down[1], "SPLIT_K": split_k, "num_warps": warps,
                     "num_stages": 1}}


def _check(x, w_gate_up, w_down, ids, weights, config, dtype):
    assert moe_decode._resolve_config(x, w_gate_up, config, w_down)["VARIANT"] == "fma"
    expected = moe_experts_reference(x, w_gate_up, w_down, ids, weights)
    assert_close(moe_decode.moe_experts_decode(x, w_gate_up, w_down, ids, weights, config=config), expected, dtype)
    act = moe_decode.decode_activation(x, w_gate_up, ids, config)
    assert_close(act, moe_activation_reference(x.float() if isinstance(w_gate_up, Fp8Weight) else x, w_gate_up, ids),
                 dtype)


# (T, E, H, I, weights, routing, block, dtype, tiles): H = 48 / I = 40 end mid-tile (K tails; 40 rows in tiles of
# 16: clamped rows); blocks None = per channel, (128, 128) = one block spanning K (per-row scales), (16, 32) and
# (1, 48) = several K blocks (BLOCK_K capped at 32 / 16: scales per K tile)
FP8_CASES = [
    (1, 4, 48, 40, "random", "random", None, BF16, {}),
    (1, 4, 48, 40, "heavy", "repeat", None, FP32, {}),
    (1, 4, 64, 48, "spiky", "random", (16, 32), FP16, {}),
    (1, 4, 64, 48, "extreme", "repeat", (16, 32), FP32, dict(gate_up=(4, 64), down=(2, 64), split_k=1)),
    (1, 4, 64, 48, "heavy", "random", (128, 128), BF16, dict(gate_up=(1, 64), down=(4, 64), split_k=1)),
    (1, 4, 64, 48, "random", "random", (1, 48), FP32, {}),
    (2, 4, 48, 40, "heavy", "hot", None, BF16, {}),
    (3, 4, 64, 48, "extreme", "sparse", (16, 32), FP32, dict(split_k=3)),
    (4, 4, 64, 48, "spiky", "hot", None, FP16, dict(gate_up=(8, 16), down=(32, 16), split_k=1)),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"T{c[0]}H{c[2]}I{c[3]}-{c[4]}-{c[5]}-{c[6]}-{c[7]}")
def test_fma_fp8_matches_reference(case, device):
    num_tokens, num_experts, hidden, inter, kind, pattern, block, dtype, tiles = case
    x, w_gate_up, w_down, ids, weights = _to(device, *fp8_case(num_tokens, 2, num_experts, hidden, inter, dtype,
                                                                 block, kind, pattern))
    _check(x, w_gate_up, w_down, ids, weights, fma_config(**tiles), dtype)


@pytest.mark.parametrize("num_tokens,pattern,dtype", [(1, "random", BF16), (1, "repeat", FP32), (3, "hot", FP16)])
def test_fma_16_bit_weights_match_reference(num_tokens, pattern, dtype, device):
    """16-bit / fp32 experts run the same kernels (no scales; widening to fp32 the only conversion)."""
    (x, w_gate_up, w_down, ids, weights), _ = moe_case(num_tokens, 2, 4, 48, 40, dtype, device, pattern=pattern,
                                                       scale=8.0 if dtype == FP32 else 1.0)
    _check(x, w_gate_up, w_down, ids, weights, fma_config(), dtype)


def test_fma_partials_feed_the_combine(device):
    """moe_expert_partials of the fma variant: per slot and split, summing to the twin's per-slot outputs; the
    combine (and so the fused combine + norm, which reads the same partials) gives moe_experts_decode."""
    x, w_gate_up, w_down, ids, weights = _to(device, *fp8_case(1, 2, 4, 48, 40, FP32, (16, 16), "heavy"))
    config = fma_config(split_k=3)
    partial = moe_decode.moe_expert_partials(x, w_gate_up, w_down, ids, config)
    assert partial.shape == (3, 2, 48) and partial.dtype == torch.float32
    twin = ref_combine.moe_expert_partials(x, w_gate_up, w_down, ids)                     # [1, T*k, H]
    assert_close(partial.sum(0), twin[0], FP32)
    full = moe_decode.moe_experts_decode(x, w_gate_up, w_down, ids, weights, config)
    assert torch.equal(full, ref_combine.moe_combine(partial, weights, FP32))


def test_fma_default_tiles_and_block_caps(device):
    """Without tile overrides the fma launch takes decode_fma.default_part: one row of 16-byte loads per thread,
    BLOCK_K capped inside narrower scale blocks (and more rows per program)."""
    x, w_gate_up, w_down, ids, weights = _to(device, *fp8_case(1, 2, 4, 64, 48, BF16, (16, 32), "random"))
    resolved = moe_decode._resolve_config(x, w_gate_up, {"VARIANT": "fma"}, w_down)
    assert resolved["gate_up"]["BLOCK_K"] == 32 and resolved["gate_up"]["BLOCK_N"] > 1
    assert decode_fma.default_part(4096, 1) == {"BLOCK_N": 1, "BLOCK_K": 4096, "num_warps": 8, "num_stages": 1,
                                                "UNROLL": 1}
    assert decode_fma.default_part(4096, 2)["BLOCK_K"] == 2048
    assert decode_fma.default_part(2048, 1, 128) == {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4,
                                                     "num_stages": 1, "UNROLL": 1}
    tuned = {"VARIANT": "fma", "gate_up": {"BLOCK_N": 2, "BLOCK_K": 64}}          # K tiles capped at 32: 2x rows
    assert moe_decode._resolve_config(x, w_gate_up, tuned, w_down)["gate_up"]["BLOCK_N"] == 4
    _check(x, w_gate_up, w_down, ids, weights, {"VARIANT": "fma"}, BF16)


def test_variant_falls_back_and_rejects_bad_configs(device):
    """"fma" runs T <= FMA_MAX_TOKENS on K-contiguous weights, else "dot" (with the tuned dot tiles, not the fma
    overrides); unknown variants and non-power-of-two tiles are errors."""
    x, w_gate_up, w_down, ids, weights = _to(device, *fp8_case(5, 2, 4, 32, 16, BF16, None))
    config = fma_config(gate_up=(2, 16), down=(2, 16))
    resolved = moe_decode._resolve_config(x, w_gate_up, config, w_down)
    assert resolved["VARIANT"] == "dot" and resolved["gate_up"]["BLOCK_N"] >= 16      # T = 5: the dot kernels
    (x1, w16_gate_up, w16_down, ids1, weights1), expected = moe_case(1, 2, 4, 32, 16, BF16, device)
    strided = w16_gate_up.transpose(1, 2).contiguous().transpose(1, 2)                  # K not contiguous
    assert not decode_fma.applies(1, strided, w16_down)
    assert moe_decode._resolve_config(x1, strided, config, w16_down)["VARIANT"] == "dot"
    assert_close(moe_decode.moe_experts_decode(x1, strided, w16_down, ids1, weights1, config), expected, BF16)
    with pytest.raises(ValueError, match="VARIANT"):
        moe_decode.moe_experts_decode(x1, w16_gate_up, w16_down, ids1, weights1, {"VARIANT": "gemv"})
    with pytest.raises(ValueError, match="power of two"):
        moe_decode.decode_activation(x1, w16_gate_up, ids1, fma_config(gate_up=(3, 16)))


def _tuned_table(variant: str) -> dict:
    return {"decode_max_tokens": 16, "decode": {"1": {
        "VARIANT": variant, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
        "down": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2},
        "fma": {"gate_up": {"BLOCK_N": 8, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1, "UNROLL": 1},
                "down": {"BLOCK_N": 16, "BLOCK_K": 8, "SPLIT_K": 2, "num_warps": 1, "num_stages": 1}}}}}


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    """A config folder of our own (the lookup caches cleared before and after)."""
    monkeypatch.setattr(moe_configs, "CONFIG_DIR", tmp_path)
    moe_configs.load_tuned.cache_clear()
    moe_configs._cached_config.cache_clear()
    yield tmp_path
    moe_configs.load_tuned.cache_clear()
    moe_configs._cached_config.cache_clear()


def test_tuned_table_selects_the_variant(tuned_dir, device):
    """The decode entry's "VARIANT" picks the kernels, "fma" holds the fma tiles; a call's VARIANT overrides."""
    x, w_gate_up, w_down, ids, weights = _to(device, *fp8_case(1, 2, 4, 32, 16, BF16, None))
    name = moe_configs.config_filename(4, 32, 16, BF16, moe_configs.device_name(x.device), "fp8")
    (tuned_dir / name).write_text(json.dumps(_tuned_table("fma")))
    resolved = moe_decode._resolve_config(x, w_gate_up, None, w_down)
    assert resolved == {"VARIANT": "fma", **_tuned_table("fma")["decode"]["1"]["fma"]}
    assert moe_decode._resolve_config(x, w_gate_up, {"VARIANT": "dot"}, w_down)["gate_up"]["BLOCK_N"] == 16
    assert moe_decode._resolve_config(x, w_gate_up, {"down": {"SPLIT_K": 1}}, w_down)["down"]["BLOCK_K"] == 8
    expected = moe_experts_reference(x, w_gate_up, w_down, ids, weights)
    assert_close(moe_decode.moe_experts_decode(x, w_gate_up, w_down, ids, weights), expected, BF16)
    (tuned_dir / name).write_text(json.dumps(_tuned_table("dot")))
    moe_configs.load_tuned.cache_clear()
    moe_configs._cached_config.cache_clear()
    assert moe_decode._resolve_config(x, w_gate_up, None, w_down)["VARIANT"] == "dot"


@pytest.mark.parametrize("variant", ["fma", "dot"])
def test_expert_passes_follow_the_variant(tuned_dir, device, variant):
    """DecodePasses (the offload's expert passes over slot tensors) run the resident shape's variant: one pass
    over a pool holding every expert gives moe_experts_decode bit for bit."""
    x, w_gate_up, w_down, ids, weights = _to(device, *fp8_case(1, 2, 4, 32, 16, FP32, None, "heavy"))
    name = moe_configs.config_filename(4, 32, 16, FP32, moe_configs.device_name(x.device), "fp8")
    (tuned_dir / name).write_text(json.dumps(_tuned_table(variant)))
    passes = DecodePasses(x, 2, 4, 16, (w_gate_up, w_down))
    assert passes.config["VARIANT"] == variant and passes.buffer.shape[0] == (2 if variant == "fma" else 1)
    passes.run(w_gate_up, w_down, ids, torch.arange(4, device=x.device), passes.buffer)
    assert torch.equal(passes.result(weights), moe_decode.moe_experts_decode(x, w_gate_up, w_down, ids, weights))


def test_stored_fp8_tables_name_a_variant():
    """Tuned decode entries that name a VARIANT name a known one, and their "fma" tiles are powers of two."""
    for path in moe_configs.CONFIG_DIR.glob("*.json"):
        for entry in json.loads(path.read_text()).get("decode", {}).values():
            assert entry.get("VARIANT", "dot") in moe_decode.VARIANTS, path.name
            for part, cfg in entry.get("fma", {}).items():
                assert part in ("gate_up", "down"), path.name
                decode_fma.check_part(cfg, part)

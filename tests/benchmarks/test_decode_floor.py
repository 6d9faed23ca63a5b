"""bench_decode's "% of floor" arithmetic on the CPU (benchmarks/decode_floor.py): the bytes a decode step must
read, by hand for Mixtral-8x7B at B=1 16k bf16, and the floor at the read bandwidth -- not the copy one, which
counts every byte twice (read + write) and made the old floor 9.99 ms where the read-bound floor is ~6.3-6.5 ms."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_decode, decode_floor, decode_report
from benchmarks.timing import read_bandwidth, tbps
from moekv.models.loader import build_random_model
from moekv.models.registry import named_arch


def _hand_weight_bytes(arch, dtype_bytes: int = 2) -> tuple[int, int]:
    """(one routed expert's bytes, the non-expert weights read per step) of a Mixtral-shaped model, by hand."""
    H, I, V = arch.hidden_size, arch.expert_intermediate_size, arch.vocab_size
    per_expert = 3 * H * I * dtype_bytes                                  # gate + up [2I, H], down [H, I]
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim * H
    per_layer = qkv + arch.num_heads * arch.head_dim * H + arch.num_experts * H + 2 * H   # + o, router, 2 norms
    rest = (arch.num_layers * per_layer + H + V * H) * dtype_bytes        # + final norm, lm_head (no embedding)
    return per_expert, rest


def test_mixtral_b1_16k_bf16_floor_at_the_read_bandwidth():
    arch = named_arch("mixtral-8x7b")
    per_expert, rest = _hand_weight_bytes(arch)
    assert (per_expert, rest) == (352_321_536, 2_949_128_192)
    nbytes = decode_floor.step_bytes(arch, per_expert, rest, moe_layers=32, batch=1, context=16384, kv_bits=16.0)
    kv = 16384 * 32 * 8 * 128 * 2 * 2                                      # tokens x layers x heads x dim x (K, V) x 2 B
    assert kv == 2**31
    assert nbytes == rest + 32 * 2 * per_expert + kv == 27_645_190_144     # B=1 touches top_k = 2 experts a layer
    # the old floor, at the copy bandwidth (2.77 TB/s, read + write): the 9.99 ms printed at B=1 16k bf16
    assert decode_floor.floor_from_bytes(nbytes, 2.77) == pytest.approx(9.980, abs=1e-3)
    # at the read bandwidth of an H200 (~4.3-4.45 TB/s) the same bytes take 6.2-6.4 ms
    assert decode_floor.floor_from_bytes(nbytes, 4.3) == pytest.approx(6.429, abs=1e-3)
    assert decode_floor.floor_from_bytes(nbytes, 4.45) == pytest.approx(6.212, abs=1e-3)
    assert decode_floor.floor_from_bytes(nbytes, None) is None
    # 8.785 ms per token (decode-h200-b1.md) is 73.2 % of the read-bound floor, not 113.7 % of a copy-bound one
    assert decode_floor.pct_of_floor(decode_floor.floor_from_bytes(nbytes, 4.3), 8.785) == pytest.approx(73.18, abs=0.01)
    assert decode_floor.pct_of_floor(None, 8.785) is None


def test_touched_experts_under_uniform_routing():
    assert decode_floor.touched_experts(8, 2, 0) == 0.0
    assert decode_floor.touched_experts(8, 2, 1) == pytest.approx(2.0)
    assert decode_floor.touched_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))       # 3.5
    assert decode_floor.touched_experts(8, 2, 64) == pytest.approx(8.0, abs=1e-6)
    assert decode_floor.touched_experts(128, 8, 1) == pytest.approx(8.0)                     # Qwen3-30B-A3B


def test_floor_of_a_model_is_the_hand_count_at_the_read_bandwidth():
    arch = named_arch("mixtral-8x7b", **bench_decode.TINY_ARCH)
    model = build_random_model(arch, dtype=torch.bfloat16)
    per_expert, rest = _hand_weight_bytes(arch)
    assert decode_floor.weight_bytes(model) == (per_expert, rest)
    kv = 4 * 96 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2 * 3.25 / 8
    by_hand = (rest + arch.num_layers * decode_floor.touched_experts(8, 2, 4) * per_expert + kv) / (2.5 * 1e9)
    assert decode_floor.floor_ms(model, 4, 96, 3.25, read_tbps=2.5) == pytest.approx(by_hand, rel=1e-12)
    assert decode_floor.floor_ms(model, 4, 96, 3.25, read_tbps=None) is None


def test_read_bandwidth_is_none_on_a_cpu_and_tbps_is_bytes_over_time():
    assert read_bandwidth(torch.device("cpu")) is None
    assert tbps(2 * 2**30, 0.5) == pytest.approx(4.295, abs=1e-3)         # 2 GiB in 0.5 ms


def test_report_names_both_bandwidths_and_floors_at_the_read_one():
    lines = decode_report.bandwidth_lines({"read_bandwidth_tbps": 4.412, "copy_bandwidth_tbps": 2.771})
    assert "read bandwidth 4.41 TB/s" in lines[0] and "copy bandwidth 2.77 TB/s" in lines[0]
    assert lines[0].index("read bandwidth") < lines[0].index("% of floor") < lines[0].index("copy bandwidth")
    assert decode_report.bandwidth_lines({"read_bandwidth_tbps": None, "copy_bandwidth_tbps": None}) == []

"""CPU-split misses (moe/prefetch/cpu_split.py): the split expert equals the unsplit one (reference and the
threaded path), an offloaded layer with split misses equals the resident experts (reference and Triton
paths), split misses are not made resident, the bundled model's greedy tokens are unchanged, and bad
configurations are ConfigErrors."""

from __future__ import annotations

import math

import pytest
import torch

from moekv.config import OffloadConfig
from moekv.entrypoints.llm import make_engine_config
from moekv.errors import ConfigError
from moekv.layers.experts import LocalExperts
from moekv.moe.prefetch.cpu_split import (SPLIT_MAX_TOKENS, CpuSplit, expert_mlp, split_channels, split_expert,
                                          split_expert_reference)
from moekv.moe.prefetch.offload import OffloadedExperts
from tests.helpers import needs_bundled_model

HIDDEN, INTER, NUM_EXPERTS = 32, 47, 8          # 47: no fraction below splits I evenly
FRACTIONS = (0.25, 0.5, 0.75)


def expert_weights(dtype=torch.float32, seed=0, inter=INTER):
    generator = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(2 * inter, HIDDEN, generator=generator) * 0.3
    w_down = torch.randn(HIDDEN, inter, generator=generator) * 0.3
    x = torch.randn(3, HIDDEN, generator=generator)
    return w_gate_up.to(dtype), w_down.to(dtype), x.to(dtype)


def test_split_channels_floor():
    assert [split_channels(INTER, f) for f in FRACTIONS] == [11, 23, 35]
    assert split_channels(INTER, 0.0) == 0 and split_channels(8, 0.5) == 4


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_split_equals_unsplit_fp32(fraction, num_tokens):
    w_gate_up, w_down, x = expert_weights()
    x = x[:num_tokens]
    want = expert_mlp(x, w_gate_up, w_down)
    reference = split_expert_reference(x, w_gate_up, w_down, fraction)
    threaded = split_expert(x, w_gate_up, w_down, fraction)
    assert reference.shape == threaded.shape == (num_tokens, HIDDEN) and threaded.dtype == torch.float32
    torch.testing.assert_close(reference, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(threaded, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(threaded, reference, rtol=1e-6, atol=1e-6)
    assert (want.abs().max() > 0.5)                  # a real output, not near zero


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_split_equals_unsplit_bf16(fraction, num_tokens):
    w_gate_up, w_down, x = expert_weights(torch.bfloat16)
    x = x[:num_tokens]
    truth = expert_mlp(x.float(), w_gate_up.float(), w_down.float())        # the same bf16 values, in fp32
    unsplit = expert_mlp(x, w_gate_up, w_down)
    for split in (split_expert_reference(x, w_gate_up, w_down, fraction),
                  split_expert(x, w_gate_up, w_down, fraction)):
        assert split.dtype == torch.bfloat16
        # The bf16 offload tests compare bit for bit (torch.equal): the split changes the summation (two bf16
        # partial outputs), so here torch's bf16 rtol with an atol of one bf16 step (2^-7 relative) at the
        # output's largest magnitude: elements near 0 after cancellation differ by that step, not by rtol.
        torch.testing.assert_close(split, unsplit, rtol=1.6e-2, atol=unsplit.float().abs().max().item() * 2 ** -7)
        # no worse than the unsplit bf16 expert against the fp32 truth, up to one bf16 rounding of the output
        err = (split.float() - truth).abs().max().item()
        base = (unsplit.float() - truth).abs().max().item()
        assert err <= 2 * base + truth.abs().max().item() * 2 ** -8, (err, base)


def local_experts(dtype=torch.float32, seed=0):
    local = LocalExperts(NUM_EXPERTS, HIDDEN, INTER, 0, dtype, "cpu")
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        local.w_gate_up.copy_(torch.randn(local.w_gate_up.shape, generator=generator) * 0.3)
        local.w_down.copy_(torch.randn(local.w_down.shape, generator=generator) * 0.3)
    return local


def split_layer(local, num_slots, fraction=0.5):
    offloaded = OffloadedExperts.standalone(0, *local.weights(), num_slots, torch.device("cpu"))
    offloaded.split = CpuSplit(fraction, offloaded.host, torch.device("cpu"), offloaded.copier, top_k=2)
    offloaded.events = []
    return offloaded


# 1 and 3 tokens: the decode kernel; 24 tokens: the grouped kernel, with experts of <= 4 rows split and the
# others copied (several passes with 2 slots); at most 2 * top_k = 4 split misses per block (one per part buffer)
@pytest.mark.parametrize("num_slots", [2, 3])
def test_offloaded_layer_with_split_misses_matches_resident(backend, num_slots):
    local = local_experts()
    offloaded = split_layer(local, num_slots)
    generator = torch.Generator().manual_seed(2)
    for num_tokens in (1, 1, 3, 24, 1, 1):
        hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
        topk_ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:2] for _ in range(num_tokens)])
        topk_weights = torch.softmax(torch.randn(num_tokens, 2, generator=generator), -1)
        before = set(offloaded.cache.resident_experts())
        offloaded.events.clear()
        got = offloaded(hidden, topk_ids, topk_weights)
        torch.testing.assert_close(got, local(hidden, topk_ids, topk_weights), rtol=1e-5, atol=1e-5)
        counts = torch.bincount(topk_ids.reshape(-1), minlength=NUM_EXPERTS).tolist()
        missing = [e for e in range(NUM_EXPERTS) if counts[e] and e not in before]
        few = [e for e in missing if counts[e] <= SPLIT_MAX_TOKENS]
        free = max(0, num_slots - len(before) - (len(missing) - len(few)))     # empty slots fill with whole copies
        split = few[free:][:4]
        events = [e for e in offloaded.events if e[0] == "split"]
        assert events == ([("split", 0, tuple(split))] if split else [])
        loaded = {e[2] for e in offloaded.events if e[0] == "load"}
        assert not loaded & set(split)                                    # split misses are not copied whole
        assert loaded == {e for e in range(NUM_EXPERTS) if counts[e] and e not in before and e not in split}
        assert not set(offloaded.cache.resident_experts()) & set(split)   # ... nor made resident
        assert len(offloaded.cache.resident_experts()) == min(num_slots, len(before | set(missing)))
    stats = offloaded.cache.counters
    assert stats.split_misses > 0 and stats.split_misses <= stats.misses
    assert offloaded.split.experts == stats.split_misses


def test_split_copies_only_the_device_share():
    local = local_experts()
    offloaded = split_layer(local, 2, fraction=0.75)
    copier = offloaded.copier
    step = torch.randn(1, HIDDEN), torch.full((1, 2), 0.5)
    offloaded(step[0], torch.tensor([[0, 1]]), step[1])                   # empty slots: whole copies
    assert copier.copies == 2 and copier.bytes == 2 * 3 * HIDDEN * INTER * 4
    assert offloaded.cache.resident_experts() == [0, 1] and offloaded.cache.counters.split_misses == 0
    copier.reset_counters()
    offloaded(step[0], torch.tensor([[2, 3]]), step[1])                   # a full cache: split misses
    rest = INTER - split_channels(INTER, 0.75)
    assert copier.copies == 2 and copier.bytes == 2 * 3 * HIDDEN * rest * 4     # (1 - f) of each expert, fp32
    assert offloaded.cache.resident_experts() == [0, 1] and offloaded.cache.counters.split_misses == 2
    assert offloaded.split.part_bytes() == 3 * HIDDEN * rest * 4


def test_fp8_host_experts_are_not_split():
    local = local_experts()
    offloaded = OffloadedExperts.standalone(0, *local.weights(), 2, torch.device("cpu"), host_format="fp8")
    with pytest.raises(ConfigError, match="16-bit host experts only"):
        CpuSplit(0.5, offloaded.host, torch.device("cpu"), offloaded.copier, top_k=2)


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, True, "0.5", math.nan, None])
def test_bad_fractions_are_config_errors(value):
    with pytest.raises(ConfigError, match="cpu_compute_fraction must be a number in \\[0, 1\\)"):
        OffloadConfig(cpu_offload_experts=True, cpu_compute_fraction=value)


@pytest.mark.parametrize("others, why", [({"staging": "device"}, "staging='host'"),
                                         ({"host_format": "fp8"}, "16-bit host experts only"),
                                         ({"prefetch_threshold": "auto"}, "staged prefetch policy")])
def test_fraction_with_unsupported_modes_is_a_config_error(others, why):
    with pytest.raises(ConfigError, match=why):
        OffloadConfig(cpu_offload_experts=True, cpu_compute_fraction=0.5, **others)


def test_fraction_routes_from_llm_kwargs_and_cli():
    import argparse

    from moekv.entrypoints import generate_cli

    assert make_engine_config("m", cpu_offload_experts=True, cpu_compute_fraction=0.25).offload == \
        OffloadConfig(cpu_offload_experts=True, cpu_compute_fraction=0.25)
    assert OffloadConfig().cpu_compute_fraction == 0.0
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    assert parser.parse_args(["--prompt", "x", "--cpu-compute-fraction", "0.5"]).cpu_compute_fraction == 0.5


@needs_bundled_model
def test_bundled_model_greedy_tokens_with_split_misses():
    from moekv.entrypoints.llm import LLM
    from moekv.paths import default_model_dir
    from moekv.sampling import SamplingParams

    prompts = ["ROMEO:\nBut soft, what light", "First Citizen:\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    common = dict(dtype="fp32", device="cpu", max_model_len=256, num_pages=64)
    model = str(default_model_dir())
    expected = [o.outputs[0].token_ids for o in LLM(model, **common).generate(prompts, params)]
    for prefetch in (False, True):
        llm = LLM(model, cpu_offload_experts=True, expert_cache_size="50%", cpu_compute_fraction=0.5,
                  prefetch=prefetch, **common)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        stats = llm.engine.routing_stats()["offload"]
        assert stats["split_misses"] > 0 and stats["cpu_split"]["split_experts"] == stats["split_misses"]
        assert stats["misses"] > stats["split_misses"]         # the prefill's crowded experts still load whole
        assert stats["cpu_split"]["cpu_channels"] == stats["cpu_split"]["inter"] // 2

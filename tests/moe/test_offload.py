"""Offloaded experts: slot-indexed compute equals resident compute, prefetch ordering and
protection, misses load synchronously, greedy output identical to all experts resident."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekv.config import OffloadConfig
from moekv.models.loader import build_random_model
from moekv.layers.experts import LocalExperts
from moekv.moe.prefetch import ExpertOffload, ExpertPredictor, install_routing
from moekv.moe.prefetch.offload import OffloadedExperts
from tests.hf_fixtures import moekv_greedy
from tests.moe.conftest import tiny_arch


def random_local_experts(num_experts=6, hidden=16, inter=24, seed=0):
    local = LocalExperts(num_experts, hidden, inter, 0, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        local.w_gate_up.normal_(0, 0.3, generator=generator)
        local.w_down.normal_(0, 0.3, generator=generator)
    return local


@pytest.mark.parametrize("num_slots", [1, 2, 3, 6])
def test_slot_indexed_compute_matches_resident(num_slots):
    local = random_local_experts()
    offloaded = OffloadedExperts.standalone(0, local.w_gate_up.detach(), local.w_down.detach(), num_slots,
                                            torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    for num_tokens in (1, 5, 12):                  # 12 tokens x top-2 touch more experts than slots
        hidden = torch.randn(num_tokens, 16, generator=generator)
        topk_ids = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(num_tokens)])
        topk_weights = torch.rand(num_tokens, 2, generator=generator)
        expected = local(hidden, topk_ids, topk_weights)
        actual = offloaded(hidden, topk_ids, topk_weights)
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
        if len(topk_ids.unique()) <= num_slots:
            assert torch.equal(actual, expected)   # one pass: bit-identical
    assert offloaded.cache.protection == [0] * 6   # nothing stays protected after a step


def test_prefetch_runs_before_compute_and_misses_load_first(tiny_model):
    model = tiny_model()
    offload = ExpertOffload(model, num_slots=2)
    offload.trace_events()
    layer0, layer1 = offload.layers[0], offload.layers[1]
    hidden = torch.randn(1, model.arch.hidden_size)
    weights = torch.full((1, 2), 0.5)
    # A prediction for layer 1 made during layer 0 (source "attn": queued until layer 0's misses are issued).
    offload._on_prediction(0, 1, 1, torch.tensor([[3, 5]]))
    assert layer1.events == []                                     # not issued yet
    layer0(hidden, torch.tensor([[0, 1]]), weights)
    assert layer0.events[:2] == [("load", 0, 0, 0), ("load", 0, 1, 1)]
    assert [e[:3] for e in layer1.events] == [("prefetch", 1, 3), ("prefetch", 1, 5)]
    assert layer1.cache.protection[3] == layer1.cache.protection[5] == 2   # PREDICTED for this step
    # Layer 1 needs 3 (prefetched) and 6 (a miss): 6 must evict the unneeded prediction 5, never 3.
    layer1(hidden, torch.tensor([[6, 3]]), weights)
    assert layer1.events[2][:3] == ("load", 1, 6)
    assert layer1.events[3][0] == "compute" and set(layer1.events[3][2]) == {3, 6}
    assert layer1.cache.is_resident(3) and layer1.cache.is_resident(6) and not layer1.cache.is_resident(5)
    counters = layer1.cache.counters
    assert (counters.hits, counters.prefetch_hits, counters.misses, counters.wasted_prefetches) == (1, 1, 1, 1)
    assert layer1.cache.protection == [0] * 8


def test_prediction_from_a_dense_layer_is_issued_at_once():
    # Layer 1 is dense: no offloaded block runs there to drain the queue, so a prediction made at
    # layer 1 for layer 2 must be issued at once (queued, layer 2 would drop it as stale).
    arch = dataclasses.replace(tiny_arch(), dense_layers=(1,), dense_intermediate_size=48)
    model = build_random_model(arch, torch.float32, "cpu", seed=0)
    offload = ExpertOffload(model, num_slots=2)
    offload.trace_events()
    assert sorted(offload.layers) == [0, 2]
    offload._on_prediction(1, 2, 1, torch.tensor([[3, 5]]))
    layer2 = offload.layers[2]
    assert [e[:3] for e in layer2.events] == [("prefetch", 2, 3), ("prefetch", 2, 5)]
    layer2(torch.randn(1, model.arch.hidden_size), torch.tensor([[3, 5]]), torch.full((1, 2), 0.5))
    assert (layer2.cache.counters.prefetch_hits, layer2.cache.counters.misses) == (2, 0)


def test_prefetched_expert_is_resident_before_its_block_runs(tiny_model):
    model = tiny_model(seed=4)
    predictor = ExpertPredictor(model, lookahead=2, extra_candidates=1)
    offload = ExpertOffload(model, num_slots=3, predictor=predictor)
    offload.trace_events()
    moekv_greedy(model, [[1, 2, 3]], max_new_tokens=6)
    computes = 0
    for experts in offload.layers.values():
        in_slot: dict[int, int] = {}                              # slot -> expert copied there last
        for event in experts.events:
            if event[0] in ("load", "prefetch"):
                in_slot[event[3]] = event[2]
            else:                                                 # compute: each expert's slot holds it
                _, _, group, slots = event
                assert all(in_slot.get(slot) == expert for expert, slot in zip(group, slots))
                computes += 1
        assert experts.events[-1][0] == "compute"
    assert computes >= 3 * 6      # 3 layers x (prefill, in passes when it needs > 3 experts, + 5 decodes)
    stats = offload.stats()
    assert stats["prefetches"] > 0 and stats["hits"] + stats["misses"] > 0
    assert stats["copies"] == stats["prefetches"] + stats["misses"]     # every copy is one or the other


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    """A tiny random HF Mixtral checkpoint (3 layers, 8 experts top-2) and its resident greedy run."""
    from moekv.models.loader import load_model
    from tests.hf_fixtures import make_checkpoint

    folder, _ = make_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral", num_layers=3, num_experts=8,
                                top_k=2)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    tokens, logits = moekv_greedy(load_model(folder, dtype=torch.float32), prompts, max_new_tokens=10)
    return folder, prompts, tokens, logits


@pytest.mark.parametrize("config", [
    dict(expert_cache_size=1),
    dict(expert_cache_size=2, prefetch=False),
    dict(expert_cache_size="50%", eviction="lfu"),
    dict(expert_cache_size=3, lookahead=2, extra_candidates=1),
])
def test_greedy_output_matches_all_experts_resident(hf_mixtral, config):
    from moekv.models.loader import load_model

    folder, prompts, expected, expected_logits = hf_mixtral
    model = load_model(folder, dtype=torch.float32)
    runtime = install_routing(model, OffloadConfig(cpu_offload_experts=True, **config))
    assert all(isinstance(layer.mlp.experts, OffloadedExperts) for layer in model.layers)
    tokens, logits = moekv_greedy(model, prompts, max_new_tokens=10)
    assert tokens == expected
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    offload = runtime.stats()["offload"]
    assert offload["misses"] > 0 and offload["hits"] + offload["misses"] > 0
    assert (offload["prefetches"] > 0) == config.get("prefetch", True)

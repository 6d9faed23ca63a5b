"""Routing traces: a replayed trace reproduces the recorded routing, and the replayed predictions
give the recall the trace holds."""

from __future__ import annotations

import torch

from moekv.moe.prefetch import ExpertOffload
from moekv.moe.prefetch.trace import TracePredictor, TraceRouter, record_trace, replay_trace, run_windows


def test_record_then_replay_reproduces_routing_and_recall(tiny_model):
    source = tiny_model(seed=5)
    tokens = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    trace = record_trace(source, tokens, window=16, extra_candidates=1)
    assert trace.routed.shape == (3, 40, 2)
    assert trace.predicted[("attn", 1)][0].shape == (40, 3)        # layer 0: from the embeddings
    assert trace.predicted[("attn", 2)][0] is None
    # Replayed into a model of 6 layers: layer l plays trace layer l % 3, shifted by (l // 3) * 7 tokens.
    target = tiny_model(seed=9, num_layers=6)
    mapping = replay_trace(target, trace, token_stride=7)
    assert mapping == [(0, 0), (1, 0), (2, 0), (0, 7), (1, 7), (2, 7)]
    assert all(isinstance(layer.mlp.router, TraceRouter) for layer in target.layers)
    predictor = TracePredictor(target, lookahead=1, extra_candidates=0)
    offload = ExpertOffload(target, num_slots=4, predictor=predictor)
    seen = {}
    handles = [layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: seen.setdefault(i, []).append(out[1]))
               for i, layer in enumerate(target.layers)]
    run_windows(target, tokens, window=20)                          # 2 forwards of 20 tokens
    for handle in handles:
        handle.remove()
    assert torch.equal(torch.cat(seen[1]), trace.routed[1])
    assert torch.equal(torch.cat(seen[4]), torch.roll(trace.routed[1], -7, dims=0))
    # Every layer replays a full pass over the trace, so the replayed recall is the trace's recall.
    recall = predictor.recall()["overall"][1]
    assert abs(recall - trace.recall(1, 2)) < 1e-6
    assert offload.stats()["prefetches"] > 0


def test_simulation_matches_the_offloaded_model_counter_for_counter(tiny_model):
    """simulate_cache mirrors OffloadedExperts + ExpertOffload: batch-1 decode of a replayed trace gives
    the same misses, prefetches and hits."""
    from moekv.moe.prefetch.trace import simulate_cache
    from tests.hf_fixtures import moekv_greedy

    source = tiny_model(seed=6)
    tokens = torch.randint(0, 64, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    trace = record_trace(source, tokens, window=24, extra_candidates=1)
    for slots, width in [(2, 2), (3, 3), (4, None)]:
        target = tiny_model(seed=7)
        replay_trace(target, trace)
        predictor = TracePredictor(target, lookahead=1, extra_candidates=(width or 2) - 2)
        offload = ExpertOffload(target, num_slots=slots, predictor=predictor if width else None)
        moekv_greedy(target, [[1]], max_new_tokens=20)                 # 20 forwards of one token each
        stats = offload.stats()
        sim = simulate_cache(trace, slots, width, num_tokens=20)
        steps = 3 * 20
        assert stats["misses"] == round(sim["misses_per_layer_token"] * steps)
        assert stats["copies"] == round(sim["copies_per_layer_token"] * steps)
        assert stats["hit_rate"] == sim["hit_rate"]


def test_optimal_eviction_hand_made_and_never_worse_than_lru():
    from moekv.moe.prefetch.trace import RoutingTrace, simulate_cache, simulate_optimal_eviction

    # one layer, top-1, 2 slots: A B C A B C ... LRU misses every time; Belady keeps one of A / B
    routed = torch.tensor([[0], [1], [2]] * 4).unsqueeze(0)                  # [1, 12, 1]
    trace = RoutingTrace(routed, {("attn", 1): [None], ("attn", 2): [None]})
    assert simulate_cache(trace, 2)["copies_per_layer_token"] == 1.0
    optimal = simulate_optimal_eviction(trace, 2)
    assert optimal["copies_per_layer_token"] == 7 / 12     # 3 cold misses, then one miss every other token
    generator = torch.Generator().manual_seed(0)
    routed = torch.stack([torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(200)])
                          for _ in range(3)])                                 # [3, 200, 2]
    trace = RoutingTrace(routed, {("attn", 1): [None] * 3, ("attn", 2): [None] * 3})
    for slots in (2, 4, 6):
        assert simulate_optimal_eviction(trace, slots)["copies_per_layer_token"] <= \
            simulate_cache(trace, slots)["copies_per_layer_token"]


def test_copy_timing_counts_every_copy(tiny_model):
    model = tiny_model()
    offload = ExpertOffload(model, num_slots=2, time_copies=True)
    layer = offload.layers[0]
    layer(torch.randn(1, model.arch.hidden_size), torch.tensor([[0, 1]]), torch.full((1, 2), 0.5))
    assert offload.copier.copies == 2 and offload.copier.copy_seconds() > 0
    offload.reset_stats()
    assert offload.copier.copies == 0 and offload.copier.copy_seconds() == 0.0

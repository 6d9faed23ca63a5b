"""Expert load statistics: hot / cold experts, shares, imbalance, the decayed window."""

from __future__ import annotations

import torch

from moekv.moe.load_stats import ExpertLoadTracker, cold_experts, hot_experts, load_imbalance, load_share


def test_hot_and_cold_experts_per_layer_with_ties():
    load = torch.tensor([[5, 9, 1, 9], [0, 0, 0, 0]])
    assert hot_experts(load, 2).tolist() == [[1, 3], [0, 1]]
    assert cold_experts(load, 2).tolist() == [[2, 0], [0, 1]]
    assert hot_experts(torch.tensor([3, 7, 5]), 1).tolist() == [1]
    assert hot_experts(load, 10).shape == (2, 4)


def test_share_and_imbalance():
    load = torch.tensor([[2, 2, 2, 2], [8, 0, 0, 0], [0, 0, 0, 0]])
    assert load_share(load)[1].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert load_share(load)[2].tolist() == [0.0] * 4
    assert load_imbalance(load).tolist() == [1.0, 4.0, 1.0]


def test_window_decays_and_survives_a_reset():
    counter = torch.zeros(1, 3, dtype=torch.int64)
    tracker = ExpertLoadTracker(counter, decay=0.5)
    counter += torch.tensor([[4, 0, 2]])
    tracker.update()                                   # window = [4, 0, 2]
    counter += torch.tensor([[0, 8, 0]])
    tracker.update()                                   # window = [2, 8, 1]
    assert tracker.window.tolist() == [[2.0, 8.0, 1.0]]
    counter.zero_()
    counter += torch.tensor([[2, 0, 0]])               # reset, then 2 new slots for expert 0
    tracker.update()                                   # window = [1 + 2, 4, 0.5]
    assert tracker.window.tolist() == [[3.0, 4.0, 0.5]]
    snap = tracker.snapshot(k=1)
    assert snap["total"] == [[2, 0, 0]]
    assert snap["hot_experts"] == [[1]]                # by the window, not the total
    assert snap["window"] == [[1.5, 2.0, 0.25]]        # one more (empty) step folded in at read time


def test_fold_is_update_without_the_step_count_and_an_idle_step_keeps_the_window():
    """fold() is update()'s device half (a CUDA-graph decode step captures it; the host counts the step); with
    live 0 (a padding-only collective step) the window neither decays nor changes."""
    counter = torch.zeros(1, 3, dtype=torch.int64)
    eager, folded = ExpertLoadTracker(counter, decay=0.5), ExpertLoadTracker(counter, decay=0.5)
    counter += torch.tensor([[4, 0, 2]])
    eager.update()
    folded.fold(torch.tensor([1]))
    counter += torch.tensor([[0, 8, 0]])
    eager.update()
    folded.fold()
    assert torch.equal(eager.window, folded.window) and eager.steps == 2 and folded.steps == 0
    folded.fold(torch.tensor([0]))                     # idle: nothing routed, nothing decays
    assert folded.window.tolist() == [[2.0, 8.0, 1.0]]
    folded.fold(torch.tensor([1]))                     # a live step with nothing routed decays it
    assert folded.window.tolist() == [[1.0, 4.0, 0.5]]

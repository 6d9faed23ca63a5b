"""Expert prediction: recall counting on hand-made cases, and the predictor's counters on a model
against an independent recomputation."""

from __future__ import annotations

import pytest
import torch

from moekv.moe.prefetch.predictor import ExpertPredictor, recall_counts, recall_counts_by_width
from tests.hf_fixtures import moekv_greedy


def test_recall_counts_hand_made():
    predicted = torch.tensor([[0, 1], [2, 3], [4, 5]])
    routed = torch.tensor([[1, 7], [3, 2], [6, 0]])
    assert int(recall_counts(predicted, routed)) == 3         # 1 + 2 + 0 of 6 routed pairs
    assert int(recall_counts(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[3, 0]]))) == 2
    assert int(recall_counts(torch.tensor([[5]]), torch.tensor([[5, 5]]))) == 2   # per routed pair


def capture(model):
    """Residual before each layer's post_attn_norm, the embeddings, and routed ids, per layer."""
    seen = {"residual": {}, "routed": {}}
    handles = [model.embed_tokens.register_forward_hook(lambda m, a, out: seen["residual"].__setitem__(-1, out))]
    for i, layer in enumerate(model.layers):
        handles.append(layer.post_attn_norm.register_forward_hook(
            lambda m, a, out, i=i: seen["residual"].__setitem__(i, a[0])))
        handles.append(layer.mlp.router.register_forward_hook(
            lambda m, a, out, i=i: seen["routed"].__setitem__(i, out[1])))
    return seen, handles


@pytest.mark.parametrize("extra", [0, 1])
def test_predictor_counters_match_a_recomputation(tiny_model, extra):
    model = tiny_model(seed=3)
    predictor = ExpertPredictor(model, lookahead=2, extra_candidates=extra)
    seen, handles = capture(model)
    moekv_greedy(model, [[5, 9, 11, 2, 40, 33, 7]], max_new_tokens=1)   # one forward of 7 tokens
    for handle in handles:
        handle.remove()
    width = model.arch.top_k + extra
    for target in range(model.arch.num_layers):
        routed = seen["routed"][target]                                              # [T, k]
        gain, weight = model.layers[target].post_attn_norm.weight, model.layers[target].mlp.router.weight
        for distance in (1, 2):
            source = target - distance
            if source < -1:
                assert int(predictor.routed[target, distance - 1]) == 0
                continue
            guess = torch.topk((seen["residual"][source] * gain) @ weight.T, width).indices   # [T, P]
            hits = int((routed.unsqueeze(-1) == guess.unsqueeze(1)).any(-1).sum())
            assert int(predictor.hits[target, distance - 1]) == hits
            assert int(predictor.routed[target, distance - 1]) == routed.numel()
    recall = predictor.recall()
    assert recall["per_layer"][2][0] is None and recall["per_layer"][1][0] is not None
    total_hits = int(predictor.hits[:, 0].sum())
    assert recall["overall"][1] == pytest.approx(total_hits / int(predictor.routed[:, 0].sum()))
    assert recall["precision"][1] == pytest.approx(total_hits / int(predictor.predicted[:, 0].sum()))
    # recall of every prefix width, one wider than the guess: width P is the headline recall
    by_width = recall["by_width"][1]
    assert sorted(by_width) == list(range(1, width + 2))
    assert by_width[width]["recall"] == pytest.approx(recall["overall"][1])
    assert by_width[width]["precision"] == pytest.approx(recall["precision"][1])
    assert all(by_width[w]["recall"] <= by_width[w + 1]["recall"] for w in range(1, width + 1))


def test_recall_counts_by_width_hand_made():
    predicted = torch.tensor([[0, 1, 2], [3, 4, 5]])                   # [T, W]
    routed = torch.tensor([[1, 2], [5, 6]])                            # [T, k]
    assert recall_counts_by_width(predicted, routed).tolist() == [0, 1, 3]
    assert int(recall_counts_by_width(predicted, routed)[-1]) == int(recall_counts(predicted, routed))


def test_predicting_every_expert_has_full_recall(tiny_model):
    model = tiny_model()
    predictor = ExpertPredictor(model, lookahead=2, extra_candidates=model.arch.num_experts)
    moekv_greedy(model, [[1, 2, 3, 4]], max_new_tokens=3)
    recall = predictor.recall()
    assert recall["overall"] == {1: 1.0, 2: 1.0}
    assert recall["experts_predicted_per_token"] == model.arch.num_experts


def test_norm_variants_agree_when_norm_weights_are_ones(tiny_model):
    model = tiny_model(seed=1)                       # build_random_model: RMSNorm weights are 1
    predictors = [ExpertPredictor(model, 1, 0, norm=norm) for norm in ("next", "current", "none")]
    moekv_greedy(model, [[3, 1, 4, 1, 5, 9, 2, 6]], max_new_tokens=4)
    assert len({tuple(p.hits[:, 0].tolist()) for p in predictors}) == 1
    for p in predictors:
        p.remove()
    assert predictors[0]._handles == []


def test_layer_out_source_predicts_from_the_layer_output(tiny_model):
    model = tiny_model(seed=2)
    predictor = ExpertPredictor(model, lookahead=1, source="layer_out")
    outputs = {}
    handles = [layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out))
               for i, layer in enumerate(model.layers)]
    routed = {}
    handles += [layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: routed.__setitem__(i, out[1]))
                for i, layer in enumerate(model.layers)]
    moekv_greedy(model, [[7, 8, 9, 10, 11]], max_new_tokens=1)
    target = 2
    gain, weight = model.layers[target].post_attn_norm.weight, model.layers[target].mlp.router.weight
    guess = torch.topk((outputs[target - 1] * gain) @ weight.T, 2).indices
    hits = int((routed[target].unsqueeze(-1) == guess.unsqueeze(1)).any(-1).sum())
    assert int(predictor.hits[target, 0]) == hits

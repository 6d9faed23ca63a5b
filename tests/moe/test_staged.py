"""The staged prefetch policy (policy.py, staged.py): never slower than loading on demand in the copy /
compute timeline simulator, the same cache contents as on demand, greedy tokens equal to the resident
model with real staged copies (CPU, a fixed timeline), and the margin calibration behind "auto"."""

from __future__ import annotations

import math

import pytest
import torch

from moekv.config import OffloadConfig
from moekv.errors import ConfigError
from moekv.moe.prefetch import install_routing
from moekv.moe.prefetch.policy import MarginCalibration, StagingPolicy, Timeline
from moekv.moe.prefetch.timeline import simulate_decode
from moekv.moe.prefetch.trace import RoutingTrace, record_trace
from tests.helpers import bundled_model
from tests.hf_fixtures import moekv_greedy


@pytest.fixture(scope="module")
def bundled_trace():
    """Routing and 1-ahead guesses (with margins) of the bundled model on 512 validation tokens."""
    from moekv import datasets
    from moekv.models.loader import load_model
    from moekv.tokenizer import Tokenizer

    folder = bundled_model()
    if folder is None:
        pytest.skip("needs the bundled checkpoint (models/tiny-shakespeare-moe), not in this checkout")
    ids = Tokenizer(folder).encode(datasets.validation_text())[:512]
    return record_trace(load_model(folder, dtype=torch.float32, device="cpu"), ids, window=256, extra_candidates=1)


def synthetic_trace(num_layers=4, num_tokens=96, num_experts=8, right=True, seed=0) -> RoutingTrace:
    """Random top-2 routing; guesses either exactly right or never right, all with a large margin."""
    generator = torch.Generator().manual_seed(seed)
    routed = torch.stack([torch.stack([torch.randperm(num_experts, generator=generator)[:2]
                                       for _ in range(num_tokens)]) for _ in range(num_layers)])   # [L, N, 2]
    guesses, margins = [], []
    for layer in range(num_layers):
        if right:
            guess = routed[layer].clone()
        else:                                  # two experts the layer does not route to
            guess = torch.stack([torch.tensor([e for e in range(num_experts) if e not in row][:2]) for row in
                                 routed[layer].tolist()])
        guesses.append(guess)
        margins.append(torch.full(guess.shape, 0.9))
    return RoutingTrace(routed, {("attn", 1): guesses}, {("attn", 1): margins})


# copy / window ratios from 0.5 (a fast link) to 8.6 (PCIe and a small model) and an H200-like 4.3
CASES = [(6.36, 0.74, 0.74), (1.0, 1.0, 1.0), (3.0, 0.2, 0.5), (0.5, 0.5, 0.5)]


@pytest.mark.parametrize("slots", [2, 4, 6])
@pytest.mark.parametrize("copy_ms,attn_ms,expert_ms", CASES)
def test_staged_is_never_slower_than_on_demand_on_real_routing(bundled_trace, slots, copy_ms, attn_ms, expert_ms):
    kwargs = dict(copy_ms=copy_ms, attn_ms=attn_ms, expert_ms=expert_ms, num_tokens=256)
    on_demand = simulate_decode(bundled_trace, slots, "on-demand", **kwargs)
    for threshold in ("auto", 0.0, 0.3):
        staged = simulate_decode(bundled_trace, slots, "staged", threshold=threshold, **kwargs)
        worse = [(i, a, b) for i, (a, b) in enumerate(zip(staged["step_ms"], on_demand["step_ms"])) if a > b + 1e-9]
        assert not worse, worse[:3]
        assert (staged["hits"], staged["misses"]) == (on_demand["hits"], on_demand["misses"])   # same caches
        assert staged["staged"]["overruns"] == 0
    assert staged["staged"]["promoted"] > 0
    assert staged["ms_per_token"] < on_demand["ms_per_token"]            # right guesses start copies early


def test_the_first_prefetch_can_be_slower_and_staged_is_not(bundled_trace):
    """What the H200 measured (docs/expert-offload.md): over PCIe copying every guess loses."""
    kwargs = dict(copy_ms=6.36, attn_ms=0.74, expert_ms=0.74, num_tokens=256)
    on_demand = simulate_decode(bundled_trace, 4, "on-demand", **kwargs)["ms_per_token"]
    assert simulate_decode(bundled_trace, 4, "prefetch", **kwargs)["ms_per_token"] > on_demand
    assert simulate_decode(bundled_trace, 4, "staged", **kwargs)["ms_per_token"] < on_demand


@pytest.mark.parametrize("right", [True, False])
def test_adversarial_guesses(right):
    trace = synthetic_trace(right=right)
    kwargs = dict(copy_ms=2.0, attn_ms=0.5, expert_ms=0.5)
    on_demand = simulate_decode(trace, 3, "on-demand", **kwargs)
    staged = simulate_decode(trace, 3, "staged", threshold=0.5, **kwargs)
    assert all(a <= b + 1e-9 for a, b in zip(staged["step_ms"], on_demand["step_ms"]))
    assert staged["misses"] == on_demand["misses"]
    counters = staged["staged"]
    if right:       # every guess is promoted; each saves the window (1 ms) of its 2 ms copy
        assert counters["dropped"] == 0 and counters["promoted"] > 0
        assert staged["ms_per_token"] < on_demand["ms_per_token"] - 0.5
    else:           # every guess is dropped, and costs nothing
        assert counters["promoted"] == 0 and counters["dropped"] > 0
        assert staged["step_ms"] == pytest.approx(on_demand["step_ms"])
    # "auto" learns from the wrong guesses that margin 0.9 means nothing here and stops staging
    auto = simulate_decode(trace, 3, "staged", threshold="auto", **kwargs)["staged"]
    assert (auto["margin_threshold_now"] == math.inf) != right


def test_margin_calibration_and_auto_threshold():
    calibration = MarginCalibration(min_samples=4)
    for _ in range(10):
        calibration.observe({0: 0.6, 1: 0.25, 2: 0.02}, routed={0, 1})      # 0.6 and 0.25 right, 0.02 wrong
    assert calibration.precision(0.6) == 1.0 and calibration.precision(0.02) == 0.0
    assert calibration.precision(-0.5) is None                              # no samples
    assert calibration.threshold_for(0.9) == 0.2                            # bucket [0.2, 0.3) and above
    assert calibration.threshold_for(0.0) == 0.0
    policy = StagingPolicy("auto", chunks=8, calibration=calibration)
    timeline = Timeline(copy_ms=8.0, default_window_ms=1.0)
    # gain = min(window, copy) = 1 ms, risk = one 1 ms chunk x overrun rate
    assert policy.needed_precision(timeline, 0, overrun_rate=1.0) == pytest.approx(0.5)
    assert policy.needed_precision(timeline, 0, overrun_rate=0.0) == 0.0
    assert policy.margin_threshold(timeline, 0, 1.0) == 0.2
    assert StagingPolicy(0.1, chunks=8).margin_threshold(timeline, 0) == 0.1
    assert policy.budget_chunks(timeline, 2.5) == 2 and policy.budget_chunks(timeline, -1.0) == 0


@pytest.mark.parametrize("value", ["always", 1.5, True])
def test_threshold_config_errors(value):
    with pytest.raises(ConfigError, match="prefetch_threshold"):
        OffloadConfig(cpu_offload_experts=True, prefetch_threshold=value)
    with pytest.raises(ConfigError, match="staging='device'"):
        OffloadConfig(cpu_offload_experts=True, staging="device", prefetch_threshold=0.1)


def test_staged_copies_keep_greedy_tokens_and_on_demand_caches(tiny_model):
    """Real staged copies on the CPU (a fixed timeline stands in for the copy stream's idle time): the same
    greedy tokens as all experts resident, and the same hits and misses as loading on demand."""
    prompt = [[1, 2, 3, 4, 5]]
    expected, _ = moekv_greedy(tiny_model(seed=3), prompt, max_new_tokens=24)

    def run(**config):
        model = tiny_model(seed=3)
        runtime = install_routing(model, OffloadConfig(cpu_offload_experts=True, expert_cache_size=3, **config))
        staged = runtime.offload.staged
        if staged is not None:
            staged.fixed = Timeline(copy_ms=1.0, default_window_ms=0.3)      # 2 of 8 chunks per window
        tokens, _ = moekv_greedy(model, prompt, max_new_tokens=24)
        return tokens, runtime.stats()["offload"]

    on_demand_tokens, on_demand = run(prefetch=False)
    tokens, stats = run(prefetch_threshold=-1.0, lookahead=2, extra_candidates=1)
    assert tokens == on_demand_tokens == expected
    assert (stats["hits"], stats["misses"]) == (on_demand["hits"], on_demand["misses"])
    staged = stats["staged"]
    assert staged["promoted"] > 0 and staged["dropped"] > 0 and staged["chunks"] > 0
    assert stats["staged_hits"] == staged["promoted"]
    assert stats["prefetches"] == 0                     # guesses never take a cache slot

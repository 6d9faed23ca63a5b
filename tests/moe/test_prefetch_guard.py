"""moe/prefetch/guard.py: prefetch kept on only while it measures faster than loading on demand.

The guard's schedule on an injected clock (explore, hold, probe, the hold doubling, regimes apart, idle gaps),
then the engine: the bundled model with offloaded experts keeps its greedy tokens whichever side runs, and a
clock that makes guesses cost time turns the predictor off."""

from __future__ import annotations

import pytest

from moekv.errors import ConfigError
from moekv.moe.prefetch.guard import PrefetchGuard
from moekv.offload_config import OffloadConfig
from tests.helpers import bundled_model, needs_bundled_model


class StepClock:
    """Host clock of a run whose steps take cost(on) seconds: begin() reads it once per step."""

    def __init__(self, cost):
        self.cost, self.now, self.side = cost, 0.0, None

    def __call__(self):
        if self.side is not None:
            self.now += self.cost(self.side)
        return self.now


def run(guard, clock, steps, key=1):
    sides = []
    for _ in range(steps):
        clock.side = None if not sides else sides[-1]
        sides.append(guard.begin(key))
    return sides


def test_explore_alternates_then_keeps_the_faster_side():
    for on_cost, expected in ((1.0, True), (2.0, False)):
        clock = StepClock(lambda on: on_cost if on else 1.5)
        guard = PrefetchGuard(window=4, rounds=2, hold=3, clock=clock)
        sides = run(guard, clock, 4 * 4 + 12)
        # windows of 4: on, off, on, off; decided at the 17th step's begin (it closes the 16th step); hold 3 windows
        assert sides[:16] == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 4
        assert sides[16:28] == [expected] * 12
        regime = guard.stats()["regimes"]["1"]
        assert regime["prefetch"] is expected and regime["phase"] == "hold"
        assert regime["median_ms_on"] == pytest.approx(on_cost * 1e3)
        assert regime["median_ms_off"] == pytest.approx(1.5e3)


def test_a_tie_keeps_prefetch_off():
    clock = StepClock(lambda on: 1.0)
    guard = PrefetchGuard(window=2, rounds=1, hold=4, clock=clock)
    assert run(guard, clock, 5)[4] is False


def test_probe_doubles_the_hold_and_a_changed_machine_is_followed():
    cost = {"on": 1.0, "off": 2.0}
    clock = StepClock(lambda on: cost["on"] if on else cost["off"])
    guard = PrefetchGuard(window=1, rounds=1, hold=2, max_hold=8, clock=clock)
    sides = run(guard, clock, 2 + 1)               # explore: on, off; then on
    assert sides == [True, False, True]
    # hold 2 windows on (the first is sides[2]), probe off, confirmed -> hold 4, probe, confirmed -> hold 8, probe
    more = []
    for _ in range(1 + 1 + 4 + 1 + 8 + 1):
        clock.side = sides[-1] if not more else more[-1]
        more.append(guard.begin(1))
    assert more == [True, False] + [True] * 4 + [False] + [True] * 8 + [False]
    # now guesses become expensive: the probe confirms on once more (its windows are from before), hold 8 (the
    # cap), then the next probe sees off faster: off is kept, with a probe of on after the base hold of 2 windows
    cost["on"] = 3.0
    tail = []
    for _ in range(8 + 1 + 2 + 1 + 1):
        clock.side = (more + tail)[-1]
        tail.append(guard.begin(1))
    assert tail == [True] * 8 + [False, False, False, True, False]
    regime = guard.regimes[1]
    assert regime.decided is False and regime.switches == 1 and regime.hold == 4


def test_regimes_are_decided_apart_and_untimed_steps_follow_the_last_decision():
    clock = StepClock(lambda on: 1.0 if on else 2.0)
    guard = PrefetchGuard(window=1, rounds=1, hold=4, clock=clock)
    assert run(guard, clock, 3, key=1) == [True, False, True]
    assert guard.begin(None) is True               # a prefill step: the last decision
    clock.side = None                              # (the prefill step is not timed)
    assert guard.begin(8) is True                  # a new batch size explores from its start
    stats = guard.stats()["regimes"]
    assert stats["1"]["prefetch"] is True and stats["8"]["prefetch"] is None


def test_an_idle_gap_is_not_a_sample():
    clock = StepClock(lambda on: 1.0)
    guard = PrefetchGuard(window=1, rounds=2, hold=4, clock=clock)
    run(guard, clock, 3)                           # windows: on 1.0, off 1.0
    clock.side = None
    clock.now += 1000.0                            # the engine waited for requests
    guard.begin(1)
    regime = guard.regimes[1]
    assert list(regime.windows[True]) == [1.0] and regime.samples == []


def test_bad_settings():
    with pytest.raises(ValueError):
        PrefetchGuard(window=0)
    with pytest.raises(ValueError):
        PrefetchGuard(hold=8, max_hold=4)
    with pytest.raises(ConfigError, match="prefetch_guard"):
        OffloadConfig(prefetch_guard="yes")


@needs_bundled_model
def test_engine_turns_costly_guesses_off_and_keeps_the_tokens():
    from moekv.entrypoints.llm import LLM
    from moekv.sampling import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0.0)
    common = dict(dtype="fp32", device="cpu", max_model_len=256, num_pages=64)
    prompt = ["ROMEO:\nBut soft, what light"]
    bundled = str(bundled_model())
    expected = LLM(bundled, **common).generate(prompt, params)[0].outputs[0].token_ids
    llm = LLM(bundled, cpu_offload_experts=True, expert_cache_size="50%", **common)
    routing = llm.engine.routing
    guard, predictor = routing.guard, routing.predictor
    assert guard is not None
    # a clock on which a step with guesses takes 3 s and one without 1 s; begin() reads it at each step's start,
    # while the predictor still has the finished step's setting
    clock = StepClock(lambda on: 3.0 if on else 1.0)
    guard.clock = clock
    original = guard.begin

    def begin(key):
        clock.side = (not predictor.paused) if key is not None and guard._open is not None else None
        return original(key)

    guard.begin = begin
    tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert tokens == expected                      # guesses move copies, never tokens
    regime = llm.engine.routing_stats()["prefetch_guard"]["regimes"]["1"]
    assert regime["prefetch"] is False and regime["windows_on"] == 2 and regime["windows_off"] >= 2
    assert regime["median_ms_on"] == pytest.approx(3e3) and regime["median_ms_off"] == pytest.approx(1e3)
    assert predictor.paused                        # the decode steps after the exploration run on demand,
    model = llm.engine.model                       # with no predictor hook left (fused paths as without one)
    assert not any(module._forward_hooks for module in model.modules())
    predictor.paused = False
    assert sum(len(module._forward_hooks) for module in model.modules()) == len(predictor._handles) > 0


@needs_bundled_model
def test_engine_without_the_guard():
    from moekv.entrypoints.llm import LLM

    llm = LLM(str(bundled_model()), dtype="fp32", device="cpu", max_model_len=256, num_pages=64,
              cpu_offload_experts=True, prefetch_guard=False)
    assert llm.engine.routing.guard is None
    assert llm.engine.routing_stats()["prefetch_guard"] is None


def test_paused_staged_policy_is_on_demand_bookkeeping_included(tiny_model):
    """With the predictor paused and no guess left, a staged offload's blocks skip the policy's decision points
    (no mark_decision / decide): the step is on-demand loading; guesses resume when the predictor does."""
    from moekv.config import OffloadConfig
    from moekv.moe.prefetch import install_routing
    from moekv.moe.prefetch.policy import Timeline
    from tests.hf_fixtures import moekv_greedy

    model = tiny_model(seed=3)
    runtime = install_routing(model, OffloadConfig(cpu_offload_experts=True, expert_cache_size=3,
                                                   prefetch_threshold=-1.0))
    staged = runtime.offload.staged
    staged.fixed = Timeline(copy_ms=1.0, default_window_ms=0.3)
    clock = StepClock(lambda on: 3.0 if on else 1.0)
    runtime.guard = PrefetchGuard(window=2, rounds=1, hold=64, clock=clock)
    original = runtime.guard.begin

    def begin(key):
        clock.side = (not runtime.predictor.paused) if key is not None and runtime.guard._open is not None else None
        return original(key)

    runtime.guard.begin = begin
    expected, _ = moekv_greedy(tiny_model(seed=3), [[1, 2, 3, 4, 5]], max_new_tokens=12)
    tokens, _ = moekv_greedy(model, [[1, 2, 3, 4, 5]], max_new_tokens=12)
    assert tokens == expected
    assert runtime.predictor.paused and not runtime.offload.guessing        # explored, kept off
    decisions = staged.stager.counters.decisions
    assert decisions > 0 and not staged.engaged()
    tokens, _ = moekv_greedy(model, [[1, 2, 3, 4, 5]], max_new_tokens=12)     # every step off: no decision point
    assert tokens == expected and staged.stager.counters.decisions == decisions
    runtime.predictor.paused = False                                           # back on (guessing follows): decisions again
    runtime.guard = None
    moekv_greedy(model, [[1, 2, 3, 4, 5]], max_new_tokens=4)
    assert staged.stager.counters.decisions > decisions

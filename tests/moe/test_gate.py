"""Guess gating from measurement (gate.py): budgets learned from measured copy windows and chunk costs, so a
run whose estimate is wrong stops overrunning, and one whose estimate is right still stages."""

from __future__ import annotations

import pytest
import torch

from moekv.config import OffloadConfig
from moekv.errors import ConfigError
from moekv.moe.prefetch import install_routing
from moekv.moe.prefetch.gate import GROW, SAFETY, GuessGate
from moekv.moe.prefetch.offload import SlotCopier
from moekv.moe.prefetch.policy import Timeline
from moekv.moe.prefetch.pool import HostExperts, SlotPool
from moekv.moe.prefetch.timeline import simulate_decode
from tests.hf_fixtures import moekv_greedy
from tests.moe.test_staged import synthetic_trace


class FakeMeter:
    """A copy stream and a decision clock in ms: each decision point comes `window_ms` after the last one,
    copies charged through `charge` keep the copy stream busy for bytes x ms_per_byte."""

    def __init__(self, window_ms: float, ms_per_byte: float):
        self.window_ms, self.ms_per_byte = window_ms, ms_per_byte
        self.now = self.busy = 0.0

    def charge(self, nbytes: float) -> None:
        self.busy = max(self.busy, self.now) + nbytes * self.ms_per_byte

    def now_mark(self) -> float:
        self.now += self.window_ms
        return self.now

    def copy_mark(self) -> float:
        return max(self.now, self.busy)

    def done(self, mark: float) -> bool:
        return mark <= self.now + 1e-9

    def elapsed_ms(self, a: float, b: float) -> float | None:
        return b - a if self.done(a) and self.done(b) else None


def test_gate_learns_window_and_cost_per_byte_and_halves_on_overruns():
    meter = FakeMeter(window_ms=2.0, ms_per_byte=0.01)
    gate = GuessGate(meter, prior_ms_per_byte=0.001)          # the estimate: copies 10x cheaper than they are
    assert gate.at_decision() is False
    gate.begin(0, gate.chunk_ms(10))
    assert gate.budget_ms(0) == 0.0 and gate.chunk_ms(10) == pytest.approx(0.01)   # no window yet; prior
    assert not gate.measured
    gate.at_decision()                                         # closes decision 0: a 2 ms window, no guesses
    gate.begin(0, gate.chunk_ms(100))                          # (learns from completed records first)
    assert gate.budget_ms(0) == pytest.approx(SAFETY * 2.0)
    meter.charge(300)                                          # 3 ms of guess chunks into a 2 ms window
    gate.issued(300)
    assert gate.at_decision() is True                          # still in flight: an overrun, scale halved
    assert gate.layers[0].scale == 0.5 and gate.layers[0].overruns == 1
    gate.begin(1, None)
    assert gate.ms_per_byte is None                            # its marks have not completed yet
    meter.now += 5.0
    gate.at_decision()
    gate.begin(1, None)
    assert gate.ms_per_byte == pytest.approx(0.01) and gate.measured       # measured: 3 ms / 300 bytes
    assert gate.chunk_ms(50) == pytest.approx(0.5)             # half the bytes (FP8 host experts), half the time
    assert gate.budget_ms(0) == pytest.approx(0.5 * SAFETY * 2.0)
    gate.at_decision()
    for _ in range(3):                                         # decisions with a chunk of idle time left: grow
        gate.begin(0, 0.5)
        gate.at_decision()
    gate.begin(2, None)
    assert gate.layers[0].scale == pytest.approx(0.5 + 3 * GROW)
    assert gate.as_dict()["layers"][0]["window_ms"] == pytest.approx(2.0)


def _slower_steps(result, on_demand) -> int:
    return sum(a > b + 1e-9 for a, b in zip(result["step_ms"], on_demand["step_ms"]))


def test_optimistic_estimate_overruns_and_the_measured_gate_does_not():
    """Guesses that are never right, copies 8x dearer than estimated, a window smaller than one chunk: the
    estimate gate overruns at most decisions and makes steps slower than on demand; the measured gate prices
    chunks by the misses' measured copies and stages nothing."""
    trace = synthetic_trace(num_tokens=96, right=False)
    times = dict(copy_ms=16.0, attn_ms=0.5, expert_ms=0.5)
    on_demand = simulate_decode(trace, 3, "on-demand", **times)
    estimate = simulate_decode(trace, 3, "staged", gate="estimate", threshold=0.5, estimated_copy_ms=2.0, **times)
    assert estimate["staged"]["overruns"] > estimate["staged"]["decisions"] // 2
    assert _slower_steps(estimate, on_demand) > 40
    measured = simulate_decode(trace, 3, "staged", threshold=0.5, estimated_copy_ms=2.0, **times)
    counters = measured["staged"]
    assert counters["overruns"] == counters["chunks"] == 0 and _slower_steps(measured, on_demand) == 0
    assert (measured["hits"], measured["misses"]) == (on_demand["hits"], on_demand["misses"])
    assert counters["learned"]["miss_ms_per_byte"] == pytest.approx(16.0)   # a simulated expert is one byte


def test_hidden_copy_cost_converges_to_staging_nothing():
    """Each guess copy call costs 1.5 ms more than its bytes (what neither the estimate nor the misses show):
    overruns stay bounded while the gate learns the guesses' own cost, then stop, and so does staging."""
    trace = synthetic_trace(num_tokens=96, right=False)
    kwargs = dict(copy_ms=2.0, attn_ms=0.5, expert_ms=0.5, threshold=0.5, copy_call_ms=1.5)
    on_demand = simulate_decode(trace, 3, "on-demand", copy_ms=2.0, attn_ms=0.5, expert_ms=0.5)
    estimate = simulate_decode(trace, 3, "staged", gate="estimate", **kwargs)
    assert estimate["staged"]["overruns"] > estimate["staged"]["decisions"] // 2
    half = simulate_decode(trace, 3, "staged", num_tokens=48, **kwargs)["staged"]
    full = simulate_decode(trace, 3, "staged", **kwargs)
    counters = full["staged"]
    assert 0 < half["overruns"] <= 3 * 3 and counters["overruns"] == half["overruns"]   # none after adaptation
    assert counters["chunks"] == half["chunks"]                                         # stopped staging
    assert (full["hits"], full["misses"]) == (on_demand["hits"], on_demand["misses"])
    assert _slower_steps(full, on_demand) <= half["overruns"] < _slower_steps(estimate, on_demand)
    assert all(layer["budget_ms"] < layer["window_ms"] for layer in counters["learned"]["layers"].values())


@pytest.mark.parametrize("estimated_copy_ms", [None, 0.5, 8.0])
def test_measured_gate_stages_right_guesses_whatever_the_estimate(estimated_copy_ms):
    """Right guesses, copy 2 ms, window 1 ms: the measured gate stages them with no overrun whether the estimate
    is exact, 4x optimistic or 4x pessimistic (the pessimistic prior only prices the first probe)."""
    trace = synthetic_trace(right=True)
    kwargs = dict(copy_ms=2.0, attn_ms=0.5, expert_ms=0.5)
    on_demand = simulate_decode(trace, 3, "on-demand", **kwargs)
    staged = simulate_decode(trace, 3, "staged", threshold=0.5, estimated_copy_ms=estimated_copy_ms, **kwargs)
    counters = staged["staged"]
    assert counters["overruns"] == 0 and counters["used"] >= counters["promoted"] // 2 > 0
    assert counters["wasted"] == 0
    assert all(a <= b + 1e-9 for a, b in zip(staged["step_ms"], on_demand["step_ms"]))
    assert staged["ms_per_token"] < on_demand["ms_per_token"] - 0.4
    assert counters["learned"]["ms_per_byte"] == pytest.approx(2.0)     # a simulated expert is one byte


class ChargedCopier:
    """The offload's copier, with the staged policy's guess copies charged to a FakeMeter's copy stream."""

    def __init__(self, inner: SlotCopier, meter: FakeMeter):
        self.inner, self.meter = inner, meter

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def copy(self, *args, **kwargs) -> int:
        nbytes = self.inner.copy(*args, **kwargs)
        self.meter.charge(nbytes)
        return nbytes


@pytest.mark.parametrize("chunk_ms,expect_staging", [(0.125, True), (0.5, False)])
def test_real_staged_copies_with_a_fake_clock(tiny_model, chunk_ms, expect_staging):
    """The offloaded model on the CPU with an injected clock: the estimate (chunk 0.125 ms, window 0.3 ms) is
    right, or 4x too optimistic about the copies (no chunk fits the window). Tokens and hits / misses equal
    loading on demand either way; right: guesses staged, no overrun; wrong: overruns stop after probing."""
    prompt = [[1, 2, 3, 4, 5]]
    expert_bytes = 3 * 32 * 48 * 4                                   # tiny_arch, fp32

    def run(**config):
        model = tiny_model(seed=3)
        runtime = install_routing(model, OffloadConfig(cpu_offload_experts=True, expert_cache_size=3, **config))
        staged, history = runtime.offload.staged, []
        if staged is not None:
            meter = FakeMeter(window_ms=0.3, ms_per_byte=chunk_ms * 8 / expert_bytes)
            staged.fixed, staged.meter = Timeline(copy_ms=1.0, default_window_ms=0.3), meter
            staged.copier = ChargedCopier(staged.copier, meter)
            mark = staged.mark_decision
            staged.mark_decision = lambda layer: (mark(layer), history.append(staged.stager.counters.overruns))
        tokens, _ = moekv_greedy(model, prompt, max_new_tokens=24)
        return tokens, runtime.stats()["offload"], history

    on_demand_tokens, on_demand, _ = run(prefetch=False)
    tokens, stats, history = run(prefetch_threshold=-1.0, lookahead=2, extra_candidates=1,
                                 prefetch_guard=False)          # every step guesses: 24 x 3 decisions
    assert tokens == on_demand_tokens
    assert (stats["hits"], stats["misses"]) == (on_demand["hits"], on_demand["misses"])
    staged = stats["staged"]
    assert staged["measuring"] and staged["decisions"] == len(history) == 24 * 3
    if expect_staging:
        assert staged["overruns"] == 0 and staged["used"] > 0 and staged["chunks"] > 20
    else:
        assert 0 < staged["overruns"] <= 3 and history[len(history) // 3] == history[-1]
        assert staged["chunks"] == staged["overruns"]                  # only the probes were copied
        assert staged["learned"]["ms_per_byte"] == pytest.approx(chunk_ms * 8 / expert_bytes)


def test_consecutive_chunks_copy_as_one_range_with_the_same_bytes():
    generator = torch.Generator().manual_seed(0)
    host = HostExperts.from_weights(torch.randn(4, 12, 6, generator=generator),
                                    torch.randn(4, 6, 6, generator=generator), "fp8")
    copier = SlotCopier(torch.device("cpu"), chunks=8)
    whole, pieces = SlotPool(host, 2, "cpu"), SlotPool(host, 2, "cpu")
    assert copier.copy(host, 2, whole, 0) == host.expert_bytes
    moved = copier.copy(host, 2, pieces, 0, range(0, 3)) + copier.copy(host, 2, pieces, 0, range(3, 8), new=False)
    assert moved == host.expert_bytes and copier.copies == 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole.planes, pieces.planes))
    assert copier.copy(host, 1, pieces, 1, [1, 2]) == copier.copy(host, 1, whole, 1, range(1, 3))


def test_prefetch_gate_config():
    assert OffloadConfig().prefetch_gate == "measured"
    with pytest.raises(ConfigError, match="prefetch_gate"):
        OffloadConfig(cpu_offload_experts=True, prefetch_gate="guess")

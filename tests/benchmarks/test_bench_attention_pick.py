"""benchmarks/bench_attention.py's choice of launch config from a --lowbit-only sweep."""

from __future__ import annotations

from benchmarks import bench_attention


def _row(batch, cfg, ms, err=1e-3, impl="tm", bits=3):
    return {"batch": batch, "context": 16384, "bits": bits, "impl": impl, "config": cfg, "ms": ms, "tbps": 1.0,
            "max_rel_err": err, "first_call_s": 1.0}


def test_geometric_mean_over_shapes_not_the_smallest_time():
    """Session 15's sweep: "scatter" fastest at B=1 (0.059 vs 0.063 ms), "passes" at B=32 (0.60 vs 0.85); the
    raw minimum picked "scatter" for the B=1 time alone, the geometric mean of relative times picks "passes"."""
    scatter, passes = {"outliers": "scatter"}, {"outliers": "passes"}
    rows = [_row(32, scatter, 0.848), _row(32, passes, 0.602), _row(1, scatter, 0.0594), _row(1, passes, 0.0633)]
    assert bench_attention.pick_configs(rows) == {"tm": passes}


def test_over_tolerance_anywhere_or_missing_case_drops_the_config():
    fast_but_wrong, partial, fine = {"a": 1}, {"a": 2}, {"a": 3}
    rows = [_row(32, fast_but_wrong, 0.1), _row(1, fast_but_wrong, 0.01, err=0.5),
            _row(32, partial, 0.05),
            _row(32, fine, 0.5), _row(1, fine, 0.05),
            _row(32, {}, 0.9, impl="tc"), _row(1, {}, 0.09, impl="tc")]
    assert bench_attention.pick_configs(rows) == {"tm": fine, "tc": {}}
    assert bench_attention.pick_configs([_row(1, fine, 0.05, err=float("nan"))]) == {}

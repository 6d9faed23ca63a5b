"""moekv.eval.pareto: the front of (bits, error) points and its optional plot."""

import pytest

from moekv.eval.pareto import pareto_front, plot_pareto


def test_front_keeps_only_undominated_points():
    points = [(3.3, 0.004), (3.5, 0.006), (2.3, 0.018), (4.3, 0.0006), (4.5, 0.0009), (3.3, 0.005), (2.3, 0.018)]
    # (3.5, 0.006) is beaten by (3.3, 0.004); (4.5, ...) by (4.3, ...); (3.3, 0.005) by (3.3, 0.004);
    # the two equal (2.3, 0.018) points do not dominate each other
    assert pareto_front(points) == [True, False, True, True, False, False, True]
    assert pareto_front([]) == []


def test_plot_is_written_or_skipped(tmp_path):
    series = {"moekv": [("int3", 3.3, 0.004), ("int2", 2.3, 0.018)], "quanto": [("int2", 2.5, 0.014)]}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plot_pareto(series, tmp_path / "p.png", "bits", "KL", "t") is None
        pytest.skip("matplotlib is not installed: the plot is skipped (checked)")
    path = plot_pareto(series, tmp_path / "p.png", "bits", "KL", "t")
    assert path.is_file() and path.stat().st_size > 1000

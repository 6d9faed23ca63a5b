"""Quality against bits per value: which configurations are on the Pareto front, and a plot of it.

Used by `moekv eval kv` and benchmarks/bench_hf_cache.py (hf_cache_report.py). A point is (bits, error) with
lower being better on both; it is on the front when no other point has fewer-or-equal bits and a lower-or-equal
error with at least one strictly lower. The plot needs matplotlib (optional: `plot_pareto` returns None when it
is missing).
"""

from __future__ import annotations

from pathlib import Path


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """For each (bits, error) point: True when no other point dominates it."""
    flags = []
    for i, (bits, error) in enumerate(points):
        dominated = any(b <= bits and e <= error and (b < bits or e < error)
                        for j, (b, e) in enumerate(points) if j != i)
        flags.append(not dominated)
    return flags


def plot_pareto(series: dict[str, list[tuple[str, float, float]]], path: str | Path, xlabel: str, ylabel: str,
                title: str, log_y: bool = True) -> Path | None:
    """Scatter each family's (label, bits, error) points, the front as a line; writes a PNG.
    Returns the path, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everything = [(bits, error) for points in series.values() for _, bits, error in points]
    front = sorted(p for p, on in zip(everything, pareto_front(everything)) if on)
    fig, ax = plt.subplots(figsize=(8, 5))
    for family, points in series.items():
        ax.scatter([b for _, b, _ in points], [e for _, _, e in points], label=family, s=28)
        for label, bits, error in points:
            ax.annotate(label, (bits, error), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if front:
        ax.step([b for b, _ in front], [e for _, e in front], where="post", color="gray", lw=0.8,
                label="Pareto front")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path

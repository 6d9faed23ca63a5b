"""`moekv bench serve`'s numbers: percentiles, goodput, the report (with `vllm bench serve`'s field names
where they exist: mean_/median_/std_/pNN_ttft_ms, request_goodput, ...), the table, and the plots.
"""

from __future__ import annotations

import math
import os
import platform
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from moekv.provenance import git_commit

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}


def percentiles(values: list[float], extra: tuple[float, ...] = ()) -> dict[str, float | None]:
    """mean, std, p50, p90, p99 and any `extra` percentiles (linear interpolation); None when empty."""
    keys = ["p50", "p90", "p99", *(f"p{_pct(q)}" for q in extra)]
    if not values:
        return {"mean": None, "std": None, **{k: None for k in keys}, "count": 0}
    ordered = sorted(values)

    def quantile(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    mean = sum(ordered) / len(ordered)
    out = {"mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in ordered) / len(ordered))}
    for q in (50, 90, 99, *extra):
        out[f"p{_pct(q)}"] = quantile(q / 100.0)
    out["count"] = len(ordered)
    return out


def _pct(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50", "e2el:2000"] (milliseconds) -> {"ttft": 500.0, ...}."""
    out: dict[str, float] = {}
    for spec in specs or []:
        key, _, value = spec.partition(":")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {spec!r}: the metric must be one of ttft, tpot, e2el")
        try:
            out[GOODPUT_KEYS[key]] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: the limit must be a number of milliseconds") from None
        if out[GOODPUT_KEYS[key]] <= 0:
            raise ValueError(f"--goodput {spec!r}: the limit must be positive")
    return out


def meets_slo(result, slos: dict[str, float]) -> bool:
    """Whether a completed request's TTFT / TPOT / E2E (ms) are all within their limits."""
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2e}
    for key, limit in slos.items():
        value = values[key]
        if key == "tpot" and value is None and result.output_tokens == 1:
            continue   # one token: no time per output token to miss
        if value is None or value * 1000.0 > limit:
            return False
    return True


def vllm_fields(results, duration: float, slos: dict[str, float], extra_percentiles: tuple[float, ...]) -> dict:
    """The flat fields `vllm bench serve --save-result` writes, computed from the completed requests."""
    ok = [r for r in results if r.status == "ok"]
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2e for r in ok if r.e2e is not None]}
    out = {
        "duration": duration, "completed": len(ok), "failed": sum(r.status == "failed" for r in results),
        "total_input_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration if duration else None,
        "request_goodput": (sum(meets_slo(r, slos) for r in ok) / duration if duration else None) if slos else None,
        "output_throughput": sum(r.output_tokens for r in ok) / duration if duration else None,
        "input_lens": [r.prompt_tokens for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "errors": [r.error or "" for r in results],
    }
    out["total_token_throughput"] = ((out["total_input_tokens"] + out["total_output_tokens"]) / duration
                                     if duration else None)
    out["max_output_tokens_per_s"] = max(throughput_over_time(results, 1.0)[1], default=0.0)
    for key, values in series.items():
        stats = percentiles(values, extra_percentiles)
        ms = (lambda v: None if v is None else v * 1000.0)
        out[f"mean_{key}_ms"], out[f"median_{key}_ms"], out[f"std_{key}_ms"] = (
            ms(stats["mean"]), ms(stats["p50"]), ms(stats["std"]))
        for q in (50, 90, 99, *extra_percentiles):
            out[f"p{_pct(q)}_{key}_ms"] = ms(stats[f"p{_pct(q)}"])
    return out


def token_times(result) -> list[float]:
    """Seconds from the benchmark start at which each of a request's streamed chunks arrived."""
    if result.ttft is None:
        return []
    times, now = [], result.sent_at + result.ttft
    times.append(now)
    for gap in result.itl:
        now += gap
        times.append(now)
    return times


def throughput_over_time(results, bin_s: float) -> tuple[list[float], list[float]]:
    """(bin start times, output chunks per second in each bin) over the run."""
    stamps = [t for r in results for t in token_times(r)]
    if not stamps:
        return [], []
    bins = [0] * (int(max(stamps) // bin_s) + 1)
    for t in stamps:
        bins[int(t // bin_s)] += 1
    return [i * bin_s for i in range(len(bins))], [count / bin_s for count in bins]


def write_plots(results, stem: Path) -> list[Path]:
    """PNG plots next to `stem`: latency CDFs (TTFT, TPOT, ITL, E2E) and output throughput over time.
    Returns the files written (none when matplotlib is not installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return []
    ok = [r for r in results if r.status == "ok"]
    series = {"TTFT": [r.ttft for r in ok if r.ttft is not None], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [g for r in ok for g in r.itl], "E2E": [r.e2e for r in ok if r.e2e is not None]}
    written = []
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (label, values) in zip(axes, series.items()):
        ordered = sorted(v * 1000.0 for v in values)
        if ordered:
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
        ax.set_title(f"{label} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of samples")
    fig.tight_layout()
    path = stem.with_name(stem.name + "-latency-cdf.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    duration = max((t for r in results for t in token_times(r)), default=1.0)
    starts, rates = throughput_over_time(results, max(duration / 50.0, 0.05))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.step(starts, rates, where="post")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output chunks / s")
    ax.set_title("output throughput over time")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = stem.with_name(stem.name + "-throughput.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def build_report(config, model: str, results: list[RequestResult], duration: float,
                 after: dict[str, float]) -> dict:
    """The report of a run: the client's numbers, vLLM's fields, the server's state once idle."""
    ok = [r for r in results if r.status == "ok"]
    cancelled = [r for r in results if r.status == "cancelled"]
    failed = [r for r in results if r.status == "failed"]
    served = ok + cancelled
    output_tokens = sum(r.output_tokens for r in served)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    slos = parse_goodput(list(config.goodput))
    extra = tuple(config.metric_percentiles)
    ms = 1000.0
    return {
        "benchmark": "moekv bench serve",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["moekv"] + sys.argv[1:]) if sys.argv and "moekv" in sys.argv[0] else None,
        "host": {"machine": platform.machine(), "processor": platform.processor() or None,
                 "cpu_count": os.cpu_count(), "load_average_1m_after": _load_average(),
                 "python": platform.python_version(), "commit": git_commit()},
        "config": {**asdict(config), "api_key": "***" if config.api_key else None,   # never write the key
                   "request_rate": str(config.request_rate) if math.isinf(config.request_rate) else config.request_rate},
        "backend": "openai", "model_id": model, "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness, "max_concurrency": config.concurrency,
        "model": model,
        "requests": {"total": len(results), "completed": len(ok), "cancelled": len(cancelled), "failed": len(failed)},
        "error_samples": [f"#{r.index}: {r.error}" for r in failed[:10]],
        "duration_s": duration,
        "goodput_slos_ms": slos or None,
        **vllm_fields(results, duration, slos, extra),
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_ms": _scaled(percentiles([r.ttft for r in served if r.ttft is not None], extra), ms),
        "tpot_ms": _scaled(percentiles([r.tpot for r in ok if r.tpot is not None], extra), ms),
        "itl_ms": _scaled(percentiles([gap for r in served for gap in r.itl], extra), ms),
        "e2e_ms": _scaled(percentiles([r.e2e for r in ok if r.e2e is not None], extra), ms),
        "server_after_run": {
            "kv_cache_usage_perc": metric(after, "kv_cache_usage_perc"),
            "num_requests_running": metric(after, "num_requests_running"),
            "num_requests_waiting": metric(after, "num_requests_waiting"),
            "num_preemptions_total": metric(after, "num_preemptions_total"),
            "request_aborts_total": sum(v for k, v in after.items() if k.split(":", 1)[-1].startswith(
                "request_success_total{") and '"abort"' in k),
        },
    }


def _scaled(stats: dict, factor: float) -> dict:
    return {k: (v * factor if v is not None and k != "count" else v) for k, v in stats.items()}


def _load_average() -> float | None:
    """The 1-minute load average (other work on the machine skews every number here)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def metric(values: dict[str, float], name: str) -> float | None:
    """A series under either prefix (`moekv serve --metrics-prefix vllm` renames vLLM's series)."""
    for prefix in ("moekv", "vllm"):
        if f"{prefix}:{name}" in values:
            return values[f"{prefix}:{name}"]
    return None


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    requests = report["requests"]
    summary = Table(title=f"moekv bench serve: {report['model']}", show_header=False)
    summary.add_column(justify="left")
    summary.add_column(justify="right")
    config = report["config"]
    rows = [
        ("dataset / prompts", f"{config['dataset_name']} / {config['num_prompts']}"),
        ("request rate / burstiness / max concurrency",
         f"{config['request_rate']} / {config['burstiness']} / {config['concurrency'] or 'unbounded'}"),
        ("completed / cancelled / failed", f"{requests['completed']} / {requests['cancelled']} / "
                                           f"{requests['failed']}"),
        ("duration (s)", f"{report['duration_s']:.2f}"),
        ("input / output tokens", f"{report['total_input_tokens']} / {report['total_output_tokens']}"),
        ("request throughput (req/s)", _fmt(report["request_throughput"])),
        ("output token throughput (tok/s)", _fmt(report["output_throughput"])),
        ("total token throughput (tok/s)", _fmt(report["total_token_throughput"])),
        ("kv_cache_usage_perc once idle", _fmt(report["server_after_run"]["kv_cache_usage_perc"], 4)),
    ]
    if report.get("request_goodput") is not None:
        rows.insert(6, ("request goodput (req/s)", _fmt(report["request_goodput"])))
    for label, value in rows:
        summary.add_row(label, value)
    console.print(summary)
    latency = Table(title="latency (ms)")
    quantiles = [k for k in report["ttft_ms"] if k.startswith("p")]
    for column in ("metric", "mean", "std", *quantiles, "samples"):
        latency.add_column(column, justify="right" if column != "metric" else "left")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        stats = report[key]
        latency.add_row(label, *(_fmt(stats[q]) for q in ("mean", "std", *quantiles)), str(stats["count"]))
    console.print(latency)
    for error in report["error_samples"]:
        console.print(f"[red]failed[/red] {error}")


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"

"""`moekv bench serve`: load-test a running server with concurrent streaming completions.

Each request streams `POST /v1/completions`; the client records time to first token (TTFT), the gaps
between tokens (ITL), time per output token after the first (TPOT) and end-to-end latency. A chosen
fraction of requests is cancelled mid-stream (the client closes the connection after a few tokens);
those count as cancelled, never as failed. After the run the tool waits for the server to go idle
and reads `moekv:kv_cache_usage_perc` from /metrics: anything but 0 is a leaked page.

Prints a table; `--json OUT` writes the numbers. It asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from moekv.provenance import git_commit

FALLBACK_PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "MACBETH:\nIs this a dagger which I see before me,",
]


@dataclass(frozen=True)
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    concurrency: int = 8
    num_prompts: int = 32
    max_tokens: int = 64
    cancel_fraction: float = 0.0
    model: str | None = None            # None: the first model /v1/models lists
    seed: int = 0
    api_key: str | None = None
    temperature: float = 0.8
    ignore_eos: bool = True             # every finished request generates exactly max_tokens
    request_timeout_s: float = 600.0
    idle_timeout_s: float = 60.0
    progress: bool = True
    prompts: tuple[str, ...] | None = None   # use these (cycled) instead of the validation slice

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.num_prompts < 1 or self.max_tokens < 1:
            raise ValueError("--concurrency, --num-prompts and --max-tokens must be positive")
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise ValueError(f"--cancel-fraction must be in [0, 1], got {self.cancel_fraction}")


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds from its send."""

    index: int
    status: str = "failed"              # "ok" | "cancelled" | "failed"
    cancel_after: int | None = None     # chunks to read before closing the stream (cancelled requests)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def load_prompts(count: int, seed: int) -> list[str]:
    """Prompts of 1-3 consecutive lines of the validation slice (a few fixed lines if it is missing)."""
    try:
        from moekv.datasets import validation_slice

        lines = [line for line in validation_slice().splitlines() if line.strip()]
    except (ImportError, FileNotFoundError):
        lines = []
    rng = random.Random(seed)
    if len(lines) < 4:
        return [FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)] for i in range(count)]
    prompts = []
    for _ in range(count):
        start = rng.randrange(len(lines) - 3)
        prompts.append("\n".join(lines[start:start + rng.randint(1, 3)]) + "\n")
    return prompts


def percentiles(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation between order statistics); None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}
    ordered = sorted(values)

    def quantile(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"mean": sum(ordered) / len(ordered), "p50": quantile(0.5), "p90": quantile(0.9),
            "p99": quantile(0.99), "count": len(ordered)}


async def _one_request(http, config: BenchConfig, model: str, prompt: str, result: RequestResult,
                       headers: dict) -> None:
    payload = {"model": model, "prompt": prompt, "max_tokens": config.max_tokens, "stream": True,
               "temperature": config.temperature, "seed": config.seed + result.index,
               "ignore_eos": config.ignore_eos, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with http.stream("POST", f"{config.url}/v1/completions", json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {event['error'].get('message')}"
                    return
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                if not event.get("choices"):
                    continue
                now = time.perf_counter() - start
                if result.ttft is None:
                    result.ttft = now
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
                if result.cancel_after is not None and chunks >= result.cancel_after:
                    result.status, result.output_tokens, result.e2e = "cancelled", chunks, now
                    return     # leaving the block closes the connection: the server aborts the request
            if not done:
                result.error = "the stream ended without [DONE]"
                return
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.status = "ok"
    except Exception as exc:   # connection refused, timeout, malformed chunk: a failed request
        result.error = f"{type(exc).__name__}: {exc}"


async def _server_model(http, config: BenchConfig, headers: dict) -> str:
    if config.model:
        return config.model
    response = await http.get(f"{config.url}/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def read_idle_metrics(http, url: str, timeout_s: float) -> dict[str, float]:
    """Poll /metrics until no request runs or waits (or the timeout); returns the last reading."""
    from moekv.metrics import parse_metrics

    deadline = time.monotonic() + timeout_s
    while True:
        values = parse_metrics((await http.get(f"{url}/metrics")).text)
        idle = values.get("moekv:num_requests_running") == 0 and values.get("moekv:num_requests_waiting") == 0
        if (idle and values.get("moekv:kv_cache_usage_perc") == 0) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.1)


async def run_benchmark(config: BenchConfig) -> dict:
    """Run the load test; returns the report (what --json writes)."""
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    rng = random.Random(config.seed)
    if config.prompts:
        prompts = [config.prompts[i % len(config.prompts)] for i in range(config.num_prompts)]
    else:
        prompts = load_prompts(config.num_prompts, config.seed)
    results = [RequestResult(i) for i in range(config.num_prompts)]
    for i in rng.sample(range(config.num_prompts), round(config.cancel_fraction * config.num_prompts)):
        results[i].cancel_after = rng.randint(1, max(1, config.max_tokens // 2))
    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        model = await _server_model(http, config, headers)
        gate = asyncio.Semaphore(config.concurrency)
        bar = _progress(config)

        async def limited(result: RequestResult) -> None:
            async with gate:
                await _one_request(http, config, model, prompts[result.index], result, headers)
            bar.update(1)

        started = time.perf_counter()
        await asyncio.gather(*(limited(r) for r in results))
        duration = time.perf_counter() - started
        bar.close()
        after = await read_idle_metrics(http, config.url, config.idle_timeout_s)
    return _report(config, model, results, duration, after)


def _progress(config: BenchConfig):
    from tqdm import tqdm

    return tqdm(total=config.num_prompts, desc="requests", unit="req", disable=not config.progress,
                file=sys.stderr, dynamic_ncols=True)


def _report(config: BenchConfig, model: str, results: list[RequestResult], duration: float,
            after: dict[str, float]) -> dict:
    ok = [r for r in results if r.status == "ok"]
    cancelled = [r for r in results if r.status == "cancelled"]
    failed = [r for r in results if r.status == "failed"]
    served = ok + cancelled
    output_tokens = sum(r.output_tokens for r in served)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    ms = 1000.0
    return {
        "benchmark": "moekv bench serve",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["moekv"] + sys.argv[1:]) if sys.argv and "moekv" in sys.argv[0] else None,
        "host": {"machine": platform.machine(), "processor": platform.processor() or None,
                 "cpu_count": os.cpu_count(), "load_average_1m_after": _load_average(),
                 "python": platform.python_version(), "commit": git_commit()},
        "config": {**asdict(config), "api_key": "***" if config.api_key else None},   # never write the key
        "model": model,
        "requests": {"total": len(results), "completed": len(ok), "cancelled": len(cancelled), "failed": len(failed)},
        "errors": [f"#{r.index}: {r.error}" for r in failed[:10]],
        "duration_s": duration,
        "request_throughput_per_s": len(ok) / duration if duration else None,
        "output_token_throughput_per_s": output_tokens / duration if duration else None,
        "total_token_throughput_per_s": (output_tokens + prompt_tokens) / duration if duration else None,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_ms": _scaled(percentiles([r.ttft for r in served if r.ttft is not None]), ms),
        "tpot_ms": _scaled(percentiles([r.tpot for r in ok if r.tpot is not None]), ms),
        "itl_ms": _scaled(percentiles([gap for r in served for gap in r.itl]), ms),
        "e2e_ms": _scaled(percentiles([r.e2e for r in ok if r.e2e is not None]), ms),
        "server_after_run": {
            "kv_cache_usage_perc": after.get("moekv:kv_cache_usage_perc"),
            "num_requests_running": after.get("moekv:num_requests_running"),
            "num_requests_waiting": after.get("moekv:num_requests_waiting"),
            "num_preemptions_total": after.get("moekv:num_preemptions_total"),
            "request_aborts_total": sum(v for k, v in after.items()
                                        if k.startswith("moekv:request_success_total{") and '"abort"' in k),
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


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    requests = report["requests"]
    summary = Table(title=f"moekv bench serve: {report['model']}", show_header=False)
    summary.add_column(justify="left")
    summary.add_column(justify="right")
    config = report["config"]
    for label, value in [
        ("concurrency / prompts / max tokens", f"{config['concurrency']} / {config['num_prompts']} / "
                                               f"{config['max_tokens']}"),
        ("completed / cancelled / failed", f"{requests['completed']} / {requests['cancelled']} / "
                                           f"{requests['failed']}"),
        ("duration (s)", f"{report['duration_s']:.2f}"),
        ("request throughput (req/s)", _fmt(report["request_throughput_per_s"])),
        ("output token throughput (tok/s)", _fmt(report["output_token_throughput_per_s"])),
        ("total token throughput (tok/s)", _fmt(report["total_token_throughput_per_s"])),
        ("kv_cache_usage_perc once idle", _fmt(report["server_after_run"]["kv_cache_usage_perc"], 4)),
    ]:
        summary.add_row(label, value)
    console.print(summary)
    latency = Table(title="latency (ms)")
    for column in ("metric", "mean", "p50", "p90", "p99", "samples"):
        latency.add_column(column, justify="right" if column != "metric" else "left")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        stats = report[key]
        latency.add_row(label, *(_fmt(stats[q]) for q in ("mean", "p50", "p90", "p99")), str(stats["count"]))
    console.print(latency)
    for error in report["errors"]:
        console.print(f"[red]failed[/red] {error}")


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests in all (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--cancel-fraction", type=float, default=0.0,
                        help="share of requests closed mid-stream (default 0)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--seed", type=int, default=0, help="prompt choice, cancellations and sampling seeds")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: "
                        "every request generates --max-tokens tokens)")
    parser.add_argument("--api-key", default=None, help="bearer key, if the server wants one")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        config = BenchConfig(url=args.url.rstrip("/"), concurrency=args.concurrency, num_prompts=args.num_prompts,
                             max_tokens=args.max_tokens, cancel_fraction=args.cancel_fraction, model=args.model,
                             seed=args.seed, api_key=args.api_key, temperature=args.temperature,
                             ignore_eos=not args.no_ignore_eos, progress=not args.no_progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run_benchmark(config))
    except Exception as exc:   # e.g. the server is not reachable
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if report["requests"]["failed"] == 0 else 1

"""`moekv bench serve`: load-test a running server, shaped like `vllm bench serve`.

Requests (a dataset: bench/workload.py) are sent at `--request-rate` (Poisson arrivals, or all at once
for inf) with at most `--max-concurrency` in flight; each streams `POST /v1/completions` and the
client records time to first token (TTFT), the gaps between tokens (ITL), time per output token after
the first (TPOT) and end-to-end latency (E2E). `--goodput ttft:MS tpot:MS e2el:MS` counts the requests
within every limit. A chosen fraction of requests is cancelled mid-stream (the client closes the
connection after a few tokens); those count as cancelled, never as failed. After the run the tool
waits for the server to go idle and reads `kv_cache_usage_perc` from /metrics: anything but 0 is a
leaked page.

Prints a table; `--save-result` (or `--json OUT`) writes the report with vLLM's field names where they
exist, plus PNG plots (latency CDFs, throughput over time) when matplotlib is installed. It asserts
nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from moekv.bench.report import build_report, metric, parse_goodput, percentiles, print_report, write_plots
from moekv.bench.workload import (DATASETS, SampleRequest, arrival_offsets, random_requests, sharegpt_conversations,
                                  sharegpt_requests, validation_requests)

__all__ = ["BenchConfig", "RequestResult", "percentiles", "print_report", "run_benchmark"]

@dataclass(frozen=True)
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    concurrency: int | None = None      # --max-concurrency: requests in flight at once (None: unbounded)
    num_prompts: int = 32
    max_tokens: int = 64                # output tokens of the validation dataset's requests
    request_rate: float = math.inf      # requests per second (inf: all at once)
    burstiness: float = 1.0             # gamma shape of the arrival gaps (1: Poisson)
    dataset_name: str = "validation"    # validation | random | sharegpt
    dataset_path: str | None = None     # sharegpt: the JSON file
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    sharegpt_output_len: int | None = None
    goodput: tuple[str, ...] = ()       # "ttft:500", "tpot:50", "e2el:2000" (ms)
    metric_percentiles: tuple[float, ...] = ()   # percentiles reported beside 50, 90, 99
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
        if (self.concurrency is not None and self.concurrency < 1) or self.num_prompts < 1 or self.max_tokens < 1:
            raise ValueError("--max-concurrency, --num-prompts and --max-tokens must be positive")
        if self.dataset_name not in DATASETS:
            raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {self.dataset_name!r}")
        if self.dataset_name == "sharegpt" and not self.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (ShareGPT-format JSON)")
        if any(not 0 < q < 100 for q in self.metric_percentiles):
            raise ValueError("--metric-percentiles must be in (0, 100)")
        parse_goodput(list(self.goodput))
        arrival_offsets(0, self.request_rate, self.burstiness, 0)   # checks rate and burstiness
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise ValueError(f"--cancel-fraction must be in [0, 1], got {self.cancel_fraction}")


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds from its send."""

    index: int
    sample: SampleRequest | None = None
    sent_at: float = 0.0                # seconds from the benchmark start
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


async def _one_request(http, config: BenchConfig, model: str, prompt: str | list[int], result: RequestResult,
                       headers: dict) -> None:
    payload = {"model": model, "prompt": prompt, "max_tokens": result.sample.output_len, "stream": True,
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
        idle = metric(values, "num_requests_running") == 0 and metric(values, "num_requests_waiting") == 0
        if (idle and metric(values, "kv_cache_usage_perc") == 0) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.1)


async def _tokenizer_count(http, config: BenchConfig, model: str, headers: dict):
    """A token counter through the server's /tokenize (characters / 4 when the server has none)."""
    cache: dict[str, int] = {}

    async def count(text: str) -> int:
        if text not in cache:
            response = await http.post(f"{config.url}/tokenize", json={"model": model, "prompt": text,
                                                                       "add_special_tokens": False}, headers=headers)
            cache[text] = response.json()["count"] if response.status_code == 200 else max(1, len(text) // 4)
        return cache[text]

    return count


async def _vocab_size(http, config: BenchConfig, headers: dict) -> int:
    """The server's vocabulary size, found by /detokenize bisection (random token-id prompts stay in it)."""
    low, high = 1, 1 << 20
    while low + 1 < high:
        mid = (low + high) // 2
        response = await http.post(f"{config.url}/detokenize", json={"tokens": [mid]}, headers=headers)
        if response.status_code == 404:
            return 256   # no /detokenize: a safe byte-sized vocabulary
        low, high = (mid, high) if response.status_code == 200 else (low, mid)
    return high


async def build_requests(http, config: BenchConfig, model: str, headers: dict) -> list[SampleRequest]:
    if config.dataset_name == "random":
        vocab = await _vocab_size(http, config, headers)
        return random_requests(config.num_prompts, config.random_input_len, config.random_output_len,
                               config.random_range_ratio, vocab, config.seed)
    if config.dataset_name == "sharegpt":
        pairs = sharegpt_conversations(config.dataset_path)
        lengths = {}
        if config.sharegpt_output_len is None:
            count = await _tokenizer_count(http, config, model, headers)
            for _, completion in pairs:
                lengths[completion] = await count(completion)
        return sharegpt_requests(pairs, config.num_prompts, config.seed, config.sharegpt_output_len,
                                 lambda text: lengths[text])
    if config.prompts:
        return [SampleRequest(config.prompts[i % len(config.prompts)], None, config.max_tokens)
                for i in range(config.num_prompts)]
    return validation_requests(config.num_prompts, config.max_tokens, config.seed)


async def run_benchmark(config: BenchConfig, keep_results: list | None = None) -> dict:
    """Run the load test; returns the report (what --save-result writes). `keep_results` (a list) gets
    the per-request results (for the plots)."""
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    rng = random.Random(config.seed)
    results = [RequestResult(i) for i in range(config.num_prompts)]
    offsets = arrival_offsets(config.num_prompts, config.request_rate, config.burstiness, config.seed + 1)
    in_flight = config.concurrency or config.num_prompts
    limits = httpx.Limits(max_connections=in_flight + 4, max_keepalive_connections=in_flight)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        model = await _server_model(http, config, headers)
        samples = await build_requests(http, config, model, headers)
        for result, sample in zip(results, samples):
            result.sample = sample
        for i in rng.sample(range(config.num_prompts), round(config.cancel_fraction * config.num_prompts)):
            results[i].cancel_after = rng.randint(1, max(1, results[i].sample.output_len // 2))
        gate = asyncio.Semaphore(in_flight)
        bar = _progress(config)
        started = time.perf_counter()

        async def limited(result: RequestResult) -> None:
            await asyncio.sleep(max(0.0, offsets[result.index] - (time.perf_counter() - started)))
            async with gate:
                result.sent_at = time.perf_counter() - started
                await _one_request(http, config, model, result.sample.prompt, result, headers)
            bar.update(1)

        await asyncio.gather(*(limited(r) for r in results))
        duration = time.perf_counter() - started
        bar.close()
        after = await read_idle_metrics(http, config.url, config.idle_timeout_s)
    if keep_results is not None:
        keep_results.extend(results)
    return build_report(config, model, results, duration, after)


def _progress(config: BenchConfig):
    from tqdm import tqdm

    return tqdm(total=config.num_prompts, desc="requests", unit="req", disable=not config.progress,
                file=sys.stderr, dynamic_ncols=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", "--base-url", dest="url", default=None,
                        help="server base URL (default http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1", help="with --port, when --url is not given")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-concurrency", "--concurrency", dest="concurrency", type=int, default=None,
                        help="requests in flight at once (default: unbounded)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps "
                        "(1: Poisson; < 1 burstier, > 1 more uniform)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests in all (default 32)")
    parser.add_argument("--dataset-name", default="validation", choices=list(DATASETS),
                        help="validation (the bundled model's text), random (token ids), sharegpt (a JSON file)")
    parser.add_argument("--dataset-path", default=None, help="the ShareGPT-format JSON file")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="fix every ShareGPT request's output length (default: its reply's token count)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per validation request (default 64)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs in ms (ttft, tpot, e2el): requests within all of them count as good")
    parser.add_argument("--metric-percentiles", default="", help="more percentiles, comma-separated (e.g. 95,99.9)")
    parser.add_argument("--cancel-fraction", type=float, default=0.0,
                        help="share of requests closed mid-stream (default 0)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--seed", type=int, default=0, help="dataset, arrivals, cancellations and sampling seeds")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: "
                        "every request generates its output length)")
    parser.add_argument("--api-key", default=None, help="bearer key, if the server wants one")
    parser.add_argument("--save-result", action="store_true", help="write the report as JSON (--result-dir, "
                        "--result-filename) and PNG plots when matplotlib is installed")
    parser.add_argument("--result-dir", default=".", help="with --save-result (default .)")
    parser.add_argument("--result-filename", default=None, help="with --save-result (default: "
                        "moekv-bench-<rate>qps-<concurrency>-<date>.json)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the report (and plots) here")
    parser.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                        help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        extra = tuple(float(q) for q in args.metric_percentiles.split(",") if q.strip())
    except ValueError:
        print(f"error: --metric-percentiles {args.metric_percentiles!r} is not a list of numbers", file=sys.stderr)
        return 2
    url = (args.url or f"http://{args.host}:{args.port}").rstrip("/")
    try:
        config = BenchConfig(url=url, concurrency=args.concurrency, num_prompts=args.num_prompts,
                             max_tokens=args.max_tokens, request_rate=args.request_rate, burstiness=args.burstiness,
                             dataset_name=args.dataset_name, dataset_path=args.dataset_path,
                             random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                             random_range_ratio=args.random_range_ratio, sharegpt_output_len=args.sharegpt_output_len,
                             goodput=tuple(args.goodput or ()), metric_percentiles=extra,
                             cancel_fraction=args.cancel_fraction, model=args.model, seed=args.seed,
                             api_key=args.api_key, temperature=args.temperature,
                             ignore_eos=not args.no_ignore_eos, progress=not args.no_progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        report, results = asyncio.run(_run_with_results(config))
    except Exception as exc:   # e.g. the server is not reachable, a bad dataset file
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    path = Path(args.json) if args.json else None
    if path is None and args.save_result:
        rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
        name = args.result_filename or (f"moekv-bench-{rate}qps-concurrency{config.concurrency or 'inf'}-"
                                        f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
        path = Path(args.result_dir) / name
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        plots = write_plots(results, path.with_suffix(""))
        print(f"wrote {path}" + "".join(f", {p}" for p in plots) + ("" if plots else
              " (no plots: pip install matplotlib)"))
    return 0 if report["requests"]["failed"] == 0 else 1


async def _run_with_results(config: BenchConfig):
    captured: list = []
    report = await run_benchmark(config, captured)
    return report, captured

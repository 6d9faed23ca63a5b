"""Prometheus metrics of the server, named as vLLM names them where they mean the same.

Prefix scheme: every series vLLM also exports keeps vLLM's name after the prefix, which is `moekv:`
by default and `vllm:` with `prefix="vllm"` (`moekv serve --metrics-prefix vllm`), so a vLLM dashboard
reads moekv unchanged; series only moekv has (low-bit KV, outlier budget, experts) are always `moekv:`.

Request-level numbers (latencies, token counts, finished requests) are pushed by the async engine's
thread as tokens are produced; engine-level numbers (queue lengths, KV cache usage, bits per value,
expert load) are read at scrape time from the snapshot the engine thread publishes, so a scrape never
touches the engine's mutable state.

Every `ServerMetrics` owns its own `CollectorRegistry`: several apps in one process never clash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "EngineStats", "RequestTimings", "ServerMetrics", "parse_metrics"]
METRICS_PREFIXES = ("moekv", "vllm")

# Bucket edges in seconds: fine where a small model on a CPU or a GPU lands, coarse in the tails.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                       0.75, 1.0, 2.5, 5.0, 10.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
               120.0, 300.0, 600.0)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state, published by the engine thread after every step.

    Read by scrapes and `/health` from other threads; a frozen object is swapped atomically.
    """

    num_running: int = 0             # requests holding KV pages (prefilling or decoding)
    num_waiting: int = 0             # queued or preempted requests
    kv_cache_usage: float = 0.0      # share of KV pages in use, 0..1
    num_preemptions: int = 0         # preemptions since start
    kv_bits_per_value: float = 0.0   # all-in bits per value of a filled page of the cache format (low-bit:
                                     # codes + scales + zero points + outliers; full precision: the dtype's)
    kv_full_precision_token_share: float = 0.0   # share of running sequences' tokens in full-precision pages
                                                 # (low-bit: sink pages and partly filled tail pages)
    prefix_cache_queries: int = 0    # prompt tokens looked up in the prefix cache at admission, since start
    prefix_cache_hits: int = 0       # ... of which were found cached (their prefill was skipped)


@dataclass(frozen=True)
class RequestTimings:
    """A finished request's phases in seconds (None: never reached) and sizes, for vLLM's request_* series."""

    queue: float | None              # arrival -> the start of the first step that ran it
    prefill: float | None            # that step -> the first token
    decode: float | None             # the first token -> the end
    inference: float | None          # the first step -> the end
    time_per_output_token: float | None   # decode / (generated - 1)
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int


def _token_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's request-token bucket edges)."""
    edges, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return edges
            edges.append(float(mantissa * scale))
        scale *= 10


class ServerMetrics:
    """The server's Prometheus metrics; thread-safe (prometheus-client metrics lock internally)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, prefix: str = "moekv",
                 max_model_len: int = 1 << 20):
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.model_name, self.prefix = model_name, prefix
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        name = self.shared_name

        def histogram(metric: str, doc: str, buckets) -> Histogram:
            return Histogram(name(metric), doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between two consecutive generated tokens.", INTER_TOKEN_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Time per output token (each gap between tokens; vLLM's older name "
            "of inter_token_latency_seconds).", INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Time from arrival to the end of a request.", E2E_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Time a request waited before its first step.", PHASE_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "Time from the first step to the first token.", PHASE_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "Time from the first token to the end.", PHASE_BUCKETS)
        self.request_inference_time = histogram("request_inference_time_seconds",
                                                "Time from the first step to the end.", PHASE_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "A request's mean time per output token after the first.",
            INTER_TOKEN_BUCKETS)
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a finished request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of a finished request.", token_buckets)
        self.request_max_tokens = histogram("request_params_max_tokens", "The max_tokens a request asked for.",
                                            token_buckets)
        self.prompt_tokens = Counter(
            name("prompt_tokens"), "Prompt tokens of requests that produced their first token.",
            labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(
            name("generation_tokens"), "Generated tokens.", labels, registry=self.registry).labels(model_name)
        self._request_success = Counter(
            name("request_success"), "Finished requests, by finish reason (stop, length, abort).",
            labels + ["finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(model_name, reason)
        self.request_failure = Counter(
            "moekv:request_failure", "Requests the engine ended with an error.", labels,
            registry=self.registry).labels(model_name)
        self._cache_info: dict[str, str] = {}
        self._stats_source: Callable[[], EngineStats] | None = None
        self._expert_load_source: Callable[[], object] | None = None
        self._kv_stats_source: Callable[[], dict[str, float]] | None = None
        self._routing_source: Callable[[], dict | None] | None = None
        self.registry.register(_EngineCollector(self))

    def shared_name(self, metric: str) -> str:
        """The exported name of a series vLLM also has."""
        return f"{self.prefix}:{metric}"

    def set_cache_info(self, **info) -> None:
        """The labels of `cache_config_info` (vLLM's: block_size, cache_dtype, num_gpu_blocks, ...)."""
        self._cache_info = {key: str(value) for key, value in info.items()}

    # -- pushed by the engine thread ----------------------------------------------------------------
    def observe_first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        self.time_to_first_token.observe(seconds)
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_tokens(self, count: int, inter_token_seconds: float | None) -> None:
        """`count` new tokens; `inter_token_seconds` is the gap per token since the previous ones."""
        self.generation_tokens.inc(count)
        if inter_token_seconds is not None:
            for _ in range(count):
                self.inter_token_latency.observe(inter_token_seconds)
                self.time_per_output_token.observe(inter_token_seconds)

    def observe_finished(self, e2e_seconds: float, finish_reason: str | None) -> None:
        self.e2e_request_latency.observe(e2e_seconds)
        if finish_reason in ("stop", "length", "abort"):
            self._request_success.labels(self.model_name, finish_reason).inc()
        else:
            self.request_failure.inc()

    def observe_request(self, timings: RequestTimings) -> None:
        """A finished request's phases and sizes."""
        for histogram, value in ((self.request_queue_time, timings.queue),
                                 (self.request_prefill_time, timings.prefill),
                                 (self.request_decode_time, timings.decode),
                                 (self.request_inference_time, timings.inference),
                                 (self.request_time_per_output_token, timings.time_per_output_token)):
            if value is not None:
                histogram.observe(max(value, 0.0))
        self.request_prompt_tokens.observe(timings.prompt_tokens)
        self.request_generation_tokens.observe(timings.generation_tokens)
        self.request_max_tokens.observe(timings.max_tokens)

    # -- read at scrape time ------------------------------------------------------------------------
    def bind(self, stats: Callable[[], EngineStats], expert_load: Callable[[], object] | None = None,
             kv_stats: Callable[[], dict[str, float]] | None = None,
             routing: Callable[[], dict | None] | None = None) -> None:
        """Where scrapes read engine-level numbers: a stats snapshot, a [layers, experts] tensor, the
        cache format's counters (`KVCache.stats()`) and the routing stats (`Engine.routing_stats()`:
        expert-prediction recall, expert-cache counters)."""
        self._stats_source = stats
        self._expert_load_source = expert_load
        self._kv_stats_source = kv_stats
        self._routing_source = routing

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Turns the engine's published snapshot into gauges and counters at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self.metrics
        stats = m._stats_source() if m._stats_source is not None else EngineStats()
        name = [m.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        shared = m.shared_name
        yield gauge(shared("num_requests_running"), "Requests holding KV pages.", stats.num_running)
        yield gauge(shared("num_requests_waiting"), "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge(shared("kv_cache_usage_perc"), "KV cache usage, 1 means 100 percent.", stats.kv_cache_usage)
        yield gauge(shared("gpu_cache_usage_perc"), "KV cache usage (vLLM's older name of kv_cache_usage_perc).",
                    stats.kv_cache_usage)
        yield counter(shared("num_preemptions"), "Preemptions (recompute) since start.", stats.num_preemptions)
        yield counter(shared("prefix_cache_queries"), "Tokens looked up in the prefix cache at admission.",
                      stats.prefix_cache_queries)
        yield counter(shared("prefix_cache_hits"), "Tokens found in the prefix cache (prefill skipped).",
                      stats.prefix_cache_hits)
        if m._cache_info:
            info = GaugeMetricFamily(shared("cache_config_info"), "Information of the KV cache configuration.",
                                     labels=["model_name", *m._cache_info])
            info.add_metric([m.model_name, *m._cache_info.values()], 1.0)
            yield info
        yield gauge("moekv:kv_cache_bits_per_value", "All-in bits per value of a filled page of the KV cache "
                    "format (low-bit: codes, scales, zero points and outliers).", stats.kv_bits_per_value)
        yield gauge("moekv:kv_cache_full_precision_token_share", "Share of the running sequences' tokens still in "
                    "full-precision pages (low-bit: partly filled tail pages and sink pages).",
                    stats.kv_full_precision_token_share)
        kv_stats = m._kv_stats_source() if m._kv_stats_source is not None else {}
        yield counter("moekv:kv_outlier_budget_hits", "Page-heads whose outlier budget overflowed (low-bit formats).",
                      outlier_budget_hits(kv_stats))
        if kv_stats:
            family = GaugeMetricFamily("moekv:kv_cache_format_stat", "The KV cache format's own counters.",
                                       labels=["model_name", "stat"])
            for key, value in sorted(kv_stats.items()):
                family.add_metric([m.model_name, key], float(value))
            yield family
        load = m._expert_load_source() if m._expert_load_source is not None else None
        if load is not None:
            family = GaugeMetricFamily("moekv:expert_load", "Routed token-slots per expert since start.",
                                       labels=["model_name", "layer", "expert"])
            for layer, row in enumerate(load.tolist()):
                for expert, value in enumerate(row):
                    family.add_metric([m.model_name, str(layer), str(expert)], float(value))
            yield family
        routing = m._routing_source() if m._routing_source is not None else None
        if routing:
            yield from _routing_metrics(m.model_name, routing)


def _routing_metrics(model_name: str, routing: dict) -> Iterable[Metric]:
    """Expert-prediction recall (overall and per layer, per lookahead) and expert-cache counters."""
    prediction = routing.get("prediction")
    if prediction:
        overall = GaugeMetricFamily("moekv:expert_prediction_recall",
                                    "Share of routed experts predicted `lookahead` layers earlier.",
                                    labels=["model_name", "lookahead"])
        per_layer = GaugeMetricFamily("moekv:expert_prediction_recall_per_layer",
                                      "Expert-prediction recall of each layer.",
                                      labels=["model_name", "lookahead", "layer"])
        for distance, value in prediction.get("overall", {}).items():
            if value is not None:
                overall.add_metric([model_name, str(distance)], float(value))
        for distance, values in prediction.get("per_layer", {}).items():
            for layer, value in enumerate(values):
                if value is not None:
                    per_layer.add_metric([model_name, str(distance), str(layer)], float(value))
        yield overall
        yield per_layer
    offload = routing.get("offload")
    if offload:
        for key, doc in (("hits", "Needed experts found resident in the device expert cache."),
                         ("misses", "Needed experts loaded on demand (the MoE block waited)."),
                         ("prefetches", "Experts copied ahead of need because they were predicted."),
                         ("wasted_prefetches", "Prefetched experts evicted before any use."),
                         ("bytes_copied", "Expert bytes copied host -> device.")):
            if key in offload:
                family = CounterMetricFamily(f"moekv:expert_cache_{key}", doc, labels=["model_name"])
                family.add_metric([model_name], float(offload[key]))
                yield family


def outlier_budget_hits(kv_stats: dict[str, float]) -> float:
    """Outlier-budget hits (page-heads whose outliers overflowed the budget) from a format's stats.

    Taken from an `outlier_budget_hits` count when the format reports one, else rebuilt from the
    low-bit format's per-page-head rates: (key + value hit rate) x quantized page-heads, where
    quantized page-heads = `pages_quantized` x `page_heads_per_page` (added by the async engine).
    """
    if "outlier_budget_hits" in kv_stats:
        return float(kv_stats["outlier_budget_hits"])
    rate = kv_stats.get("key_budget_hit_rate", 0.0) + kv_stats.get("value_budget_hit_rate", 0.0)
    page_heads = kv_stats.get("pages_quantized", 0.0) * kv_stats.get("page_heads_per_page", 0.0)
    return float(round(rate * page_heads))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} and {"name": value} for unlabelled-by-others series.

    Small and dependency-free on purpose: the load test and the tests read a few gauges with it.
    A series with labels is stored under its full `name{...}` key and also summed under its bare name.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, raw = line.rpartition(" ")
        try:
            value = float(raw)
        except ValueError:
            continue
        values[key] = value
        bare = key.split("{", 1)[0]
        if bare != key:
            values[bare] = values.get(bare, 0.0) + value
    return values

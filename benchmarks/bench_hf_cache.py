"""moekv's LowBitCache side by side with transformers' QuantizedCache (quanto, HQQ) inside `model(...)`.

    .venv/bin/python benchmarks/bench_hf_cache.py                      # bundled model, 2k context
    .venv/bin/python benchmarks/bench_hf_cache.py --model PATH --context 2048

Protocol (the same for every cache, DynamicCache included, so the reference shares the chunking): in each of
`--windows` windows of `--context` tokens of the validation text, the first `--prefill` tokens go in one
forward call and the rest in chunks of `--chunk` tokens with the cache carried over; the logits of every
position after the prefill are kept, so each of them attends to the cache's quantized earlier tokens (all
caches keep the newest < 128 tokens in full precision: residual_length=128). Metrics over those positions:
perplexity of the text, and mean KL(p_DynamicCache || p_cache) of the next-token distributions. After the
first window, `--decode-tokens` single-token greedy steps per cache time one generated token (median ms),
interleaved across caches in 8 rounds so that load changes on a shared machine hit all of them alike.

Bits per value (keys and values, every layer): bytes counted from each cache's stored tensors
(moekv.integrations.hf_accounting): codes + scales + zero points (+ moekv's outliers) + the full-precision
residual window, divided by the scalars held; "all-in" is the mean over the evaluation steps, "low-bit" the
quantized part alone at the end. Writes hf-cache-<model>.{json,md} under --out. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moekv import provenance

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "models" / "tiny-shakespeare-moe"


@dataclass
class CacheSpec:
    """One row of the table: how to build the cache, and how to describe it."""

    name: str
    family: str                     # "dynamic" | "quanto" | "hqq" | "moekv"
    bits: int
    grouping: str
    kwargs: dict = field(default_factory=dict)


def cache_specs(head_dim: int) -> list[CacheSpec]:
    specs = [CacheSpec("DynamicCache (reference)", "dynamic", 16, "none")]
    default = "transformers defaults: axis_key=0, axis_value=0, q_group_size=64"
    for bits in (2, 4):
        specs.append(CacheSpec(f"quanto int{bits} default", "quanto", bits, default + " (contiguous groups of 64)",
                               dict(nbits=bits)))
        specs.append(CacheSpec(f"quanto int{bits} matched", "quanto", bits,
                               f"keys per channel over {head_dim} tokens (axis_key=-1), values per token over "
                               f"{head_dim} channels (axis_value=0), q_group_size={head_dim}",
                               dict(nbits=bits, axis_key=-1, axis_value=0, q_group_size=head_dim)))
    for bits in (2, 3, 4):
        specs.append(CacheSpec(f"HQQ {bits}-bit default", "hqq", bits, default + " (strided groups)",
                               dict(nbits=bits)))
        specs.append(CacheSpec(f"HQQ {bits}-bit matched", "hqq", bits,
                               f"keys and values per token over {head_dim} channels (axis 1), q_group_size={head_dim}"
                               " (quantized as a [B*H*T, D] view: see flat_hqq_layer_class)",
                               dict(nbits=bits, axis_key=1, axis_value=1, q_group_size=head_dim)))

    def moekv_grouping(bits: int, values: str | None = None, outliers: str | None = None) -> str:
        """LowBitCache's layout (the same stored bits at every setting) and how its numbers are chosen; None:
        the width's default (int4: values min/max, outliers by range; int3 / int2: value range search,
        outliers by deviation beyond tau 2)."""
        if values is None:
            values = "min/max" if bits == 4 else "with a range search (value_clip_steps=8, value_clip_refine=2)"
        if outliers is None:
            outliers = "range" if bits == 4 else "deviation"
        choice = ("chosen by range (greedy: the largest cut of a group's squared range)" if outliers == "range"
                  else "chosen by deviation beyond tau 2")
        return ("LowBitCache: keys per channel over 128-token pages, values per token in groups of 32 channels "
                f"{values}, 0.35% fp16 outlier slots per page and head (keys and values) {choice}")

    for bits in (4, 3, 2):
        specs.append(CacheSpec(f"moekv int{bits}", "moekv", bits, moekv_grouping(bits), dict(bits=bits)))
    search = "with a range search (value_clip_steps=8, value_clip_refine=2)"
    specs.append(CacheSpec("moekv int4 outliers by deviation", "moekv", 4, moekv_grouping(4, outliers="deviation"),
                           dict(bits=4, outlier_select="deviation")))
    specs.append(CacheSpec("moekv int4 values range search", "moekv", 4, moekv_grouping(4, values=search),
                           dict(bits=4, value_clip_steps=8)))
    specs.append(CacheSpec("moekv int4 before issue 23 (deviation, values range search)", "moekv", 4,
                           moekv_grouping(4, values=search, outliers="deviation"),
                           dict(bits=4, value_clip_steps=8, outlier_select="deviation")))
    for bits in (3, 2):
        specs.append(CacheSpec(f"moekv int{bits} values min/max", "moekv", bits, moekv_grouping(bits, values="min/max"),
                               dict(bits=bits, value_clip_steps=0)))
        specs.append(CacheSpec(f"moekv int{bits} values symmetric search", "moekv", bits,
                               moekv_grouping(bits, values=search.replace("value_clip_refine=2", "value_clip_refine=0")),
                               dict(bits=bits, value_clip_refine=0)))
        specs.append(CacheSpec(f"moekv int{bits} outliers by range", "moekv", bits,
                               moekv_grouping(bits, outliers="range"), dict(bits=bits, outlier_select="range")))
    specs.append(CacheSpec("moekv int3 (dequantized_copy=False)", "moekv", 3, moekv_grouping(3),
                           dict(bits=3, dequantized_copy=False)))
    return specs


def backend_missing(family: str) -> str | None:
    """Why a backend cannot run here, or None."""
    module = {"quanto": "optimum.quanto", "hqq": "hqq.core.quantize"}.get(family)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as error:                      # noqa: BLE001 - any import failure means skip
        package = {"quanto": "optimum-quanto", "hqq": "hqq"}[family]
        return f"{package} is not importable ({type(error).__name__}: {error}); pip install '{package}' or moekv[bench]"
    return None


def build_cache(spec: CacheSpec, config):
    from transformers import DynamicCache, QuantizedCache

    from moekv.integrations.transformers import LowBitCache

    if spec.family == "dynamic":
        return DynamicCache(config=config)
    if spec.family == "moekv":
        return LowBitCache(config, residual_length=128, **spec.kwargs)
    cache = QuantizedCache(backend=spec.family, config=config, residual_length=128, **spec.kwargs)
    if spec.family == "hqq" and spec.kwargs.get("axis_key") == 1:
        flat = flat_hqq_layer_class()
        cache.layers = [flat(residual_length=128, **spec.kwargs) for _ in cache.layers]
    return cache


def flat_hqq_layer_class():
    """HQQ's 3-bit unpacking assumes a 2-D weight: with axis=1 it keeps shape[0] * shape[1] // group_size rows
    of a [B, H, T, D] tensor (B * H // 64 = 0 here) and fails. Quantizing the same tensor viewed as
    [B * H * T, D] gives identical axis-1 groups (contiguous runs of q_group_size values) and works."""
    from transformers.cache_utils import HQQQuantizedLayer

    class FlatHQQQuantizedLayer(HQQQuantizedLayer):
        def _quantize(self, tensor, axis):
            codes, meta = super()._quantize(tensor.reshape(-1, tensor.shape[-1]), axis)
            meta["kv_shape"] = tuple(tensor.shape)
            return codes, meta

        def _dequantize(self, qtensor):
            return super()._dequantize(qtensor).reshape(qtensor[1]["kv_shape"])

    return FlatHQQQuantizedLayer


class Runner:
    """Feeds token chunks through the model with one cache; keeps log-probabilities and bits per step."""

    def __init__(self, model, ids: torch.Tensor):
        self.model = model
        self.ids = ids                                # [context]
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def forward(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(input_ids=tokens.unsqueeze(0), use_cache=True, **{self.cache_kwarg: cache})
        return out.logits[0].float().log_softmax(-1)                   # [n, vocab]

    def evaluate(self, cache, prefill: int, chunk: int) -> tuple[torch.Tensor, list]:
        """Log-probabilities [context - prefill, vocab] of the positions after the prefill, and the cache's
        stored bytes after each chunk."""
        from moekv.integrations.hf_accounting import stored_bytes

        self.forward(self.ids[:prefill], cache)
        logprobs, sizes = [], []
        for start in range(prefill, self.ids.numel(), chunk):
            logprobs.append(self.forward(self.ids[start:start + chunk], cache))
            sizes.append(stored_bytes(cache))
        return torch.cat(logprobs), sizes



@dataclass
class DecodeTimer:
    """One cache left after its first window, continued by single-token greedy steps."""

    runner: Runner
    cache: object
    token: torch.Tensor                                 # [1] the next token to feed
    seconds: list = field(default_factory=list)

    def step(self, count: int) -> None:
        for _ in range(count):
            begin = time.perf_counter()
            self.token = self.runner.forward(self.token, self.cache)[-1].argmax().view(1)
            self.seconds.append(time.perf_counter() - begin)


def time_interleaved(timers: list[DecodeTimer], steps: int, rounds: int = 8) -> None:
    """`steps` decode steps per cache, in `rounds` rounds that visit every cache in turn, so load changes on a
    shared machine spread over all caches alike."""
    per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
    for count in per_round:
        for timer in timers:
            timer.step(count)


def git_commit() -> str:
    commit = provenance.git_commit(dirty_paths=["src/moekv/integrations", "src/moekv/kv", "src/moekv/ops/reference",
                                                "src/moekv/kvcache/formats", "src/moekv/config.py", "src/moekv/core",
                                                "benchmarks/bench_hf_cache.py"])
    if commit is None:
        return "unknown"
    return f"uncommitted (on {commit[:-len('+uncommitted')]})" if commit.endswith("+uncommitted") else commit


def package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "optimum-quanto", "hqq"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def load_windows(args, tokenizer) -> list[torch.Tensor]:
    """`--windows` token windows of `--context` tokens, `--window-stride` tokens apart, from the start."""
    if args.text:
        text = Path(args.text).read_text(encoding="utf-8")
    else:
        from moekv import datasets

        text = datasets.validation_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    needed = (args.windows - 1) * args.window_stride + args.context
    if ids.numel() < needed:
        raise SystemExit(f"the text has {ids.numel()} tokens; {args.windows} windows of {args.context} tokens "
                         f"{args.window_stride} apart need {needed} (lower --windows or --window-stride)")
    return [ids[k * args.window_stride:k * args.window_stride + args.context] for k in range(args.windows)]


def evaluate_spec(spec: CacheSpec, model, windows: list[torch.Tensor], references: list[torch.Tensor] | None,
                  args) -> tuple[dict, list[torch.Tensor], DecodeTimer]:
    """Metrics of one cache over all windows; returns (metrics, log-probabilities per window, the first
    window's cache ready for decode timing)."""
    nll_sum, kl_sum, positions, bits, lowbit, logprobs_all, seconds = 0.0, 0.0, 0, [], [], [], 0.0
    timer = None
    for index, ids in enumerate(windows):
        runner = Runner(model, ids)
        cache = build_cache(spec, model.config)
        begin = time.perf_counter()
        logprobs, sizes = runner.evaluate(cache, args.prefill, args.chunk)
        seconds += time.perf_counter() - begin
        if index == 0:
            timer = DecodeTimer(runner, cache, logprobs[-1].argmax().view(1))
        scored = logprobs[:-1]                                         # the last position has no target here
        targets = ids[args.prefill + 1:]
        nll_sum += -scored.gather(-1, targets.view(-1, 1)).sum().item()
        reference = scored if references is None else references[index]
        kl_sum += (reference.exp() * (reference - scored)).sum(-1).sum().item()
        positions += targets.numel()
        bits.extend(s.bits_per_value for s in sizes)
        lowbit.append(sizes[-1].lowbit_bits_per_value)
        logprobs_all.append(scored)
    metrics = {
        "perplexity": math.exp(nll_sum / positions),
        "mean_kl": kl_sum / positions,
        "bits_per_value_all_in": statistics.fmean(bits),
        "bits_per_value_lowbit": None if lowbit[0] is None else statistics.fmean(lowbit),
        "eval_seconds": seconds,
        "positions": positions,
    }
    return metrics, logprobs_all, timer


def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = load_windows(args, tokenizer)
    text_config = model.config.get_text_config(decoder=True)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    rows, references, timers = [], None, []
    for spec in cache_specs(head_dim):
        if args.only and not any(word in spec.name.lower() for word in args.only) and spec.family != "dynamic":
            continue
        row = {"name": spec.name, "family": spec.family, "bits": spec.bits, "grouping": spec.grouping,
               "kwargs": spec.kwargs}
        missing = backend_missing(spec.family)
        if missing:
            print(f"skip {spec.name}: {missing}", flush=True)
            rows.append(row | {"skipped": missing})
            continue
        try:
            metrics, logprobs, timer = evaluate_spec(spec, model, windows, references, args)
        except Exception as error:                   # noqa: BLE001 - a backend failing is a result, not a crash
            print(f"error {spec.name}: {type(error).__name__}: {error}", flush=True)
            rows.append(row | {"error": f"{type(error).__name__}: {error}"})
            continue
        if references is None:
            references = logprobs
        row |= metrics
        print(f"{spec.name:40s} ppl {row['perplexity']:8.3f}  KL {row['mean_kl']:.5f}  "
              f"bits {row['bits_per_value_all_in']:.3f}", flush=True)
        rows.append(row)
        timers.append((row, timer))
    print(f"timing {args.decode_tokens} decode steps per cache, interleaved", flush=True)
    time_interleaved([timer for _, timer in timers], args.decode_tokens)
    for row, timer in timers:
        row["ms_per_token"] = 1000.0 * statistics.median(timer.seconds)
        row["ms_per_token_all"] = [round(1000.0 * s, 2) for s in timer.seconds]
    return {"rows": rows, "head_dim": head_dim, "dtype": str(model.dtype),
            "window_offsets": [k * args.window_stride for k in range(args.windows)]}


def _row(rows: list[dict], name: str) -> dict | None:
    found = [r for r in rows if r["name"] == name and "perplexity" in r]
    return found[0] if found else None


def check_targets(rows: list[dict]) -> list[dict]:
    """The targets (issue 23): at each width, moekv int<b> with no more low-bit bits per value than a quanto / HQQ
    configuration of that width has a lower perplexity and a lower KL than it."""
    checks = []
    pairs = [(f"moekv int{r['bits']}", r["name"]) for r in rows if r["family"] in ("quanto", "hqq")]
    for ours_name, theirs_name in pairs:
        ours, theirs = _row(rows, ours_name), _row(rows, theirs_name)
        if ours is None or theirs is None:
            checks.append({"ours": ours_name, "theirs": theirs_name, "status": "not measured"})
            continue
        fewer_bits = ours["bits_per_value_lowbit"] <= theirs["bits_per_value_lowbit"] + 1e-9
        better_ppl = ours["perplexity"] < theirs["perplexity"]
        better_kl = ours["mean_kl"] < theirs["mean_kl"]
        checks.append({
            "ours": ours_name, "theirs": theirs_name, "met": fewer_bits and better_ppl and better_kl,
            "bits": [ours["bits_per_value_lowbit"], theirs["bits_per_value_lowbit"]],
            "perplexity": [ours["perplexity"], theirs["perplexity"]],
            "mean_kl": [ours["mean_kl"], theirs["mean_kl"]],
            "status": "met" if fewer_bits and better_ppl and better_kl else "missed",
        })
    return checks


def pareto_rows(rows: list[dict]) -> tuple[list[dict], list[bool]]:
    """The measured low-bit rows and whether each is on the (low-bit bits, KL) Pareto front."""
    from moekv.eval.pareto import pareto_front

    measured = [r for r in rows if "perplexity" in r and r.get("bits_per_value_lowbit") is not None]
    return measured, pareto_front([(r["bits_per_value_lowbit"], r["mean_kl"]) for r in measured])


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """KL against low-bit bits per value for every family (PNG; None without matplotlib)."""
    from moekv.eval.pareto import plot_pareto

    series: dict[str, list] = {}
    for r in pareto_rows(rows)[0]:
        series.setdefault(r["family"], []).append((r["name"], r["bits_per_value_lowbit"], r["mean_kl"]))
    return plot_pareto(series, path, "low-bit bits per value", "mean KL(DynamicCache || cache), nats", title)


def _fmt(value, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    meta, rows = report["meta"], report["rows"]
    reference = _row(rows, "DynamicCache (reference)")
    lines = [
        f"# transformers caches side by side: {meta['model_name']}, {meta['context']}-token context",
        "",
        f"- date: {meta['date']}; machine: {meta['machine']}; commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}; model dtype {report['dtype']}",
        f"- protocol: {meta['windows']} windows of {meta['context']} tokens of the validation text (offsets "
        f"{', '.join(str(o) for o in report['window_offsets'])}); per window, prefill {meta['prefill']} tokens, then "
        f"chunks of {meta['chunk']} tokens with the cache carried over; perplexity and mean KL(p_DynamicCache || "
        f"p_cache) over the {meta['evaluated_positions']} positions after the prefills; every cache keeps the newest "
        "< 128 tokens in full precision (residual_length=128).",
        "- bits per value: bytes of the stored tensors (codes + scales + zero points + moekv's outliers + the "
        "full-precision residual window) x 8 / key-value scalars held; *all-in* = mean over the evaluation steps, "
        "*low-bit* = the quantized part alone at the end.",
        f"- ms/token: median of {meta['decode_tokens']} single-token greedy steps after the first window's "
        f"{meta['context']} tokens, interleaved across caches in 8 rounds, {meta['threads']} CPU thread(s); "
        f"load average at start {meta['load_average']} (a shared machine: compare timings within one run only).",
        "",
        "| cache | all-in bits/value | low-bit bits/value | perplexity | Δ ppl | mean KL | ms/token |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "perplexity" not in r:
            lines.append(f"| {r['name']} | {r.get('skipped') or r.get('error')} |||||| ")
            continue
        delta = r["perplexity"] - reference["perplexity"] if reference else None
        lines.append(f"| {r['name']} | {_fmt(r['bits_per_value_all_in'], 3)} | {_fmt(r['bits_per_value_lowbit'], 3)} "
                     f"| {r['perplexity']:.3f} | {_fmt(delta, 3)} | {r['mean_kl']:.5f} | {r['ms_per_token']:.1f} |")
    lines += ["", "Groupings:", ""]
    for r in rows:
        lines.append(f"- {r['name']}: {r['grouping']}")
    lines += ["", "## Pareto front (low-bit bits per value against mean KL; lower is better on both)", "",
              "| cache | low-bit bits/value | mean KL | on the front |", "| --- | ---: | ---: | --- |"]
    for r, on in zip(*pareto_rows(rows)):
        lines.append(f"| {r['name']} | {r['bits_per_value_lowbit']:.3f} | {r['mean_kl']:.5f} | {'yes' if on else ''} |")
    if report.get("plot"):
        lines += ["", f"Plot: `{report['plot']}`."]
    lines += ["", "## Targets", "", "| ours | theirs | low-bit bits (ours / theirs) | perplexity | mean KL | status |",
              "| --- | --- | --- | --- | --- | --- |"]
    for c in report["targets"]:
        if c["status"] == "not measured":
            lines.append(f"| {c['ours']} | {c['theirs']} | | | | not measured |")
            continue
        lines.append(f"| {c['ours']} | {c['theirs']} | {c['bits'][0]:.3f} / {c['bits'][1]:.3f} "
                     f"| {c['perplexity'][0]:.3f} / {c['perplexity'][1]:.3f} "
                     f"| {c['mean_kl'][0]:.5f} / {c['mean_kl'][1]:.5f} | {c['status']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(BUNDLED), help="a local transformers checkpoint folder")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=256, help="tokens of the first forward call")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per later forward call")
    parser.add_argument("--decode-tokens", type=int, default=64, help="single-token steps to time")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="model dtype (auto: the checkpoint's)")
    parser.add_argument("--text", default=None, help="a UTF-8 text file (default: moekv's validation text)")
    parser.add_argument("--windows", type=int, default=3, help="text windows of --context tokens to evaluate")
    parser.add_argument("--window-stride", type=int, default=8192, help="tokens from one window's start to the next")
    parser.add_argument("--only", default=None,
                        help="comma-separated substrings of cache names to run (the reference always runs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steadiest timings on a shared machine)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    args.only = [w.strip().lower() for w in args.only.split(",")] if args.only else None
    if not 0 < args.prefill < args.context:
        parser.error("--prefill must be in (0, --context)")
    model_name = Path(args.model).resolve().name
    started = datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = run(args)
    report = {
        "meta": {
            "date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, CPU".strip(),
            "commit": git_commit(),
            "command": shlex.join([".venv/bin/python",
                                   os.path.relpath(__file__, REPO)] + (argv if argv is not None else sys.argv[1:])),
            "versions": package_versions(),
            "model": args.model if Path(args.model).resolve() != BUNDLED.resolve() else "models/tiny-shakespeare-moe",
            "model_name": model_name,
            "context": args.context, "prefill": args.prefill, "chunk": args.chunk,
            "decode_tokens": args.decode_tokens, "threads": args.threads,
            "windows": args.windows, "window_stride": args.window_stride,
            "evaluated_positions": args.windows * (args.context - args.prefill - 1),
            "load_average": None if load is None else round(load, 2),
        },
        **result,
    }
    report["targets"] = check_targets(report["rows"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"hf-cache-{model_name}"
    drawn = plot(report["rows"], Path(f"{stem}.png"), f"{model_name}: quality against bits, {args.context} tokens")
    report["plot"] = os.path.relpath(drawn, REPO) if drawn else None
    if drawn is None:
        print("no plot: matplotlib is not installed")
    Path(f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    Path(f"{stem}.md").write_text(text)
    print(text)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""moekv's LowBitCache side by side with transformers' QuantizedCache (quanto, HQQ) inside `model(...)`.

    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_hf_cache.py                      # bundled model, 2k context
    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_hf_cache.py --model PATH --context 2048

Protocol (the same for every cache, DynamicCache included, so the reference shares the chunking): in each of
`--windows` windows of `--context` tokens of the validation text (default: all of it, windows side by side:
18 x 2048 tokens on the bundled model; session 30 moved from 3 windows, whose noise had put a cache's
perplexity below the reference's), the first `--prefill` tokens go in one
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

Pieces: hf_cache_specs.py (the caches compared, how each is built), hf_cache_report.py (targets, Pareto rows,
plot, markdown).
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

from benchmarks.hf_cache_report import check_targets, markdown, plot
from benchmarks.hf_cache_specs import CacheSpec, backend_missing, build_cache, cache_specs
from moekv import provenance

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "models" / "tiny-shakespeare-moe"


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
                                                "benchmarks/bench_hf_cache.py",
                                                "benchmarks/hf_cache_specs.py", "benchmarks/hf_cache_report.py"])
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


def selected(name: str, only: list[str]) -> bool:
    """Whether `--only` picks the cache `name`: a word matches as a substring, '=word' the whole name."""
    name = name.lower()
    return any(name == word[1:] if word.startswith("=") else word in name for word in only)


def load_windows(args, tokenizer) -> list[torch.Tensor]:
    """`--windows` token windows of `--context` tokens, `--window-stride` tokens apart, from the start (None:
    every window that fits; sets args.windows)."""
    if args.text:
        text = Path(args.text).read_text(encoding="utf-8")
    else:
        from moekv import datasets

        text = datasets.validation_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if args.windows is None:
        args.windows = max(1, (ids.numel() - args.context) // args.window_stride + 1)
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
        if args.only and not selected(spec.name, args.only) and spec.family != "dynamic":
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
    parser.add_argument("--windows", type=int, default=None,
                        help="text windows of --context tokens to evaluate (default: every one that fits)")
    parser.add_argument("--window-stride", type=int, default=2048, help="tokens from one window's start to the next")
    parser.add_argument("--only", default=None,
                        help="comma-separated substrings of cache names to run, or '=NAME' for exactly that name "
                             "(case-insensitive; the reference always runs)")
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
    commit = git_commit()                    # the code that runs: read before the run (the tree may move during it)
    result = run(args)
    report = {
        "meta": {
            "date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, CPU".strip(),
            "commit": commit,
            "command": shlex.join(["PYTHONPATH=src:.", ".venv/bin/python",
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

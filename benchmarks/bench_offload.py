"""Expert offloading with speculative prefetch: prediction recall, cache simulation, the copy / compute
timeline, and decode speed.

    # prediction recall on the bundled model's validation text (CPU is fine; ~2 min on 2 cores)
    PYTHONPATH=src:. python benchmarks/bench_offload.py recall --device cpu --out benchmarks/results/offload-recall-cpu
    # expert copies per layer and token by cache size and policy, simulated on the bundled model's trace
    PYTHONPATH=src:. python benchmarks/bench_offload.py simulate --out benchmarks/results/offload-sim-cpu
    # ms / token by mode from the copy / compute timeline simulator (moe.prefetch.timeline), on the bundled
    # model's trace, for given copy and compute times (default: the H200 run's 6.36 ms copy, 11.8 ms / 8 layers)
    PYTHONPATH=src:. python benchmarks/bench_offload.py timeline --out benchmarks/results/offload-timeline-cpu
    # ... with a wrong estimate: the measured guess gate ("staged") against the estimate gate ("staged-estimate")
    PYTHONPATH=src:. python benchmarks/bench_offload.py timeline --estimated-copy-factor 0.5 --copy-call-ms 0.3 \
        --out benchmarks/results/offload-timeline-gate-cpu
    # decode speed, every issue-24 mode side by side (benchmarks/offload_speed.py; one H200, ~3 min)
    PYTHONPATH=src:. python3 -u benchmarks/bench_offload.py speed --device cuda --num-layers 8 --out benchmarks/results/offload-speed-h200-issue24
    # the same at a tiny scale on the CPU (plumbing + self-checks, timings meaningless)
    PYTHONPATH=src:. python benchmarks/bench_offload.py speed --tiny --device cpu

Writes OUT.json and OUT.md. `speed` is documented in benchmarks/offload_speed.py.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import offload_speed
from benchmarks.offload_common import REPO, bundled_tokens, pct, provenance, write
from moekv import datasets
from moekv.models.loader import load_model
from moekv.moe.prefetch.predictor import ExpertPredictor
from moekv.moe.prefetch.timeline import simulate_decode
from moekv.moe.prefetch.trace import record_trace, run_windows, simulate_cache
from moekv.tokenizer import Tokenizer


# ---------------------------------------------------------------------------------------- recall
class LinearMapPredictor(ExpertPredictor):
    """A learned baseline: x_target ~ x_layer M (ridge fit on training text), then the target router."""

    maps: dict[tuple[int, int], torch.Tensor] = {}

    def predict(self, layer, target, residual, normed):
        matrix = self.maps.get((layer, target))
        return super().predict(layer, target, residual if matrix is None else residual @ matrix, normed)


def fit_linear_maps(model, token_ids: list[int], window: int) -> dict:
    captured: dict[int, list[torch.Tensor]] = {}
    handles = [layer.post_attn_norm.register_forward_hook(
        lambda m, args, out, i=i: captured.setdefault(i, []).append(args[0].float().cpu()))
        for i, layer in enumerate(model.layers)]
    run_windows(model, token_ids, window)
    for handle in handles:
        handle.remove()
    hidden = {i: torch.cat(v) for i, v in captured.items()}                    # [N, H] per layer
    maps = {}
    for layer in hidden:
        x = hidden[layer]
        gram = x.T @ x
        gram += 1e-2 * gram.diagonal().mean() * torch.eye(x.shape[1])
        for target in (layer + 1, layer + 2):
            if target in hidden:
                maps[(layer, target)] = torch.linalg.solve(gram, x.T @ hidden[target]).to(model.device)
    return maps


def cmd_recall(args) -> None:
    torch.set_num_threads(max(1, args.threads))
    model_dir, ids = bundled_tokens(args.max_tokens)
    model = load_model(model_dir, dtype=args.dtype, device=args.device)
    variants = [("attn", "next"), ("attn", "current"), ("attn", "none"), ("layer_out", "next")]
    predictors = {(s, n, e): ExpertPredictor(model, 2, e, source=s, norm=n)
                  for s, n in variants for e in range(args.max_extra + 1)}
    if args.learned:
        text = datasets.default_corpus_path().read_text(encoding="utf-8")
        train_ids = Tokenizer(model_dir).encode(datasets.split_text(text)[0][:args.learned_chars])
        LinearMapPredictor.maps = fit_linear_maps(model, train_ids, args.window)
        for e in range(args.max_extra + 1):
            predictors[("attn+linear", "next", e)] = LinearMapPredictor(model, 2, e, source="attn")
    started = time.perf_counter()
    tokens = run_windows(model, ids, args.window)
    rows = []
    for (source, norm, extra), predictor in predictors.items():
        recall = predictor.recall()
        rows.append({"source": source, "norm": norm, "extra_candidates": extra,
                     "experts_predicted": recall["experts_predicted_per_token"],
                     "recall": recall["overall"], "precision": recall["precision"],
                     "per_layer": recall["per_layer"]})
    report = {**provenance(sys.argv), "model": str(model_dir.relative_to(REPO)) if model_dir.is_relative_to(REPO)
              else str(model_dir), "text": "validation split (moekv.datasets.validation_text)",
              "tokens": tokens, "window": args.window, "dtype": args.dtype, "device": args.device,
              "top_k": model.arch.top_k, "num_experts": model.arch.num_experts,
              "seconds": round(time.perf_counter() - started, 1), "results": rows}
    lines = [f"# Expert prediction recall: {report['model']}", "",
             f"{tokens} validation tokens in {args.window}-token windows, {args.dtype} on {args.device}; "
             f"{report['date']}, commit {report['commit']}, machine {report['machine']['host']} "
             f"({report['machine']['cpu']}).", "", f"Command: `{report['command']}`", "",
             "Recall = share of routed (token, expert) pairs that were in that token's predicted set; "
             "layer 0 is predicted from the token embeddings.", "",
             "| source | norm | predicted / token | recall 1 ahead % | recall 2 ahead % | precision 1 ahead % "
             "| per layer, 1 ahead % | per layer, 2 ahead % |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        per1 = " / ".join(pct(v) for v in row["per_layer"][1])
        per2 = " / ".join(pct(v) for v in row["per_layer"][2])
        lines.append(f"| {row['source']} | {row['norm']} | {row['experts_predicted']} | {pct(row['recall'][1])} | "
                     f"{pct(row['recall'][2])} | {pct(row['precision'][1])} | {per1} | {per2} |")
    print("\n".join(lines[10:]))
    if args.out:
        write(args.out, report, "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------- simulate
def cmd_simulate(args) -> None:
    model_dir, ids = bundled_tokens(args.max_tokens)
    model = load_model(model_dir, dtype=torch.float32, device=args.device)
    trace = record_trace(model, ids, window=512, extra_candidates=1)
    top_k, num_experts = model.arch.top_k, model.arch.num_experts
    rows = [simulate_cache(trace, round(p * num_experts / 100), width, source, args.eviction)
            for p in (25, 50, 75) for width, source in [(None, "attn"), (1, "attn"), (top_k, "attn"),
                                                        (top_k + 1, "attn"), (top_k, "layer_out")]]
    report = {**provenance(sys.argv), "tokens": trace.num_tokens, "layers": trace.num_layers, "rows": rows}
    lines = ["# Expert-cache copies, simulated on the bundled model's routing", "",
             f"Batch-1 decode over {trace.num_tokens} validation tokens, each layer its own cache "
             f"({args.eviction}); moe.prefetch.trace.simulate_cache (tested equal to the offloaded model's "
             f"counters). {report['date']}, commit {report['commit']}.", "", f"Command: `{report['command']}`", "",
             "| slots | prefetch | copies / layer / token | misses / layer / token | hit rate % | "
             "wasted prefetches / layer / token |", "|---|---|---|---|---|---|"]
    for row in rows:
        mode = "on demand" if row["prefetch_width"] is None else f"top-{row['prefetch_width']} ({row['source']})"
        lines.append(f"| {row['slots']} / {num_experts} | {mode} | {row['copies_per_layer_token']:.3f} | "
                     f"{row['misses_per_layer_token']:.3f} | {pct(row['hit_rate'])} | "
                     f"{row['wasted_prefetches_per_layer_token']:.3f} |")
    print("\n".join(lines[6:]))
    if args.out:
        write(args.out, report, "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------- timeline
def cmd_timeline(args) -> None:
    model_dir, ids = bundled_tokens(args.max_tokens)
    model = load_model(model_dir, dtype=torch.float32, device=args.device)
    trace = record_trace(model, ids, window=512, extra_candidates=1)
    top_k, num_experts = model.arch.top_k, model.arch.num_experts
    per_layer = args.compute_ms / args.layers
    rows = []
    for percent in (25, 50, 75):
        slots = round(percent * num_experts / 100)
        for copy_ms, fmt in ((args.copy_ms, "bf16"), (args.copy_ms / 2, "fp8")):
            base = None
            for mode, width in (("on-demand", None), ("prefetch", top_k), ("staged", top_k + 1),
                                ("staged-estimate", top_k + 1)):
                if mode == "prefetch" and fmt == "fp8":
                    continue
                staged = dict(gate="estimate" if mode == "staged-estimate" else "measured",
                              estimated_copy_ms=copy_ms * args.estimated_copy_factor,
                              copy_call_ms=args.copy_call_ms) if mode.startswith("staged") else {}
                sim = simulate_decode(trace, slots, mode.split("-estimate")[0], copy_ms, per_layer / 2, per_layer / 2,
                                      width=width, threshold=args.threshold, **staged)
                base = base or sim
                worse = sum(a > b + 1e-9 for a, b in zip(sim["step_ms"], base["step_ms"]))
                rows.append({"cache_percent": percent, "slots": slots, "host_format": fmt, "mode": mode,
                             "ms_per_token": sim["ms_per_token"] * args.layers / trace.num_layers,
                             "speedup_vs_on_demand": base["ms_per_token"] / sim["ms_per_token"],
                             "steps_slower_than_on_demand": worse, "copies_per_token":
                             sim["copies_per_token"] * args.layers / trace.num_layers,
                             "staged": {k: v for k, v in (sim["staged"] or {}).items()
                                        if k not in ("calibration", "learned")} or None})
    report = {**provenance(sys.argv), "tokens": trace.num_tokens, "trace_layers": trace.num_layers,
              "layers": args.layers, "copy_ms": args.copy_ms, "compute_ms": args.compute_ms,
              "threshold": args.threshold, "estimated_copy_factor": args.estimated_copy_factor,
              "copy_call_ms": args.copy_call_ms, "rows": rows}
    lines = ["# Copy / compute timeline simulator: batch-1 decode by mode", "",
             f"moe.prefetch.timeline.simulate_decode on the bundled model's routing and 1-ahead guesses ({trace.num_tokens} "
             f"validation tokens, {trace.num_layers} layers, scaled to {args.layers}); one expert's copy {args.copy_ms} ms "
             f"(FP8 host experts: half), compute {args.compute_ms} ms per token (half attention, half experts per layer), "
             f"no host overhead; staged threshold {args.threshold}; staged: the measured guess gate, staged-estimate: "
             f"the estimate gate, the estimate's copy time x {args.estimated_copy_factor}, each guess copy call "
             f"{args.copy_call_ms} ms more than its bytes. {report['date']}, commit {report['commit']}.", "",
             f"Command: `{report['command']}`", "",
             "| cache | host | mode | ms / token | vs on-demand (same host format) | steps slower than on-demand "
             "| copies / token | staged promoted / dropped | overruns |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        staged = row["staged"]
        lines.append(f"| {row['cache_percent']}% ({row['slots']}) | {row['host_format']} | {row['mode']} | "
                     f"{row['ms_per_token']:.1f} | {row['speedup_vs_on_demand']:.2f}x | "
                     f"{row['steps_slower_than_on_demand']} | {row['copies_per_token']:.2f} | "
                     f"{'-' if not staged else str(staged['promoted']) + ' / ' + str(staged['dropped'])} | "
                     f"{'-' if not staged else staged['overruns']} |")
    print("\n".join(lines[6:]))
    if args.out:
        write(args.out, report, "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    recall = sub.add_parser("recall", help="prediction recall on the bundled model's validation text")
    recall.add_argument("--device", default="cpu")
    recall.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    recall.add_argument("--window", type=int, default=512)
    recall.add_argument("--max-tokens", type=int, default=None, help="default: the whole validation split")
    recall.add_argument("--max-extra", type=int, default=2)
    recall.add_argument("--learned", action="store_true", help="also fit the linear-map baseline on training text")
    recall.add_argument("--learned-chars", type=int, default=150_000)
    recall.add_argument("--threads", type=int, default=torch.get_num_threads())
    recall.add_argument("--out", default=None)
    simulate = sub.add_parser("simulate", help="expert copies per token by cache size and prefetch policy")
    simulate.add_argument("--device", default="cpu")
    simulate.add_argument("--max-tokens", type=int, default=8192)
    simulate.add_argument("--eviction", default="lru", choices=("lru", "lfu"))
    simulate.add_argument("--out", default=None)
    timeline = sub.add_parser("timeline", help="ms / token by mode from the copy / compute timeline simulator")
    timeline.add_argument("--device", default="cpu")
    timeline.add_argument("--max-tokens", type=int, default=4096)
    timeline.add_argument("--copy-ms", type=float, default=6.36, help="one 16-bit expert's copy (H200 run: 6.36)")
    timeline.add_argument("--compute-ms", type=float, default=11.8, help="resident decode ms / token (H200: 11.8)")
    timeline.add_argument("--layers", type=int, default=8, help="MoE layers the compute time is for")
    timeline.add_argument("--threshold", default="auto")
    timeline.add_argument("--estimated-copy-factor", type=float, default=1.0,
                          help="staged rows: the policy's estimate of a copy = the true copy x this (1: exact)")
    timeline.add_argument("--copy-call-ms", type=float, default=0.0,
                          help="staged rows: copy-stream time per guess copy call on top of its bytes")
    timeline.add_argument("--out", default=None)
    offload_speed.add_arguments(sub.add_parser("speed", help="decode ms / token of every issue-24 mode side by side"))
    args = parser.parse_args()
    if args.command == "recall":
        cmd_recall(args)
    elif args.command == "simulate":
        cmd_simulate(args)
    elif args.command == "timeline":
        args.threshold = args.threshold if args.threshold == "auto" else float(args.threshold)
        cmd_timeline(args)
    else:
        offload_speed.finish_arguments(args)
        offload_speed.cmd_speed(args)


if __name__ == "__main__":
    main()

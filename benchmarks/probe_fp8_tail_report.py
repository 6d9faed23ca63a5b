"""Bits and the report of benchmarks/probe_fp8_tail.py (the FP8 staging-tail study): staged bits per value, all-in bits at
16k (exact / held / page cycle) with the production accounting and only the staged element size changed, the paired
differences, the markdown."""

from __future__ import annotations

import math

import torch

MODES = ("bf16", "fp8", "fp8-pow2", "fp8-raw")
SCALE_BITS = {"bf16": None, "fp8": 16, "fp8-pow2": 8, "fp8-raw": 0}      # per staged row (token, kv head)
SIDES = {"fp8-k": ("fp8", "bf16"), "fp8-v": ("bf16", "fp8")}            # tensor-level split: keys / values only


def paired(mine: list[float], base: list[float]) -> tuple[float, float]:
    """Mean and standard error over windows of mine - base."""
    diff = [a - b for a, b in zip(mine, base)]
    mean = sum(diff) / len(diff)
    return mean, math.sqrt(sum((d - mean) ** 2 for d in diff) / max(len(diff) - 1, 1) / len(diff))


def staged_bits(mode: str, head_dim: int) -> float:
    if mode in SIDES:
        return sum(staged_bits(side, head_dim) for side in SIDES[mode]) / 2
    return 16.0 if mode == "bf16" else 8.0 + SCALE_BITS[mode] / head_dim


def bits_at(bits: int, mode: str, context: int = 16384, heads: int = 8, head_dim: int = 128) -> dict[str, float]:
    """All-in bits per value (kvcache/accounting.cache_bits_per_value with the staging element size of `mode`:
    bytes per staged element incl. its share of the row scale) on the decode bench's shape (8 KV heads, head_dim
    128, P = 128): exact (context), held (context + 40), page-cycle mean (context .. context + P - 1), pages alone."""
    from moekv.config import CacheConfig
    from moekv.kvcache import accounting
    from moekv.kvcache.base import KVCacheSpec
    from moekv.kvcache.formats.lowbit_capacity import quant_specs

    spec = KVCacheSpec(num_layers=1, num_kv_heads=heads, head_dim=head_dim, page_size=128, dtype=torch.bfloat16)
    key, value = quant_specs(spec, CacheConfig(kv_cache_dtype=f"int{bits}"))
    element = staged_bits(mode, head_dim) / 8.0
    at = lambda n: accounting.cache_bits_per_value(key, value, heads, element, [n])   # noqa: E731
    cycle = [at(n) for n in range(context, context + 128)]
    return {"exact": at(context), "held": at(context + 40), "page_cycle": sum(cycle) / len(cycle),
            "pages": accounting.format_bits_per_value(key, value), "staged_bits": staged_bits(mode, head_dim)}


def cycle_bits(bits: int, staged: float, block: int = 128, lazy_page: bool = False, value_fraction=None,
               context: int = 16384, heads: int = 8, head_dim: int = 128) -> float:
    """Page-cycle mean of the all-in bits from the accounting's page and staging byte counts, for designs the
    accounting does not model (checked against cache_bits_per_value for block = P, lazy_page False): staged rows
    held in blocks of `block` tokens, and `lazy_page`: the partial page's low-bit storage not held until it fills."""
    from moekv.config import CacheConfig
    from moekv.kvcache import accounting
    from moekv.kvcache.base import KVCacheSpec
    from moekv.kvcache.formats.lowbit_capacity import quant_specs

    spec = KVCacheSpec(num_layers=1, num_kv_heads=heads, head_dim=head_dim, page_size=128, dtype=torch.bfloat16)
    extra = {} if value_fraction is None else {"value_outlier_fraction": value_fraction}
    key, value = quant_specs(spec, CacheConfig(kv_cache_dtype=f"int{bits}", **extra))
    lowbit = accounting.lowbit_page_bytes(key, value, heads, 1)
    row = accounting.staging_page_bytes(1, heads, head_dim, staged / 8.0, 1)        # one staged token, k + v
    total = 0.0
    for n in range(context, context + 128):
        pages, _ = accounting.pages_held(n, 128)
        tail = n % 128
        held = pages - int(lazy_page and tail > 0)
        total += 8.0 * (held * lowbit + -(-tail // block) * block * row) / (2 * n * heads * head_dim)
    plain = total / 128
    if block == 128 and not lazy_page:
        assert abs(plain - sum(accounting.cache_bits_per_value(key, value, heads, staged / 8.0, [n])
                               for n in range(context, context + 128)) / 128) < 1e-9
    return plain


def design_bits(widths) -> list[dict]:
    """Page-cycle bits at 16k of the FP8 tail alone and of the combinations that would take int3 under 3.30."""
    fp8 = staged_bits("fp8", 128)
    designs = [("bf16 staging (today)", dict(staged=16.0)), ("fp8 staging", dict(staged=fp8)),
               ("fp8 staging, value outliers 0.23 %", dict(staged=fp8, value_fraction=0.0023)),
               ("fp8 staging in 32-token blocks", dict(staged=fp8, block=32)),
               ("bf16 staging in 32-token blocks", dict(staged=16.0, block=32)),
               ("fp8 staging, partial page's low-bit storage not held", dict(staged=fp8, lazy_page=True)),
               ("bf16 staging, partial page's low-bit storage not held", dict(staged=16.0, lazy_page=True))]
    return [{"design": name, **{f"int{b}": cycle_bits(b, **kw) for b in widths}} for name, kw in designs]


def summarize(windows: list[dict], widths, modes) -> dict:
    """Means over windows, and each mode's paired difference to bf16 (attn_err, attn_err_page_end)."""
    out: dict = {}
    for group in ["tail"] + [f"int{b}" for b in widths]:
        for mode in windows[0][group]:
            got = {n: [w[group][mode][n] for w in windows] for n in windows[0][group][mode]}
            row = {n: sum(x) / len(x) for n, x in got.items()}
            if mode in modes and mode != "bf16":
                for n in ("attn_err", "attn_err_page_end"):
                    row[f"{n}_vs_bf16"] = paired(got[n], [w[group]["bf16"][n] for w in windows])
            out.setdefault(group, {})[mode] = row
    return out


def markdown(report: dict) -> str:
    meta, s, model = report["meta"], report["tensor_summary"], report["model"]
    lines = ["# FP8 e4m3 staging tail (study): cost in quality and bits", "",
             f"- date: {meta['date']}; machine: {meta['machine']}; commit: {meta['commit']}",
             f"- command: `{meta['command']}` ({meta['seconds']} s)",
             f"- model: {meta['model']}; tensor level on {meta['tensor_windows']} window(s) x {meta['context']} tokens "
             f"(decode situation: pages before the query's page low-bit, its page's earlier rows staged, itself bf16; "
             "every 4th query; 'page end' = queries with 127 staged rows); model level: "
             + (f"{meta['windows']} x {meta['context']} tokens, chunks of {meta['chunk']}, bf16 tail today."
                if model else "not run."),
             "- modes: bf16 = today; fp8 = e4m3 with per-(token, kv head) scale amax/448 rounded up to fp16; "
             "fp8-pow2 = power-of-two scale; fp8-raw = no scale; fp8-k / fp8-v = keys / values only in fp8; @attn / @quant (model level) = only the "
             "attention's / the page-fill quantizer's reads of staged rows rounded; lowbit = the tail quantized too (tensor_errors).",
             "- vs bf16: mean over windows of (mode - bf16) ± standard error over the windows (paired).",
             "- bits: decode bench shape (8 KV heads, head_dim 128, P = 128) at 16k: exact 16384, held 16424, page "
             "cycle 16384..16511; staged bits per value incl. the row scale.", "",
             "## The staged rows alone (pages exact)", "",
             "| mode | staged bits (D=128) | key err | value err | attn err | page-end attn err |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for mode, r in s["tail"].items():
        lines.append(f"| {mode} | {staged_bits(mode, 128):.4f} | {r['key_err']:.5f} | {r['value_err']:.5f} "
                     f"| {r['attn_err']:.6f} | {r['attn_err_page_end']:.6f} |")
    for width in meta["widths"]:
        lines += ["", f"## int{width}", "", "| mode | attn err | vs bf16 (± s.e.) | page-end attn err | vs bf16 "
                  "(± s.e.) | Δppl % | vs bf16 (± s.e.) | KL | vs bf16 (± s.e.) | bits exact | held | page cycle |",
                  "| --- " + "| ---: " * 12 + "|"]
        extra = [x["mode"] for x in model if x["width"] == width and x["mode"] not in s[f"int{width}"]]
        for mode in list(s[f"int{width}"]) + extra:
            r = s[f"int{width}"].get(mode)
            d = lambda n: ("" if f"{n}_vs_bf16" not in r else f"{r[f'{n}_vs_bf16'][0]:+.5f}" +  # noqa: E731
                           (f" ± {r[f'{n}_vs_bf16'][1]:.5f}" if meta["tensor_windows"] > 1 else " (1 window)"))
            m = next((x for x in model if x["width"] == width and x["mode"] == mode), None)
            mtext = "- | - | - | -"
            if m:
                base = next(x for x in model if x["width"] == width and x["mode"] == "bf16")
                dp, ep = paired(m["window_ppl_delta_pct"], base["window_ppl_delta_pct"])
                dk, ek = paired(m["window_kl"], base["window_kl"])
                mtext = (f"{m['ppl_delta_pct']:+.4f} | {'' if mode == 'bf16' else f'{dp:+.4f} ± {ep:.4f}'} | "
                         f"{m['kl']:.6f} | {'' if mode == 'bf16' else f'{dk:+.6f} ± {ek:.6f}'}")
            b = report["bits"][f"int{width}"].get(mode)
            btext = f"{b['exact']:.4f} | {b['held']:.4f} | {b['page_cycle']:.4f}" if b else "- | - | -"
            ttext = (f"{r['attn_err']:.5f} | {d('attn_err')} | {r['attn_err_page_end']:.5f} | {d('attn_err_page_end')}"
                     if r else "- | - | - | -")
            lines.append(f"| {mode} | {ttext} | {mtext} | {btext} |")
    lines += ["", "## Page-cycle bits at 16k (16384..16511 tokens) by staging design", "",
              "| design | " + " | ".join(f"int{w}" for w in meta["widths"]) + " |",
              "| --- " + "| ---: " * len(meta["widths"]) + "|"]
    for d in report["designs"]:
        lines.append(f"| {d['design']} | " + " | ".join(f"{d[f'int{w}']:.4f}" for w in meta["widths"]) + " |")
    if report.get("check"):
        c = report["check"]
        lines += ["", f"Check (int3, 1 x 512 tokens): the attention read {c['attention_rows']} staged rows, all "
                  f"FP8-rounded (first read's relative change {c['first_read_rel_change']:.4f}); the page-fill "
                  f"quantizer read {c['quantizer_rows']} rows from staging, rounded too."]
    return "\n".join(lines) + "\n"

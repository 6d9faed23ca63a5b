"""`bench_attention.py --lowbit-only`: every launch config of the selected low-bit implementations at each shape
and width, and the pick of each implementation's best config over the swept cases (lowbit-best.json, ready for
--lowbit-configs of a later --no-sweep run)."""

from __future__ import annotations

import json
import math
import os
import time

import torch

from benchmarks import attention_setup as setup
from benchmarks.attention_setup import SCALE, Timer, build_lowbit, lowbit_impls
from moekv.ops.reference import lowbit as lowbit_reference


def run_lowbit_sweep(args, log=print) -> dict:
    """--lowbit-only: every launch config of every selected low-bit implementation at each shape and width,
    nothing else (no SDPA, paged bf16, quantizer or diagnostics). Per config: first-call seconds (compile),
    max error / max |reference| at that shape, median ms, TB/s over the bytes read. Each implementation's
    best config over all swept cases (pick_configs) goes to <out>/lowbit-best.json, ready for
    --lowbit-configs of a later --no-sweep run."""
    timer = Timer(cold=not args.hot)
    gen = torch.Generator().manual_seed(0)
    impls = lowbit_impls(args.impls)
    shapes = setup.DRY_SHAPES[:1] if args.dry and not args.shapes else setup.SHAPES
    rows = []
    for batch, length in shapes:
        for bits in setup.BITS:
            lb_args, nbytes = build_lowbit(batch, length, bits, gen)
            want = lowbit_reference.paged_attention_lowbit(*lb_args, SCALE).float()
            log(f"[{time.perf_counter() - setup.T0:.0f}s] B={batch} L={length} int{bits}: {nbytes / 1e6:.1f} MB read, "
                f"{float(lb_args[3].outlier_count.float().mean()):.1f} key outliers per page-head")
            for name, (fn, configs) in impls.items():
                for cfg in configs:
                    key = f"{name} {json.dumps(cfg)}"
                    try:
                        start = time.perf_counter()
                        got = fn(*lb_args, SCALE, **cfg).float()
                        setup.synchronize()
                        first_s = time.perf_counter() - start
                        err = float((got - want).abs().max() / want.abs().max())
                        ms = timer(lambda fn=fn, cfg=cfg: fn(*lb_args, SCALE, **cfg))
                    except Exception as exc:  # noqa: BLE001 - a config that fails is reported, the sweep goes on
                        log(f"    {key}: failed ({type(exc).__name__}: {str(exc)[:160]})")
                        continue
                    ok = err <= 2e-2 and math.isfinite(err)
                    rows.append({"batch": batch, "context": length, "bits": bits, "impl": name, "config": cfg,
                                 "ms": ms, "tbps": nbytes / ms / 1e9, "max_rel_err": err, "first_call_s": first_s})
                    log(f"    [{time.perf_counter() - setup.T0:.0f}s] {key}: {ms:.4f} ms, {nbytes / ms / 1e9:.2f} TB/s, "
                        f"max err/max {err:.2e}{'' if ok else ' (OVER 2e-2)'}, first call {first_s:.1f} s")
            del lb_args
            if setup.DEVICE == "cuda":
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

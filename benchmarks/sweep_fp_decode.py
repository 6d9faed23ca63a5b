"""Launch-parameter sweep of the full-precision (bf16) paged decode kernel, as a CUDA-graph step launches it.

    PYTHONPATH=src:. python3 benchmarks/sweep_fp_decode.py --out benchmarks/results     # on the GPU
    PYTHONPATH=src:. python3 benchmarks/sweep_fp_decode.py --dry --out /tmp/sweep       # CPU: the plumbing, tiny

For every shape (B, L, kv heads; Hq=32, D=128, 16-token pages in shuffled order) it times
`ops.triton.attention.decode.paged_decode_full_precision` with `device_splits` (the graph path: a fixed split
count, splits sized on the device) over BLOCK_N x num_warps x num_stages x the split count planned for 2 / 4 / 8
waves x the split combine (a second launch, or inside the decode launch), next to the default launch (the
engine's: default_config, 2 waves, combine off) and torch SDPA on a contiguous cache, all in the same run.
Median of CUDA-graph replays, cold L2 (benchmarks.attention_setup.Timer). Every config's output is checked
against the default's. Writes fp-decode-sweep-<gpu>.{json,md}.
"""

from __future__ import annotations

import os
import sys

if "--dry" in sys.argv:                      # the Triton kernel on a CPU: the interpreter, tiny shapes
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import itertools
import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import attention_setup as setup
from benchmarks.attention_setup import Timer

SHAPES = [(1, 16384, 8), (1, 16384, 4), (1, 2048, 8), (8, 32768, 8), (64, 16384, 8)]
HQ, D, PAGE = 32, 128, 16
DEVICE = "cuda"


def build(batch: int, length: int, hkv: int, gen: torch.Generator):
    from moekv.core.attention_metadata import AttentionMetadata

    pages_per_seq = -(-length // PAGE)
    tables, num_pages = setup.shuffled_tables(batch, pages_per_seq, gen)
    k = torch.randn((num_pages, PAGE, hkv, D), device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn((num_pages, PAGE, hkv, D), device=DEVICE, dtype=torch.bfloat16)
    meta = AttentionMetadata.build([1] * batch, [length - 1] * batch, tables, PAGE, DEVICE)
    q = torch.randn((batch, HQ, D), device=DEVICE, dtype=torch.bfloat16)
    return q, k, v, meta, 2 * batch * length * hkv * D * 2


def sdpa_ms(timer: Timer, batch: int, length: int, hkv: int) -> float:
    k = torch.randn((batch, hkv, length, D), device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn((batch, hkv, HQ // hkv, D), device=DEVICE, dtype=torch.bfloat16)   # the group as rows
    return timer(lambda: F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5))


def main(argv=None) -> int:
    from moekv.ops.triton.attention.decode import default_config, paged_decode_full_precision
    from moekv.ops.triton.attention.split_k import plan_splits

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--shapes", default=";".join(f"{b}x{L}x{h}" for b, L, h in SHAPES), help="BxLxHkv;...")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--waves", default="2,4,8")
    parser.add_argument("--dry", action="store_true", help="CPU plumbing check: the interpreter, wall-clock times")
    args = parser.parse_args(argv)
    global DEVICE
    if args.dry:
        DEVICE = setup.DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("sweep_fp_decode needs a CUDA GPU (or --dry)", file=sys.stderr)
        return 2
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(";") if s]
    ints = lambda s: [int(x) for x in s.split(",") if x]                                  # noqa: E731
    timer = Timer(cold=True, reps=10, trials=7)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    scale = D ** -0.5
    rows = []
    for batch, length, hkv in shapes:
        q, k, v, meta, nbytes = build(batch, length, hkv, gen)
        base_cfg = default_config(D, torch.bfloat16)
        base_splits = plan_splits(batch, hkv, length, 64, q.device)[0]

        def run(cfg, splits, combine):
            return paged_decode_full_precision(q, k, v, meta.block_tables, meta.seq_lens, 0, scale, num_splits=splits,
                                               config=dict(cfg), device_splits=True, combine=combine)
        ref = run(base_cfg, base_splits, False).float()
        base_ms = timer(lambda: run(base_cfg, base_splits, False))
        sdpa = sdpa_ms(timer, batch, length, hkv)
        shape_rows = []
        for block_n, warps, stages, waves, combine in itertools.product(ints(args.block_n), ints(args.warps),
                                                                         ints(args.stages), ints(args.waves),
                                                                         (False, True)):
            splits = plan_splits(batch, hkv, length, block_n, q.device, min_tokens_per_split=64, waves=waves,
                                 max_splits=512)[0]
            if combine and splits == 1:
                continue
            cfg = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            try:
                err = (run(cfg, splits, combine).float() - ref).abs().max().item()
                ms = timer(lambda: run(cfg, splits, combine))
            except Exception as exc:                      # out of shared memory / registers: reported, not fatal
                shape_rows.append(dict(cfg, waves=waves, splits=splits, combine=combine, error=str(exc)[:120]))
                continue
            shape_rows.append(dict(cfg, waves=waves, splits=splits, combine=combine, ms=round(ms, 4),
                                   max_abs_diff=err))
        ok = [r for r in shape_rows if "ms" in r]
        best = min(ok, key=lambda r: r["ms"])
        row = dict(batch=batch, length=length, kv_heads=hkv, mbytes=round(nbytes / 1e6, 1), sdpa_ms=round(sdpa, 4),
                   default=dict(base_cfg, splits=base_splits, ms=round(base_ms, 4)), best=best,
                   configs=shape_rows)
        rows.append(row)
        print(f"B={batch} L={length} Hkv={hkv}: SDPA {sdpa:.4f} default {base_ms:.4f} ({nbytes / base_ms / 1e9:.2f} "
              f"TB/s) best {best['ms']:.4f} ({nbytes / best['ms'] / 1e9:.2f} TB/s) {best}", flush=True)
        top = sorted(ok, key=lambda r: r["ms"])[:8]
        for r in top:
            print("   ", r, flush=True)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    result = dict(gpu=gpu, date=datetime.datetime.now().isoformat(timespec="seconds"),
                  commit=os.environ.get("MOEKV_COMMIT", "unknown"),
                  command="python3 benchmarks/sweep_fp_decode.py " + " ".join(sys.argv[1:]), rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "fp-decode-sweep-" + re.sub(r"[^0-9A-Za-z]+", "_", gpu).strip("_")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# bf16 paged decode kernel: launch sweep ({gpu})", "",
             f"{result['date']}, commit {result['commit']}. Command: `{result['command']}`", "",
             "Median of CUDA-graph replays, cold L2, Hq=32 D=128, 16-token pages (shuffled), device-sized splits "
             "(the graph path). default = the engine's launch (default_config, 2 waves, combine off).", "",
             "| B | L | Hkv | MB | SDPA ms | default ms | TB/s | best ms | TB/s | best / default | best config |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, d = r["best"], r["default"]
        mb = r["mbytes"] * 1e6
        lines.append(f"| {r['batch']} | {r['length']} | {r['kv_heads']} | {r['mbytes']} | {r['sdpa_ms']} | {d['ms']} | "
                     f"{mb / d['ms'] / 1e9:.2f} | {b['ms']} | {mb / b['ms'] / 1e9:.2f} | {b['ms'] / d['ms']:.3f} | "
                     f"BLOCK_N {b['BLOCK_N']}, {b['num_warps']} warps, {b['num_stages']} stages, {b['splits']} splits "
                     f"({b['waves']} waves), combine {'in launch' if b['combine'] else 'second launch'} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if math.isfinite(sum(r["best"]["ms"] for r in rows)) else 1


if __name__ == "__main__":
    raise SystemExit(main())

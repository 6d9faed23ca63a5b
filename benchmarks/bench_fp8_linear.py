"""fp8_linear's two variants at decode sizes: "dot" (tl.dot tiles, the default) vs "fma" (the GEMV,
ops.triton.layer.fp8_gemv) on Mixtral-8x7B's attention projections, qkv [6144, 4096] and o [4096, 4096], FP8
e4m3 weights with per-output-channel scales (`--quantization fp8`; --block 128: 128 x 128 checkpoint blocks),
x bf16; bf16 F.linear (cuBLAS) on the same shapes for scale. At M = 1 by default (--rows 1,2,4).

    PYTHONPATH=src:. python benchmarks/bench_fp8_linear.py --sweep --out $OUT     # GPU, < 1 minute
    PYTHONPATH=src:. python benchmarks/bench_fp8_linear.py --dry                  # CPU: code paths, interpreter

--sweep also times SWEEP_FMA (28 fma tiles). Timing: median of CUDA-graph replays (bench_gemv.graph_ms), each
call on a different weight copy, cycling over >= 512 MB of copies so the weights come from HBM, not L2.
TB/s = (codes + scales + x + out bytes) / time; "% read": over the measured read bandwidth (benchmarks.timing).
Every output is checked against ops.reference.fp8_linear (max error / max |ref|). Writes
fp8-linear-fma-<gpu>.{json,md}; asserts nothing about speed. What flips the default: an "fma" row faster than
"dot" on both shapes -> layer.fp8_linear.default_config returns {"VARIANT": "fma", ...those tiles} at 1 row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

if "--dry" in sys.argv:                      # the Triton kernels on a CPU: the interpreter, tiny shapes
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.bench_gemv import MIN_STREAM_BYTES, cpu_ms, environment, graph_ms, write_json  # noqa: E402
from moekv.core.fp8 import k_tile_cap, quantize_fp8  # noqa: E402
from moekv.ops.reference.fp8_linear import fp8_linear as reference  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096)}                   # name -> (K, N)
DRY_SHAPES = {"qkv": (256, 96), "o": (256, 64)}
# one warp loads 512 codes of a row per step (16 per lane): BLOCK_K = 512 x warps keeps x's layout the codes'
SWEEP_FMA = ([dict(BLOCK_N=bn, BLOCK_K=512 * w, num_warps=w, SPLIT_K=sk, UNROLL=1)
              for bn, w, sk in itertools.product((1, 2, 4, 8), (2, 4, 8), (1, 2))]
             + [dict(BLOCK_N=bn, BLOCK_K=512 * w, num_warps=w, SPLIT_K=1, UNROLL=2)
                for bn, w in itertools.product((2, 4), (2, 4))])
DRY_SWEEP = [dict(BLOCK_N=4, BLOCK_K=64, num_warps=1, SPLIT_K=2, UNROLL=2)]


def bench_shape(name: str, K: int, N: int, rows: list[int], block, device: torch.device, read_tbps, sweep) -> list:
    from moekv.ops.triton.layer import fp8_gemv
    from moekv.ops.triton.layer import fp8_linear as fl

    gen = torch.Generator(device=device).manual_seed(0)
    master = torch.empty((N, K), device=device).normal_(0.0, 0.02, generator=gen)
    one = quantize_fp8(master, block)
    weight_bytes = one.codes.numel() + one.scale.numel() * 4
    copies = 1 if device.type != "cuda" else max(2, min(64, -(-MIN_STREAM_BYTES // weight_bytes)))
    weights = [quantize_fp8(master + 0.0 * i, block) for i in range(copies)]
    dense = [master.bfloat16() for _ in range(max(2, copies // 2) if device.type == "cuda" else 1)]
    timer = graph_ms if device.type == "cuda" else cpu_ms
    sweep_cfgs = (SWEEP_FMA if device.type == "cuda" else DRY_SWEEP) if sweep else []
    out_rows = []
    for M in rows:
        x = torch.empty((M, K), device=device).normal_(0.0, 1.0, generator=gen).bfloat16()
        ref = reference(x, weights[0])
        fma_default = fp8_gemv.default_config(N, K, k_tile_cap(one), device)
        impls = [("bf16 F.linear", None), ("dot (default)", {"VARIANT": "dot"}),
                 ("fma (default tiles)", {"VARIANT": "fma"})]
        impls += [("fma sweep", {"VARIANT": "fma", **cfg}) for cfg in sweep_cfgs]
        for impl, cfg in impls:
            if cfg is None:
                make = lambda w: (lambda: F.linear(x, w))                                     # noqa: E731
                pool, moved = dense, N * K * 2 + (M * K + M * N) * 2
            else:
                make = lambda w, c=cfg: (lambda: fl.fp8_linear(x, w, None, config=c))        # noqa: E731
                pool, moved = weights, weight_bytes + (M * K + M * N) * 2
            try:
                out = make(pool[0])()
                ms = timer([make(w) for w in pool])
            except Exception as exc:                                                      # noqa: BLE001
                print(f"  {name:4s} M={M} {impl} {json.dumps(cfg)} failed: {type(exc).__name__}: {str(exc)[:160]}",
                      file=sys.stderr)
                continue
            variant, used = ("cublas", None) if cfg is None else fl.resolve_config(x, weights[0], cfg)
            if variant == "fma":
                used = {**fma_default, **used}
            error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
            row = {"shape": name, "K": K, "N": N, "M": M, "impl": impl, "variant": variant, "config": used,
                   "ms": ms, "bytes": moved, "tbps": moved / ms / 1e9,
                   "pct_read": None if read_tbps is None else 100 * moved / ms / 1e9 / read_tbps, "max_rel_err": error}
            out_rows.append(row)
            if impl != "fma sweep":
                print(f"  {name:4s} M={M} {impl:20s} {ms:8.4f} ms {row['tbps']:6.3f} TB/s err {error:.1e}", flush=True)
    return out_rows


def write_results(out_dir: Path, result: dict) -> tuple[Path, Path]:
    env = result["env"]
    json_path, md_path = write_json(out_dir, "fp8-linear-fma", result)
    read = result["read_bandwidth_tbps"]
    lines = [f"# fp8_linear \"dot\" vs \"fma\" (GEMV) on Mixtral-8x7B's qkv / o, FP8 {result['scales']} scales, x bf16",
             "", f"GPU {env['gpu']}, {env['date']}, commit {env['commit']}, torch {env['torch']}, triton {env['triton']}",
             f"Command: `{env['command']}`", "",
             f"Measured read bandwidth {read:.2f} TB/s (torch.sum, cold L2)." if read else
             "No GPU: timings are the CPU interpreter's (meaningless as speed; this run checks the code paths).", "",
             "| shape | N x K | M | implementation | ms | TB/s | % read | max rel err | config |",
             "|---|---|---|---|---|---|---|---|---|"]
    best: dict = {}
    for r in result["rows"]:
        key = (r["shape"], r["M"], r["variant"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
        if r["impl"] == "fma sweep":
            continue
        pct = "-" if r["pct_read"] is None else f"{r['pct_read']:.1f}%"
        cfg = "" if r["config"] is None else f"`{json.dumps(r['config'])}`"
        lines.append(f"| {r['shape']} | {r['N']} x {r['K']} | {r['M']} | {r['impl']} | {r['ms']:.4f} | {r['tbps']:.3f} "
                     f"| {pct} | {r['max_rel_err']:.1e} | {cfg} |")
    lines += ["", "## Best per variant (defaults and sweep)", "",
              "| shape | M | variant | ms | TB/s | vs dot | config |", "|---|---|---|---|---|---|---|"]
    for (shape, M, variant), r in sorted(best.items()):
        dot = best.get((shape, M, "dot"))
        ratio = "-" if dot is None else f"{dot['ms'] / r['ms']:.2f}x"
        cfg = "" if r["config"] is None else f"`{json.dumps(r['config'])}`"
        lines.append(f"| {shape} | {M} | {variant} | {r['ms']:.4f} | {r['tbps']:.3f} | {ratio} | {cfg} |")
    lines += ["", "All timed configs are in the JSON."]
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1", help="comma-separated M, each 1-4 (the fma variant's range)")
    parser.add_argument("--block", type=int, default=0, help="scale block width (128: [128, 128] blocks; 0: per channel)")
    parser.add_argument("--sweep", action="store_true", help="also time SWEEP_FMA's tiles")
    parser.add_argument("--out", type=Path, help="result folder (default benchmarks/results; --dry: a temp dir)")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = parser.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    assert all(1 <= m <= 4 for m in rows), rows
    block = (args.block, args.block) if args.block else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.dry:
        parser.error("no CUDA device: use --dry to check the code paths on the CPU")
    env = environment(["benchmarks/bench_fp8_linear.py", *argv], device, args.dry)
    if device.type == "cuda":
        from benchmarks.timing import read_bandwidth
        read_tbps = read_bandwidth(device)
    else:
        read_tbps = None
    print(f"{env['gpu']}: read {read_tbps or float('nan'):.2f} TB/s", flush=True)
    result_rows = []
    for name, (K, N) in (DRY_SHAPES if args.dry else SHAPES).items():
        result_rows += bench_shape(name, K, N, rows, block, device, read_tbps, args.sweep)
    result = {"env": env, "scales": f"{args.block} x {args.block} block" if block else "per-channel",
              "read_bandwidth_tbps": read_tbps, "rows": result_rows}
    out = args.out or (Path(tempfile.mkdtemp()) if args.dry else Path("benchmarks/results"))
    print("wrote", *write_results(out, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

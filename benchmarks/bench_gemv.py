"""Decode-size dense projections: moekv's skinny GEMM (ops.triton.layer.skinny_gemm) vs torch F.linear (cuBLAS)
on Mixtral-8x7B's shapes, x [M, K] @ W[N, K]^T in bf16 for M = 1, 2, 4, 8, 16 (and 32, 64: `--rows`).

    MOEKV_COMMIT=<sha> PYTHONPATH=src:. python benchmarks/bench_gemv.py --out /root/out/gemv
    PYTHONPATH=src:. python benchmarks/bench_gemv.py --sweep --rows 1,16     # + launch-config sweep
    PYTHONPATH=src:. python benchmarks/bench_gemv.py --sweep --rows 32,64 --shapes qkv,o   # decode batches
    PYTHONPATH=src:. python benchmarks/bench_gemv.py --dry     # CPU: the code paths under the interpreter
    PYTHONPATH=src:. python benchmarks/bench_gemv.py --static  # CPU: sm_90 compile of the launches

Timing (CUDA): median of CUDA-graph replays (benchmarks/timing.py); each captured call reads a
different copy of the weight, cycling over enough copies (>= 512 MB together) that the weights come
from HBM, not L2, as in a model whose layers each read their own weights once per step (the small x
stays in L2, as activations do). Achieved TB/s = (weight + x + out + bias bytes) / time; "% read" is
that over the measured read bandwidth (torch.sum over 2 GiB, cold L2: bytes read / time), "copy" the measured
device-to-device copy ((read + write) / time, as bench_moe.py reports it). Every output is checked
against the fp32 reference (max error / max |ref|) and compared with F.linear (fraction bit-equal).
"Mixtral B=1" sums the per-token cost of the hooked projections (32 x (qkv + o)) and the lm_head.
Writes gemv-bench-<gpu>.{json,md}; asserts nothing about speed.

--static (no GPU needed): compiles each kernel launch of the default configs for sm_90 exactly as a
launch on an H200 would specialise it (tools/sass_stats.py) and prints registers, spills, shared
memory, programs per SM and the weight-load instructions (128-bit or not). Run it with the Triton
version of the GPU machine (e.g. /tmp/v36/bin/python for triton 3.6).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if "--dry" in sys.argv:                      # the Triton kernels on a CPU: the interpreter, tiny shapes
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moekv.ops.reference.skinny_gemm import skinny_gemm as reference  # noqa: E402
from moekv.provenance import git_commit  # noqa: E402

# name -> (K, N, per Mixtral-8x7B decode step: how many; hooked through layers.linear.Linear)
MIXTRAL = {
    "qkv": (4096, 6144, 32, True),           # 32 q heads + 2 x 8 kv heads of 128
    "o": (4096, 4096, 32, True),
    "lm_head": (4096, 32000, 1, False),      # models/moe_decoder.py calls F.linear itself
    "gate_up": (4096, 14336, 0, False),      # one expert's w1 / w3 (a dense MLP of that size would be hooked)
    "down": (14336, 4096, 0, False),         # long K, N of the o projection
    "router": (4096, 8, 32, False),          # layers/router.py calls F.linear itself; split-K territory
}
DRY = {"qkv": (64, 96, 32, True), "o": (64, 64, 32, True), "lm_head": (64, 200, 1, False),
       "gate_up": (64, 112, 0, False), "down": (112, 64, 0, False), "router": (64, 8, 32, False)}
MIN_STREAM_BYTES = 512 * 2**20

# --sweep: launch configs tried on top of the defaults (dot: any M; fma: M == 1)
SWEEP_DOT = [dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=4, SPLIT_K=sp)
             for bn, bk, st, sp in itertools.product((16, 32), (128, 256), (3, 4, 5), (1, 2))]
SWEEP_DOT_WIDE = [dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=w, SPLIT_K=sp)       # M > 16
                  for bn, bk, st, w, sp in itertools.product((64, 128), (64, 128), (2, 3), (4, 8), (1, 2, 4))]
SWEEP_FMA = [dict(BLOCK_N=bn, BLOCK_K=256 * w, num_warps=w, UNROLL=u, SPLIT_K=1, num_stages=1)
             for bn, w, u in itertools.product((2, 4, 8), (2, 4, 8), (1, 2, 4))]


# ---------------------------------------------------------------- timing
def graph_ms(calls: list, reps: int = 20, trials: int = 7) -> float:
    """Median ms of one call, cycling over `calls` (each a different weight copy) in a CUDA graph of
    about `reps` calls (a whole number of cycles)."""
    from benchmarks.timing import cuda_graph_ms

    cycle = itertools.cycle(calls)
    per_graph = max(reps // len(calls), 1) * len(calls)
    return cuda_graph_ms(lambda: next(cycle)(), per_graph, trials)


def cpu_ms(calls: list) -> float:
    calls[0]()
    start = time.perf_counter()
    calls[0]()
    return (time.perf_counter() - start) * 1e3


def read_bandwidth(device: torch.device) -> tuple[float | None, float | None]:
    """(read TB/s of torch.sum over 2 GiB, cold L2: benchmarks.timing.read_bandwidth, copy TB/s as
    (read + write) / time); None on a CPU."""
    from benchmarks import timing

    if device.type != "cuda":
        return None, None
    read = timing.read_bandwidth(device)
    src = torch.empty(2**30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy = 2 * 2 * 2**30 / graph_ms([lambda: dst.copy_(src)], reps=5) / 1e9
    del src, dst
    return read, copy


# ---------------------------------------------------------------- one shape
def bench_shape(name: str, K: int, N: int, rows: list[int], dtype: torch.dtype, device: torch.device,
                read_tbps: float | None, sweep: bool) -> list[dict]:
    from moekv.ops.triton.layer import skinny_gemm as sk

    gen = torch.Generator(device=device).manual_seed(0)
    weight_bytes = N * K * dtype.itemsize
    copies = 1 if device.type != "cuda" else max(2, min(64, -(-MIN_STREAM_BYTES // weight_bytes)))
    weights = [torch.empty((N, K), dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen) for _ in range(copies)]
    timer = graph_ms if device.type == "cuda" else cpu_ms
    out_rows = []
    for M in rows:
        x = torch.empty((M, K), dtype=dtype, device=device).normal_(0.0, 1.0, generator=gen)
        ref = reference(x, weights[0])
        cublas = F.linear(x, weights[0])
        moved = weight_bytes + (M * K + M * N) * dtype.itemsize
        impls = [("torch", None, None), ("skinny-dot", "dot", None)]
        if M == 1:
            impls.append(("skinny-fma", "fma", None))
        if sweep:
            impls += [("sweep-dot", "dot", cfg) for cfg in (SWEEP_DOT if M <= sk.ONE_BINARY_ROWS else SWEEP_DOT_WIDE)]
            impls += [("sweep-fma", "fma", cfg) for cfg in SWEEP_FMA] if M == 1 else []
        base_ms = None
        for impl, variant, cfg in impls:
            if impl == "torch":
                make = lambda w: (lambda: F.linear(x, w))                                   # noqa: E731
            else:
                make = lambda w, v=variant, c=cfg: (lambda: sk.skinny_gemm(x, w, None, config=c, variant=v))  # noqa: E731
            try:
                out = make(weights[0])()
                ms = timer([make(w) for w in weights])
            except Exception as exc:                                                    # noqa: BLE001
                print(f"  {name:8s} M={M:2d} {impl:11s} {json.dumps(cfg)} failed: {type(exc).__name__}: "
                      f"{str(exc)[:120]}", file=sys.stderr)
                continue
            base_ms = ms if impl == "torch" else base_ms
            used = cfg if cfg is not None else (sk.default_config(M, N, K, device, variant) if variant else None)
            error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
            row = {"shape": name, "K": K, "N": N, "M": M, "impl": impl, "config": used, "ms": ms,
                   "bytes": moved, "tbps": moved / ms / 1e9, "pct_read": None if read_tbps is None else
                   100 * moved / ms / 1e9 / read_tbps, "speedup_vs_torch": None if base_ms is None else base_ms / ms,
                   "max_rel_err": error, "bit_equal_vs_torch": (out == cublas).float().mean().item()}
            out_rows.append(row)
            if not impl.startswith("sweep"):
                print(f"  {name:8s} M={M:2d} {impl:11s} {ms:9.4f} ms  {row['tbps']:6.3f} TB/s  "
                      f"x{row['speedup_vs_torch'] or 0:5.2f} vs torch  err {error:.1e}  "
                      f"bit-equal {row['bit_equal_vs_torch']:.3f}", flush=True)
    return out_rows


# ---------------------------------------------------------------- outputs
def environment(argv: list[str], device: torch.device, dry: bool) -> dict:
    import triton
    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry, interpreter)",
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit() or "unknown",
            "torch": torch.__version__, "triton": triton.__version__,
            "command": "PYTHONPATH=src:. python " + " ".join(argv), "dry": dry}


def best_rows(rows: list[dict]) -> dict:
    """(shape, M) -> {"torch": row, "default": best of the default-config variants, "best": best skinny}."""
    table: dict = {}
    for r in rows:
        entry = table.setdefault((r["shape"], r["M"]), {})
        kind = "torch" if r["impl"] == "torch" else "default" if not r["impl"].startswith("sweep") else None
        for key in ([kind] if kind else []) + (["best"] if r["impl"] != "torch" else []):
            if key not in entry or r["ms"] < entry[key]["ms"]:
                entry[key] = r
    return table


def per_token(rows: list[dict], shapes: dict) -> list[dict]:
    """Mixtral B=1 (M=1) decode step: ms of sum(count x shape) for the hooked shapes and the lm_head."""
    table = best_rows(rows)
    out = []
    for label, names in (("hooked (32 x (qkv + o))", [n for n, s in shapes.items() if s[3]]),
                         ("+ lm_head", [n for n, s in shapes.items() if s[3] or n == "lm_head"])):
        sums = {}
        for key in ("torch", "default", "best"):
            try:
                sums[key] = sum(shapes[n][2] * table[(n, 1)][key]["ms"] for n in names)
            except KeyError:
                sums[key] = None
        out.append({"what": label, **sums})
    return out


def write_json(out_dir: Path, stem: str, result: dict) -> tuple[Path, Path]:
    """Writes out_dir/<stem>-<gpu>.json; returns it and the markdown path beside it."""
    gpu = result["env"]["gpu"].split(" (")[0].replace(" ", "_")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}-{gpu}.json", out_dir / f"{stem}-{gpu}.md"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    return json_path, md_path


def write_results(out_dir: Path, result: dict) -> tuple[Path, Path]:
    env = result["env"]
    json_path, md_path = write_json(out_dir, "gemv-bench", result)
    read, copy = result["read_bandwidth_tbps"], result["copy_bandwidth_tbps"]
    lines = ["# Skinny GEMM (decode projections) vs torch F.linear: Mixtral-8x7B shapes, " + result["dtype"], "",
             f"GPU {env['gpu']}, {env['date']}, commit {env['commit']}, torch {env['torch']}, triton {env['triton']}",
             f"Command: `{env['command']}`", "",
             f"Measured read bandwidth {read:.2f} TB/s (torch.sum), copy {copy:.2f} TB/s ((read + write) / time)."
             if read else "No GPU: timings are the CPU interpreter's (meaningless as speed; this run checks the "
             "code paths).", "",
             "| shape | K | N | M | implementation | ms | TB/s | % read | vs torch | max rel err "
             "| bit-equal vs torch | config |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["impl"].startswith("sweep"):
            continue
        pct = "-" if r["pct_read"] is None else f"{r['pct_read']:.1f}%"
        speed = "-" if r["speedup_vs_torch"] is None else f"{r['speedup_vs_torch']:.2f}x"
        cfg = "" if r["config"] is None else f"`{json.dumps(r['config'])}`"
        lines.append(f"| {r['shape']} | {r['K']} | {r['N']} | {r['M']} | {r['impl']} | {r['ms']:.4f} | {r['tbps']:.3f} "
                     f"| {pct} | {speed} | {r['max_rel_err']:.1e} | {r['bit_equal_vs_torch']:.3f} | {cfg} |")
    if any(r["impl"].startswith("sweep") for r in result["rows"]):
        lines += ["", "## Best launch config per shape and M (sweep)", "",
                  "| shape | M | torch ms | default ms | best ms | best TB/s | best vs torch | best config |",
                  "|---|---|---|---|---|---|---|---|"]
        for (shape, M), e in best_rows(result["rows"]).items():
            if "best" not in e or "torch" not in e:
                continue
            default_ms = e.get("default", {}).get("ms", float("nan"))
            lines.append(f"| {shape} | {M} | {e['torch']['ms']:.4f} | {default_ms:.4f} "
                         f"| {e['best']['ms']:.4f} | {e['best']['tbps']:.3f} | {e['torch']['ms'] / e['best']['ms']:.2f}x "
                         f"| {e['best']['impl']} `{json.dumps(e['best']['config'])}` |")
    lines += ["", "## Mixtral-8x7B B=1: per-token ms of these projections", "",
              "| projections | torch | skinny (better default variant) | skinny (best swept) |", "|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.4f}"                                   # noqa: E731
    for p in result["per_token"]:
        lines.append(f"| {p['what']} | {fmt(p['torch'])} | {fmt(p['default'])} | {fmt(p['best'])} |")
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


# ---------------------------------------------------------------- --static: sm_90 compile of the launches
def static_report(shapes: dict, rows: list[int], dtype: torch.dtype) -> list[str]:
    from tools.sass_stats import (capture_launch, compile_launch, histogram, programs_per_sm, resource_usage,
                                  sass)
    from moekv.ops.triton.layer import skinny_gemm as sk

    gpu_modes = {"rounding_modes": lambda d, dev: (d == torch.float32, False)}     # as on CUDA
    lines = ["| shape | M | variant | grid | config | regs | spill B | shared B | programs/SM | "
             "global loads 128-bit / narrower (SASS) | HMMA | FFMA |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    seen = set()
    for name, (K, N, _, _) in shapes.items():
        for M in rows:
            for variant in (("dot", "fma") if M == 1 else ("dot",)):
                x = torch.empty((M, K), dtype=dtype)
                w = torch.empty((N, K), dtype=dtype)
                kernel_name = "_skinny_fma_kernel" if variant == "fma" else "_skinny_dot_kernel"
                with capture_launch(sk, kernel_name, patch=gpu_modes) as launches, \
                        capture_launch(sk, "_splitk_reduce_kernel") as reduces:
                    sk.skinny_gemm(x, w, None, variant=variant)
                grid, args, kwargs = launches[0]
                key = (name, variant, json.dumps(kwargs, sort_keys=True), grid)
                if key in seen:                     # M <= 16 share the dot binary and grid
                    continue
                seen.add(key)
                kernel = compile_launch(getattr(sk, kernel_name), args, kwargs)
                usage = resource_usage(kernel)
                counts = histogram(sass(kernel))
                text = sass(kernel)
                wide = sum(1 for line in text.splitlines() if ("LDG" in line) and ".128" in line)
                narrow = sum(1 for line in text.splitlines() if ("LDG" in line) and ".128" not in line
                             and "LDGDEPBAR" not in line)
                shared = kernel.metadata.shared + usage.get("SHARED", 0)
                per_sm = programs_per_sm(usage["REG"], shared, kwargs["num_warps"])
                cfg = {k: v for k, v in kwargs.items() if k in ("BLOCK_N", "BLOCK_K", "UNROLL", "num_warps", "num_stages")}
                label = M if variant == "fma" or M > sk.ONE_BINARY_ROWS else "1-16"
                lines.append(f"| {name} | {label} | {variant} | {grid}"
                             f"{' + reduce' if reduces else ''} | `{json.dumps(cfg)}` | {usage['REG']} | "
                             f"{usage.get('LOCAL', 0) + usage.get('STACK', 0)} | {shared} | {per_sm} | {wide} / {narrow} | "
                             f"{counts['HMMA']} | {counts['FFMA']} |")
                print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma-separated M (rows of x), each <= 64")
    parser.add_argument("--shapes", default=",".join(MIXTRAL), help="comma-separated subset of " + ",".join(MIXTRAL))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    parser.add_argument("--out", type=Path, help="result folder (default benchmarks/results; --dry: a temp dir)")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    parser.add_argument("--static", action="store_true", help="compile the launches for sm_90 and print their stats")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = [int(m) for m in args.rows.split(",")]
    if not all(1 <= m <= 64 for m in rows):
        parser.error(f"--rows: each M in 1..64, got {rows}")
    table = DRY if args.dry else MIXTRAL
    shapes = {n: table[n] for n in args.shapes.split(",")}
    if args.static:
        print("\n".join(["Static sm_90 compile of the default launches (Mixtral shapes, " + args.dtype + ")", ""]))
        static_report({n: MIXTRAL[n] for n in shapes}, rows, dtype)
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.dry:
        parser.error("no CUDA device: use --dry to check the code paths on the CPU (or --static)")
    env = environment(["benchmarks/bench_gemv.py", *argv], device, args.dry)
    read_tbps, copy_tbps = read_bandwidth(device)
    print(f"{env['gpu']}: read {read_tbps or float('nan'):.2f} TB/s, copy {copy_tbps or float('nan'):.2f} TB/s")
    result_rows = []
    for name, (K, N, _, _) in shapes.items():
        result_rows += bench_shape(name, K, N, rows, dtype, device, read_tbps, args.sweep)
    result = {"env": env, "dtype": args.dtype, "shapes": {n: {"K": s[0], "N": s[1], "per_step": s[2], "hooked": s[3]}
                                                          for n, s in shapes.items()},
              "read_bandwidth_tbps": read_tbps, "copy_bandwidth_tbps": copy_tbps, "rows": result_rows,
              "per_token": per_token(result_rows, shapes)}
    for p in result["per_token"]:
        print(f"Mixtral B=1, {p['what']}: torch {p['torch']}, skinny default {p['default']}, best {p['best']} ms")
    out = args.out or (Path(tempfile.mkdtemp()) if args.dry else Path("benchmarks/results"))
    print("wrote", *write_results(out, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Kernels of one replayed decode step (CUDA graph), each timed alone by Nsight Compute.

bench_decode's --layer-profile runs eager steps, and an eager low-bit step takes the cache's general path, not the
graph path that serving runs (docs/attention-kernels.md, "Next (v12)" item 4). This tool times the graph path:

    python3 tools/graph_step_kernels.py --kv bf16,int3 --batch 1 --context 16384 --num-layers 2 --out DIR

For each KV dtype it starts a child under `ncu --profile-from-start off --graph-profiling node` (every kernel node
of a replayed graph is profiled as its own kernel, caches and clocks left alone), the child builds the random
Mixtral-shaped model with `--num-layers` layers, admits `--batch` sequences over synthetic pages
(benchmarks/synthetic_kv.py), runs warm-up steps (the graphs are captured there), then opens the profiler range for
`--steps` steps. The parent reads ncu's CSV and writes, per dtype: every kernel's launches and GPU us per step and per
layer. ncu serializes kernels: the sums are each kernel's time alone, not the replay's time (no overlap, no gaps).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from benchmarks.layer_profile import kernel_class, short_name  # noqa: E402


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu --csv --print-units base rows -> [{name, us}] in launch order (gpu__time_duration.sum in ns)."""
    start = text.find('"ID"')
    if start < 0:
        return []
    rows = []
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1e-3)
        rows.append({"name": row["Kernel Name"], "us": value * scale})
    return rows


def summarise(kernels: list[dict], steps: int, layers: int) -> dict:
    table: dict[str, dict] = {}
    for k in kernels:
        name = short_name(k["name"])
        entry = table.setdefault(name, {"name": name, "class": kernel_class(k["name"]), "launches": 0, "us": 0.0})
        entry["launches"] += 1
        entry["us"] += k["us"]
    rows = [{**e, "launches_per_step": e["launches"] / steps, "us_per_step": e["us"] / steps,
             "us_per_launch": e["us"] / e["launches"]} for e in table.values()]
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    by_class = {c: sum(r["us_per_step"] for r in rows if r["class"] == c) for c in ("GEMM", "attention", "small")}
    return {"kernels": rows, "us_per_step": total, "us_per_step_by_class": by_class,
            "launches_per_step": sum(r["launches_per_step"] for r in rows), "layers": layers, "steps": steps}


def child(args) -> int:
    import torch

    from benchmarks.decode_moekv import make_engine
    from benchmarks.synthetic_kv import admit_with_context, fill_kv_synthetic
    from moekv.models.loader import build_random_model
    from moekv.models.registry import named_arch

    device = torch.device("cuda")
    arch = named_arch(args.model, num_layers=args.num_layers)
    quantization = None if args.quantization == "none" else args.quantization
    model = build_random_model(arch, dtype=torch.bfloat16, device=device, seed=0, quantization=quantization)
    new_tokens = args.warmup + args.steps + 8
    engine_args = argparse.Namespace(page_size=None, prefill_chunk=max(args.batch, 256), model=args.model)
    engine = make_engine(model, args.batch, args.context, args.kv, new_tokens, engine_args, graphs=True)
    admit_with_context(engine, args.batch, args.context, new_tokens, arch.vocab_size, seed=0)
    fill_kv_synthetic(engine.kv_cache)
    for _ in range(args.warmup):
        engine.step()
    torch.cuda.synchronize()
    if engine.runner.graph_mode != "cuda":
        print(f"no CUDA graphs: {engine.runner.graph_fallback_reason}", file=sys.stderr)
        return 2
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


def markdown(result: dict) -> str:
    lines = [f"# Kernels of one replayed decode step: {result['model']} shape, "
             f"{result.get('quantization', 'none')} weights, {result['num_layers']} layers, "
             f"B={result['batch']}, L={result['context']}", "",
             f"GPU {result['gpu']}, {result['date']}, commit {result['commit']}. Command: `{result['command']}`", "",
             "Each kernel timed alone by ncu (`--graph-profiling node --cache-control none --clock-control none`): "
             "sums of isolated kernel times, not a replay's wall time.", ""]
    for kv, s in result["runs"].items():
        if "error" in s:
            lines += [f"## {kv}: failed", "", f"```\n{s['error']}\n```", ""]
            continue
        c = s["us_per_step_by_class"]
        lines += [f"## {kv} KV: {s['us_per_step']:.1f} us of kernels per step ({s['launches_per_step']:.0f} launches; "
                  f"GEMM {c['GEMM']:.1f}, attention {c['attention']:.1f}, small {c['small']:.1f})", "",
                  "| kernel | class | launches / step | us / step | us / layer | us / launch |", "|---|---|---|---|---|---|"]
        lines += [f"| `{r['name']}` | {r['class']} | {r['launches_per_step']:.0f} | {r['us_per_step']:.2f} | "
                  f"{r['us_per_step'] / s['layers']:.2f} | {r['us_per_launch']:.2f} |" for r in s["kernels"]]
        lines.append("")
    return "\n".join(lines)


def parent(args) -> int:
    import datetime
    import os

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "quantization": args.quantization, "num_layers": args.num_layers, "batch": args.batch, "context": args.context,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
              "date": datetime.date.today().isoformat(), "commit": os.environ.get("MOEKV_COMMIT", "unknown"),
              "command": "python3 tools/graph_step_kernels.py " + " ".join(sys.argv[1:]), "runs": {}}
    for kv in args.kv.split(","):
        log = args.out / f"ncu-{kv}.csv"
        cmd = [args.ncu, "--profile-from-start", "off", "--graph-profiling", "node", "--cache-control", "none",
               "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv", "--print-units", "base",
               "--log-file", str(log), sys.executable, __file__, "--child", "--kv", kv, "--batch", str(args.batch),
               "--context", str(args.context), "--num-layers", str(args.num_layers), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--model", args.model,
               "--quantization", args.quantization]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        text = log.read_text() if log.exists() else ""
        kernels = parse_ncu_csv(text)
        if proc.returncode != 0 or not kernels:
            result["runs"][kv] = {"error": (proc.stderr or proc.stdout)[-3000:]}
            continue
        result["runs"][kv] = summarise(kernels, args.steps, args.num_layers)
    (args.out / "graph-step-kernels.json").write_text(json.dumps(result, indent=1))
    (args.out / "graph-step-kernels.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--kv", default="bf16,int3")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--quantization", default="none", choices=("none", "fp8"), help="model weights (fp8: per channel)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--ncu", default="ncu")
    parser.add_argument("--out", type=Path, default=Path("graph-step-kernels"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())

"""A/B of the v7 low-bit decode kernel on the GPU: a baseline copy of `ops/cuda/lowbit_decode.py` + its `csrc/`
(folder --a-dir, made on the CPU machine by `python3 tools/ab_baseline.py <rev> ab/A [--replace OLD NEW]`, which
also gives it its own extension name) against this checkout's
kernel; both built side by side, timed on the same data (median of CUDA-graph replays, cold L2; Hq=32, Hkv=8,
D=128, the cache's default format), written as attention-ab-<tag>.{json,md} under --out.

    PYTHONPATH=src:. python3 benchmarks/ab_decode_kernel.py --a-dir ab/A --tag tail --out <dir>
    ... --b-kwargs '{"work_split": true}'     # this checkout's kernel launched with these arguments
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import importlib.util
import json
import os
import pathlib
import sys

import torch

SHAPES = [(1, 2048, (3, 4)), (1, 16384, (3, 4)), (1, 131072, (3, 4)), (8, 32768, (3,)), (32, 16384, (2, 3, 4)),
          (128, 16384, (3,))]


def parse_shapes(text: str) -> list[tuple[int, int, tuple[int, ...]]]:
    """'1x16392:3;32x16448:3,4' -> [(1, 16392, (3,)), (32, 16448, (3, 4))] (bits default 3)."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        size, _, bits = part.partition(":")
        batch, length = (int(v) for v in size.lower().split("x"))
        shapes.append((batch, length, tuple(int(b) for b in bits.split(",")) if bits else (3,)))
    return shapes


def load_baseline(folder: pathlib.Path):
    spec = importlib.util.spec_from_file_location("lowbit_decode_baseline", folder / "lowbit_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a-dir", required=True, type=pathlib.Path, action="append",
                    help="baseline folder (repeat for more baselines: A, A2, A3, ...)")
    ap.add_argument("--a-name", default=None, action="append", help="name of each --a-dir, in order")
    ap.add_argument("--b-name", default="this checkout")
    ap.add_argument("--tag", default="ab")
    ap.add_argument("--title", default="v7 decode kernel A/B")
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--shapes", default=None,
                    help="B x L [: bits,bits] separated by ';' (default: the target table's shapes), e.g. "
                         "'1x16392:3;32x16448:3,4'")
    ap.add_argument("--fixed-splits", action="store_true",
                    help="launch as a CUDA-graph bucket does: the split count planned from the table width "
                         "(meta.fixed_num_splits), the pages per split sized on the device")
    ap.add_argument("--own-splits", action="store_true",
                    help="with --fixed-splits: each side plans its own count with its own graph_splits (default: "
                         "B's count for every side)")
    ap.add_argument("--kv-heads", type=int, default=None, help="kv heads of every shape (default 8; Qwen3-30B-A3B: 4)")
    ap.add_argument("--b-kwargs", type=json.loads, default={},
                    help="JSON object of launch arguments for this checkout's kernel (B), e.g. "
                         "'{\"work_split\": true}' (the baselines launch with none)")
    args = ap.parse_args(argv)
    if not isinstance(args.b_kwargs, dict):
        ap.error("--b-kwargs must be a JSON object")
    import benchmarks.bench_attention as ba        # after argument parsing (it reads no argv at import)
    from benchmarks import attention_setup as setup

    if args.kv_heads is not None:
        if args.kv_heads < 1 or setup.HQ % args.kv_heads:
            ap.error(f"--kv-heads must divide Hq={setup.HQ}, got {args.kv_heads}")
        setup.HKV = args.kv_heads
    from moekv.ops.cuda import lowbit_decode as mod_b

    names = args.a_name or []
    mods, labels = {}, {}
    for k, folder in enumerate(args.a_dir):
        key = "A" if k == 0 else f"A{k + 1}"
        mods[key] = load_baseline(folder)
        labels[key] = names[k] if k < len(names) else str(folder)
    mods["B"] = mod_b
    labels["B"] = args.b_name
    device = torch.device("cuda")
    with cf.ThreadPoolExecutor(len(mods)) as ex:     # the extensions build in parallel
        list(ex.map(lambda m: m.module(device), mods.values()))
    timer = ba.Timer(cold=True)
    rows = []
    for batch, length, widths in (parse_shapes(args.shapes) if args.shapes else SHAPES):
        for bits in widths:
            gen = torch.Generator()
            gen.manual_seed(0)
            lb_args, _ = ba.build_lowbit(batch, length, bits, gen)
            def plan(module):              # the split count a graph bucket of this side launches
                if args.fixed_splits:
                    lb_args[-1].fixed_num_splits = (module if args.own_splits else mod_b).graph_splits(
                        batch, setup.HKV, length, device, bits)
                return getattr(lb_args[-1], "fixed_num_splits", None)

            row = {"batch": batch, "length": length, "bits": bits, "fixed_splits": plan(mods["A"])}
            ref = mods["A"].paged_attention_lowbit_decode(*lb_args, scale=0.088)
            for name, module in mods.items():
                if args.own_splits:
                    row[f"{name}_fixed_splits"] = plan(module)
                kw = args.b_kwargs if name == "B" else {}
                out = module.paged_attention_lowbit_decode(*lb_args, scale=0.088, **kw)
                row[f"{name}_ms"] = round(timer(lambda m=module, kw=kw: m.paged_attention_lowbit_decode(
                    *lb_args, scale=0.088, **kw)), 4)
                row[f"{name}_max_abs_diff_vs_A"] = (out.float() - ref.float()).abs().max().item()
            print(json.dumps(row), flush=True)
            rows.append(row)
    env = {"gpu": torch.cuda.get_device_name(0), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "commit": os.environ.get("MOEKV_COMMIT", "?"), "command": " ".join(["python3"] + sys.argv),
           "b_kwargs": args.b_kwargs, **labels}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"attention-ab-{args.tag}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    keys = list(mods)
    named = ", ".join(f"{k} = {labels[k]}" for k in keys)
    lines = [f"# {args.title}", "", f"GPU {env['gpu']}, {env['date']}, commit {env['commit']}; {named}",
             f"Command: `{env['command']}` (median of CUDA-graph replays, cold L2, Hq=32 Hkv=8 D=128, default format)",
             "", "| B | L | bits | " + " | ".join(f"{k} ms" for k in keys) + " | "
             + " | ".join(f"{k} / A" for k in keys[1:]) + " | max abs diff B vs A |",
             "|---|---|---|" + "---|" * (2 * len(keys) - 1) + "---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['length']} | int{r['bits']} | " + " | ".join(str(r[f"{k}_ms"]) for k in keys)
                     + " | " + " | ".join(f"{r[f'{k}_ms'] / r['A_ms']:.3f}" for k in keys[1:])
                     + f" | {r['B_max_abs_diff_vs_A']:.2e} |")
    (args.out / f"attention-ab-{args.tag}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

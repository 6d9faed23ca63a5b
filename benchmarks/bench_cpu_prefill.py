"""Prefill speed on the CPU: one long prompt (max_tokens=1, prefix caching off) through `LLM.generate` on the
bundled model, the fused CPU attention path (ops/cpu) against the pure-PyTorch reference in the same run.

    PYTHONPATH=src:. python benchmarks/bench_cpu_prefill.py [--tokens 4095] [--runs 4] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

from moekv.entrypoints.llm import LLM
from moekv.ops import dispatch
from moekv.provenance import git_commit
from moekv.sampling import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[1]


def time_prefill(llm: LLM, ids: list[int], runs: int) -> list[float]:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        llm.generate([ids], params)
        seconds.append(time.perf_counter() - start)
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-shakespeare-moe"))
    ap.add_argument("--tokens", type=int, default=4095)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--reference-runs", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    llm = LLM(args.model, device="cpu", enable_prefix_caching=False)
    text = (ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")
    source = text.read_text() if text.exists() else "To be, or not to be, that is the question. " * 2000
    ids = llm.tokenizer.encode(source)
    ids = (ids * (args.tokens // max(len(ids), 1) + 1))[:args.tokens]
    rows = {}
    for name, backend, runs in (("fused (ops/cpu)", "auto", args.runs), ("reference", "reference", args.reference_runs)):
        with dispatch.override(backend=backend):
            seconds = time_prefill(llm, ids, runs)
        steady = seconds[1:] or seconds
        rows[name] = {"seconds": seconds, "first_tok_s": args.tokens / seconds[0],
                      "median_tok_s_after_first": args.tokens / statistics.median(steady)}
        print(name, json.dumps(rows[name]), flush=True)
    env = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                      f"torch threads {torch.get_num_threads()}, no GPU",
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit(),
           "torch": torch.__version__, "command": " ".join(["python"] + sys.argv), "tokens": args.tokens}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "cpu-prefill-tiny-shakespeare-moe"
    stem.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = ["# CPU prefill: one long prompt on the bundled model", "",
             f"{env['machine']}; {env['date']}; commit {env['commit']}; torch {env['torch']}",
             f"Command: `{env['command']}` ({args.tokens}-token prompt, max_tokens=1, prefix caching off)", "",
             "| attention path | first run tok/s | median tok/s (runs 2..) | seconds per run |", "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['first_tok_s']:.0f} | {r['median_tok_s_after_first']:.0f} | "
                     f"{', '.join(f'{s:.2f}' for s in r['seconds'])} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

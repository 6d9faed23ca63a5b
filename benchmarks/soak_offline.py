"""Offline soak (issue 20): many requests through `LLM.generate` in batches; RSS after each batch.

    PYTHONPATH=src:. python benchmarks/soak_offline.py --requests 10000 --batch 250 \\
        --json benchmarks/results/soak-offline-cpu-tiny-shakespeare-moe.json

Prompts vary in length (so batches make new matmul shapes, as a server's do) and sample with a seed.
The report gives RSS per batch and the growth from batch --baseline-batch to the last; exit status 1
when it exceeds --max-rss-growth. It asserts nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import sys
import time
from pathlib import Path

from benchmarks.soak import commit, machine, rss_mb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--batch", type=int, default=250)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--baseline-batch", type=int, default=3)
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import os

    from moekv import LLM, SamplingParams
    from moekv.paths import default_model_dir

    llm = LLM(str(args.model or default_model_dir()), num_pages=1024)
    rng = random.Random(0)
    batches, started = [], time.monotonic()
    for index in range(0, args.requests, args.batch):
        count = min(args.batch, args.requests - index)
        prompts = ["ROMEO:\n" + "O, " * rng.randint(0, 40) for _ in range(count)]
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=index + i, ignore_eos=True)
                  for i in range(count)]
        t0 = time.monotonic()
        outputs = llm.generate(prompts, params)
        del outputs
        gc.collect()
        batches.append({"batch": len(batches), "requests": count, "seconds": time.monotonic() - t0,
                        "rss_mb": rss_mb(os.getpid())})
        print(f"batch {len(batches) - 1}: {batches[-1]['seconds']:.1f} s, rss {batches[-1]['rss_mb']:.0f} MB",
              flush=True)
    base = batches[min(args.baseline_batch, len(batches) - 1)]
    growth = (batches[-1]["rss_mb"] - base["rss_mb"]) / base["rss_mb"]
    report = {"benchmark": "soak_offline",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(), "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "machine": machine(), "config": vars(args), "batches": batches,
              "seconds": time.monotonic() - started,
              "rss_growth": {"from_batch": base["batch"], "to_batch": batches[-1]["batch"],
                             "from_mb": base["rss_mb"], "to_mb": batches[-1]["rss_mb"], "growth": growth}}
    rss = [b["rss_mb"] for b in batches]
    text = (f"# Offline soak: {args.requests} requests through LLM.generate ({report['date']})\n\n"
            f"Commit {report['commit']}; {report['machine']['cpu']}, {report['machine']['cores']} cores, no GPU.\n\n"
            f"```bash\nPYTHONPATH=src:. python {report['command']}\n```\n\n"
            f"{len(batches)} batches of {args.batch} ({args.max_tokens} tokens each) in {report['seconds']:.0f} s. "
            f"RSS per batch (MB): {', '.join(f'{r:.0f}' for r in rss)}.\n\nRSS from batch {base['batch']} to "
            f"batch {batches[-1]['batch']}: {base['rss_mb']:.0f} -> {batches[-1]['rss_mb']:.0f} MB ({growth:+.2%}; "
            f"limit {args.max_rss_growth:.0%}).\n")
    print(text)
    if args.json:
        path = Path(args.json)
        path.write_text(json.dumps(report, indent=1) + "\n")
        path.with_suffix(".md").write_text(text)
    return 1 if growth > args.max_rss_growth else 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode attention over the paged KV cache: torch SDPA (bf16, contiguous cache) vs the Triton kernels
(full-precision pages, int4 / int3 / int2 pages), plus the cost of quantizing full pages.

    PYTHONPATH=src:. python benchmarks/bench_attention.py --out benchmarks/results          # timings
    PYTHONPATH=src:. python benchmarks/bench_attention.py --check --out benchmarks/results  # correctness
    PYTHONPATH=src:. python benchmarks/bench_attention.py --lowbit-only --shapes 32x16384 --bits 3 --impls v7 \
        --lowbit-configs '{"v7": [{}, {"num_splits": 2}]}' --out /tmp/sweep   # low-bit launch configs only
    ... --lowbit-configs '{"v7": [{"chunk_split": false}, {"chunk_split": true}, {"chunk_split": true,
        "work_split": true}]}'   # v7 launch arguments: page-per-warp plan, chunk-split CTAs, + the v15 work split

Timings: median of CUDA-graph replays; "cold" (the default) zeroes a 256 MiB buffer before every
call inside the graph so nothing is served from L2, and the flush alone is timed and subtracted.
Achieved TB/s counts the bytes the kernel actually reads (codes, scales, zero points, the outlier
slots up to each page's count, staging tail pages, block tables). Writes attention-bench.{json,md,png}
(or logs/attention-check.log with --check). Prints a table; asserts nothing about speed.

--runs N (default 1) times the target table N times in this one process, interleaved (run 1 of every cell,
then run 2, ...): each cell reports the median of its N run medians with their [min, max], and each speed-up
the median of the N per-run ratios (SDPA time / kernel time of the same run). Launch-config sweeps, the
correctness check at B=1 and the quantizer's cost happen in run 1 only; every shape's inputs stay allocated
until the last run. For target tables: --no-sweep --runs 3.

Pieces: attention_setup.py (shapes and settings, the timer, each cell's inputs and bytes read),
attention_measure.py (the target table, its runs and derived columns), attention_sweep.py (--lowbit-only),
attention_check.py (--check), attention_report.py (provenance, markdown, plot).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--dry" in sys.argv:                    # plumbing test on a CPU: Triton's interpreter, tiny shapes
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks import attention_setup as setup  # noqa: E402
from benchmarks.attention_check import dump_kernels, run_check  # noqa: E402
from benchmarks.attention_measure import finish, run_benchmark  # noqa: E402
from benchmarks.attention_report import environment, write_markdown, write_plot  # noqa: E402
from benchmarks.attention_sweep import pick_configs, run_lowbit_sweep  # noqa: E402
# what tools/ and ab_decode_kernel.py use as `bench_attention.X` (the settings the command line changes are
# attention_setup's: read and set them there)
from benchmarks.attention_setup import (D, HKV, HQ, LOWBIT_PAGE, SCALE, Timer, build_fp, build_lowbit,  # noqa: E402,F401
                                        lowbit_specs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the result files")
    parser.add_argument("--check", action="store_true", help="kernel-vs-reference checks at real shapes")
    parser.add_argument("--hot", action="store_true", help="do not flush L2 between calls")
    parser.add_argument("--quick", action="store_true", help="one shape only")
    parser.add_argument("--no-sweep", action="store_true", help="default launch configs only")
    parser.add_argument("--dry", action="store_true", help="plumbing test on a CPU (interpreter; tiny shapes unless --shapes)")
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
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="kv heads of every shape (default 8: Mixtral; 4: Qwen3-30B-A3B), Hq stays 32")
    parser.add_argument("--staging-block", type=int, default=None,
                        help="low-bit inputs: the tail page's rows in shuffled staging blocks of this many tokens "
                             "(CacheConfig.staging_block_size; default one whole page)")
    parser.add_argument("--staging-only", action="store_true",
                        help="low-bit inputs: the tail page as a staging-only id (CacheConfig.lazy_partial_page)")
    parser.add_argument("--runs", type=int, default=1,
                        help="time the target table N times in this process, interleaved; each cell reports the "
                             "median of the N runs and their spread, each speed-up the median of the per-run ratios")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    setup.OUTLIERS = args.outliers
    setup.STAGING_BLOCK, setup.STAGING_ONLY = args.staging_block, args.staging_only
    if args.kv_heads is not None:
        if args.kv_heads < 1 or setup.HQ % args.kv_heads:
            parser.error(f"--kv-heads must divide Hq={setup.HQ}, got {args.kv_heads}")
        setup.HKV = args.kv_heads
    if args.shapes:
        setup.SHAPES = [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]
        setup.CURVE = []
    if args.bits:
        setup.BITS = tuple(int(b) for b in args.bits.split(","))
    if args.lowbit_configs:
        for name, configs in json.loads(args.lowbit_configs).items():
            setup.LOWBIT_IMPLS[name] = (*setup.LOWBIT_IMPLS[name][:2], configs)
    if args.fp_configs:
        setup.FP_CONFIGS = json.loads(args.fp_configs)
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
        setup.DEVICE = "cpu"
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

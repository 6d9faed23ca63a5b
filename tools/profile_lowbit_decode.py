"""Where the low-bit decode kernel's time goes, on a GPU: timings with and without outliers, and a
target for Nsight Compute.

    # timings (median of triton.testing.do_bench), int3, B=32, L=16k, default launch config:
    PYTHONPATH=src:. python3 tools/profile_lowbit_decode.py --time
    # one launch for ncu to read (hardware counters: stall reasons, issue rate, occupancy):
    ncu --clock-control none -k regex:"_decode_t[cm]_kernel" -s 2 -c 1 --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section SpeedOfLight \
        python3 tools/profile_lowbit_decode.py --launches 3

The data is benchmarks/bench_attention.py's (random rows, four heavy key channels, 1% outlier
capacity, shuffled block tables); "no outliers" builds the same pages with outlier capacity 0, so the
kernel compiles without its outlier loops (a timing-only variant: its pages lose the outliers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--dry" in sys.argv:                    # CPU plumbing check: the interpreter, set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks import bench_attention as ba  # noqa: E402

from moekv.core.lowbit_layout import QuantSpec  # noqa: E402
from moekv.ops.triton.lowbit import decode_tc as lowbit_decode_tc  # noqa: E402
from moekv.ops.triton.lowbit import decode_tm as lowbit_decode_tm  # noqa: E402

KERNELS = {"tc": lowbit_decode_tc.paged_attention_lowbit_decode_tc, "tm": lowbit_decode_tm.paged_attention_lowbit_decode_tm}


def build(batch: int, length: int, bits: int, outliers: bool):
    if not outliers:
        ba.lowbit_specs = lambda b: (QuantSpec(bits=b, axis="channel", head_dim=ba.D, page_size=ba.LOWBIT_PAGE,
                                               outlier_capacity=0),
                                     QuantSpec(bits=b, axis="token", head_dim=ba.D, page_size=ba.LOWBIT_PAGE,
                                               outlier_capacity=0))
    args, nbytes = ba.build_lowbit(batch, length, bits, torch.Generator().manual_seed(0))
    return args, nbytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--config", default="{}", help="JSON launch overrides of the kernel")
    parser.add_argument("--impl", default="tc", choices=sorted(KERNELS), help="tc (v5) or tm (v6, token-major)")
    parser.add_argument("--no-outliers", action="store_true")
    parser.add_argument("--launches", type=int, default=0, help="launch this many times and stop (for ncu)")
    parser.add_argument("--time", action="store_true", help="time with and without outliers")
    parser.add_argument("--dry", action="store_true", help="plumbing check on a CPU (interpreter, tiny shape)")
    args = parser.parse_args(argv)
    cfg = json.loads(args.config)
    paged_attention_lowbit_decode_tc = KERNELS[args.impl]    # the kernel under study (name kept from v5)
    if args.dry:
        ba.DEVICE, args.batch, args.length = "cpu", 2, 300
        for outliers in (True, False):
            lb_args, nbytes = build(args.batch, args.length, args.bits, outliers)
            out = paged_attention_lowbit_decode_tc(*lb_args, ba.SCALE, **cfg)
            want = ba.lowbit_reference.paged_attention_lowbit(*lb_args, ba.SCALE)
            err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
            print(json.dumps({"outliers": outliers, "bytes": nbytes, "max_rel_err": err}), flush=True)
        return 0
    if args.launches:
        lb_args, _ = build(args.batch, args.length, args.bits, not args.no_outliers)
        for _ in range(args.launches):
            paged_attention_lowbit_decode_tc(*lb_args, ba.SCALE, **cfg)
        torch.cuda.synchronize()
        return 0
    import triton.testing
    for outliers in (True, False):
        lb_args, nbytes = build(args.batch, args.length, args.bits, outliers)
        ms = triton.testing.do_bench(lambda: paged_attention_lowbit_decode_tc(*lb_args, ba.SCALE, **cfg),
                                     warmup=50, rep=300, return_mode="median")
        print(json.dumps({"batch": args.batch, "length": args.length, "bits": args.bits, "config": cfg,
                          "impl": args.impl, "outliers": outliers, "ms": ms, "bytes": nbytes, "tbps": nbytes / ms / 1e9}), flush=True)
        del lb_args
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

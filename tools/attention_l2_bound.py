"""Diagnostic: how much of the v7 decode kernel's time is the memory side. Times the kernel on the bench's data
(every page-head read once from HBM, warm L2 between calls) and on the same data with every block-table entry
pointing at the sequence's first page (the pages a CTA reads stay in L2), same launch, same splits.

    PYTHONPATH=src:. python3 tools/attention_l2_bound.py [--batch 32 --length 16384 --bits 3]
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--bits", type=int, default=3)
    args = ap.parse_args(argv)
    import benchmarks.bench_attention as ba
    from moekv.ops.cuda import lowbit_decode as v

    gen = torch.Generator()
    gen.manual_seed(0)
    lb_args, _ = ba.build_lowbit(args.batch, args.length, args.bits, gen)
    meta = lb_args[-1]
    fn = lambda: v.paged_attention_lowbit_decode(*lb_args, scale=0.088)   # noqa: E731
    rows = {"batch": args.batch, "length": args.length, "bits": args.bits}
    rows["hbm_cold_ms"] = round(ba.Timer(cold=True)(fn), 4)
    rows["hbm_warm_ms"] = round(ba.Timer(cold=False)(fn), 4)
    tables = meta.block_tables
    tables.copy_(tables[:, :1].expand_as(tables))       # every page of a sequence: its first page (L2-resident)
    rows["l2_resident_ms"] = round(ba.Timer(cold=False)(fn), 4)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

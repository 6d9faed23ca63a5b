"""A target for ncu: the v7 low-bit decode kernel of this checkout, called a few times on the benchmark's data.

    ncu --clock-control none -k regex:decode_kernel -s 2 -c 1 --set full -o prof \
        python3 tools/attention_profile.py 32:16384:2
    ncu -i prof.ncu-rep --page source --csv --print-source sass > lines.csv

Each case is B:L:bits; the kernel runs 5 times per case (cold L2 each time), so `-s 2 -c 1` profiles the third
call of the first case. Map the SASS rows to source lines by compiling the same csrc/ here with the extension's
flags plus -lineinfo (docs/gpu-runbook.md, session 25 lesson 1).
"""

from __future__ import annotations

import sys


def main(cases: list[str]) -> None:
    import torch

    import benchmarks.bench_attention as ba
    from moekv.ops.cuda import lowbit_decode

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for case in cases:
        batch, length, bits = (int(v) for v in case.split(":"))
        gen = torch.Generator()
        gen.manual_seed(0)
        args, _ = ba.build_lowbit(batch, length, bits, gen)
        for _ in range(5):
            flush.zero_()
            lowbit_decode.paged_attention_lowbit_decode(*args, scale=0.088)
        torch.cuda.synchronize()
        print(case, "ok", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])

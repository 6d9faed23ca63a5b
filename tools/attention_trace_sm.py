"""Per-SM view of the v7 kernel's trace build (tools/attention_trace.py): where each CTA ran (%smid) and how long
its page phase took, to tell a per-CTA imbalance (fixable by sharing pages) from a per-SM throughput bound.

    python3 tools/attention_trace.py build ab/T                                   # this machine
    PYTHONPATH=src:. python3 tools/attention_trace_sm.py dump ab/T $OUT/tr 32:16384:3 128:16384:3   # the GPU
    python3 tools/attention_trace_sm.py analyse out.json <dump dir>/*.pt          # this machine

`dump` keeps the per-CTA stamps of the median (by total time) of 9 cold-L2 calls on bench_attention's data;
`analyse` reports the page phase's spread within and between SMs and each SM's pages per microsecond.
"""

from __future__ import annotations

import json
import pathlib
import sys


def dump(folder: pathlib.Path, out: pathlib.Path, cases: list[str]) -> None:
    import torch
    import benchmarks.bench_attention as ba
    from tools.attention_trace import load, traced_call

    mod, flush = load(folder)
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        batch, length, bits = map(int, case.split(":")[:3])
        gen = torch.Generator()
        gen.manual_seed(0)
        args, _ = ba.build_lowbit(batch, length, bits, gen)
        runs = [traced_call(mod, flush, args) for _ in range(9)]
        runs.sort(key=lambda r: int(r[0][:, 15].max() - r[0][:, 0].min()))
        stamps, splits, warps = runs[len(runs) // 2]
        torch.save({"stamps": stamps, "splits": splits, "warps": warps}, out / f"{case.replace(':', '_')}.pt")
        print(case, "total us", int(stamps[:, 15].max() - stamps[:, 0].min()) / 1000, flush=True)


def analyse_one(d: dict, num_sms: int = 132) -> dict:
    import torch

    st, warps = d["stamps"].double(), d["warps"]
    rel = (st[:, :16] - st[:, 0].min()) / 1000.0            # us from the first CTA's entry
    pages = rel[:, 12] - rel[:, 2]                           # tables built -> all warps done with their pages
    sm = d["stamps"][:, 3]
    per_sm = torch.bincount(sm, minlength=num_sms)
    sm_mean = torch.zeros(len(per_sm), dtype=torch.float64).index_add_(0, sm, pages) / per_sm.clamp(min=1)
    q = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    by = {}
    for k in sorted(set(per_sm.tolist()) - {0}):
        ids = torch.nonzero(per_sm == k).flatten()
        last = torch.stack([rel[sm == i, 12].max() for i in ids])
        mask = per_sm[sm] == k
        by[str(k)] = {"sms": len(ids), "cta_pages_us_mean": round(float(pages[mask].mean()), 1),
                      "cta_pages_us_max": round(float(pages[mask].max()), 1),
                      "sm_last_pages_end_us_median": round(float(last.median()), 1)}
    done = rel[:, 4:4 + warps]
    return {"ctas": st.shape[0], "splits": d["splits"], "warps": warps, "total_us": round(float(rel[:, 15].max()), 1),
            "cta_pages_us_min_median_max": [round(float(x), 1) for x in torch.quantile(pages, q)],
            "pages_std_us": round(float(pages.std()), 1),
            "between_sm_std_us": round(float(sm_mean[per_sm > 0].std()), 1),
            "within_sm_std_us": round(float((pages - sm_mean[sm]).std()), 1),
            "warp_spread_us_median": round(float((done.max(1).values - done.min(1).values).median()), 1),
            "by_ctas_per_sm": by}


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "dump":
        dump(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]), sys.argv[4:])
    elif len(sys.argv) >= 4 and sys.argv[1] == "analyse":
        import torch
        result = {pathlib.Path(f).stem.replace("_", ":"): analyse_one(torch.load(f)) for f in sys.argv[3:]}
        pathlib.Path(sys.argv[2]).write_text(json.dumps(result, indent=1))
        for k, v in result.items():
            print(k, json.dumps(v))
    else:
        raise SystemExit(__doc__)

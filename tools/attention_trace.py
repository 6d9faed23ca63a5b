"""Critical-path trace of the v7 low-bit decode kernel: a diagnostic build with -DMOEKV_TRACE records, per CTA,
%globaltimer and clock64 at its phases (csrc/lowbit_decode_kernel.cuh says which), and this tool summarises them.

    python3 tools/attention_trace.py build ab/T                     # on this machine: the variant folder
    PYTHONPATH=src:. python3 tools/attention_trace.py run ab/T out.json 1:16384:3 32:16384:3 1:16384:3:8:16
                                                                    # on the GPU: B:L:bits[:warps|-[:splits]]

The folder (untracked, it travels with the working tree) holds the checkout's csrc/ and a copy of lowbit_decode.py
with its own extension name, -DMOEKV_TRACE, and the lse buffer sized for 32 u64 stamps per CTA after the split-K
log-sum-exps. `run` reports the median (over 7 cold-L2 calls, by total time) of: the phases' durations, the first and
the last split's phase times (us from the first CTA's entry) and the slowest CTA's.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULE = ROOT / "src/moekv/ops/cuda/lowbit_decode.py"
PHASES = {"entry": 0, "query": 1, "tables": 2, "pages": 12, "staged": 13, "combined": 14, "exit": 15}


def build(folder: pathlib.Path) -> None:
    if (folder / "csrc").exists():
        shutil.rmtree(folder / "csrc")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(MODULE.with_name("csrc"), folder / "csrc")
    s = MODULE.read_text()
    s = s.replace('name=f"moekv_lowbit_decode_v7_sm{arch}"', 'name=f"moekv_trace_' + folder.name + '_sm{arch}"')
    s = s.replace('f"-gencode=arch=compute_{arch},code=sm_{arch}"]',
                  'f"-gencode=arch=compute_{arch},code=sm_{arch}", "-DMOEKV_TRACE"]')
    start, end = s.index("    if splits > 1:\n        partial"), s.index("    counters = _counters(")
    s = s[:start] + '''    global last_trace
    partial = torch.empty((batch, num_kv_heads, splits, MAX_GROUP, head_dim), dtype=torch.float32,
                          device=query.device)
    ctas = batch * num_kv_heads * splits
    off = (ctas * MAX_GROUP + 1) & ~1
    lse = torch.zeros(off + ctas * 64, dtype=torch.float32, device=query.device)
    last_trace = (lse, off, (batch, num_kv_heads, splits), warps)
''' + s[end:]
    s = s.replace('_CSRC = pathlib.Path(__file__).with_name("csrc")',
                  '_CSRC = pathlib.Path(__file__).with_name("csrc")\nlast_trace = None')
    if "MOEKV_TRACE" not in s or "last_trace = (" not in s:
        raise SystemExit("lowbit_decode.py changed shape: update tools/attention_trace.py")
    (folder / "lowbit_decode.py").write_text(s)
    print(f"{folder}: trace build of the checkout")


def summarise(stamps, splits: int, warps: int) -> dict:
    import torch

    g = stamps[:, :16].double()
    rel = (g - g[:, 0].min()) / 1000.0                       # us from the first CTA's entry
    split = torch.arange(stamps.shape[0]) % splits
    names, cols = list(PHASES), list(PHASES.values())

    def at(rows):
        return {n: round(float(v), 3) for n, v in zip(names, rel[rows][:, cols].median(0).values)}

    d = lambda a, b: rel[:, PHASES[b]] - rel[:, PHASES[a]]   # noqa: E731
    done = rel[:, 4:4 + warps]
    return {"total_us": float(rel[:, 15].max()),
            "phase_us_median": {f"{a}->{b}": round(float(d(a, b).median()), 3) for a, b in zip(names, names[1:])},
            "phase_us_max": {f"{a}->{b}": round(float(d(a, b).max()), 3) for a, b in zip(names, names[1:])},
            "warp_spread_us_median": round(float((done.max(1).values - done.min(1).values).median()), 3),
            "first_split": at(split == 0), "last_split": at(split == splits - 1),
            "slowest_cta": {n: round(float(v), 3) for n, v in zip(names, rel[int(rel[:, 15].argmax())][cols])},
            "pages_cycles_median": float((stamps[:, 28] - stamps[:, 18]).double().median())}


def load(folder: pathlib.Path):
    """The folder's trace build, built for the GPU, and a 256 MiB buffer whose zeroing flushes L2."""
    import torch

    spec = importlib.util.spec_from_file_location("lowbit_trace", folder / "lowbit_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    device = torch.device("cuda")
    mod.module(device)
    return mod, torch.empty(256 << 20, dtype=torch.uint8, device=device)


def traced_call(mod, flush, args, **kw):
    """One cold-L2 launch: (per-CTA stamps [CTAs, 32] int64 on the host, splits, warps)."""
    import torch

    flush.zero_()
    torch.cuda.synchronize()
    mod.paged_attention_lowbit_decode(*args, scale=0.088, **kw)
    torch.cuda.synchronize()
    lse, off, (b, h, s), warps = mod.last_trace
    return lse[off:].view(torch.int64).view(b * h * s, 32).cpu(), s, warps


def run(folder: pathlib.Path, out: pathlib.Path, cases: list[str]) -> None:
    import torch
    import benchmarks.bench_attention as ba

    mod, flush = load(folder)
    result = {}
    for case in cases:
        parts = case.split(":")
        batch, length, bits = int(parts[0]), int(parts[1]), int(parts[2])
        kw = {}
        if len(parts) > 3 and parts[3] != "-":
            kw["warps"] = int(parts[3])
        if len(parts) > 4:
            kw["num_splits"] = int(parts[4])
        gen = torch.Generator()
        gen.manual_seed(0)
        args, _ = ba.build_lowbit(batch, length, bits, gen)
        runs = []
        for _ in range(7):
            stamps, s, warps = traced_call(mod, flush, args, **kw)
            runs.append(dict(summarise(stamps, s, warps), splits=s, warps=warps, ctas=stamps.shape[0]))
        runs.sort(key=lambda r: r["total_us"])
        result[case] = runs[len(runs) // 2]
        print(case, json.dumps(result[case]), flush=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "build":
        build(pathlib.Path(sys.argv[2]))
    elif len(sys.argv) >= 5 and sys.argv[1] == "run":
        run(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]), sys.argv[4:])
    else:
        raise SystemExit(__doc__)

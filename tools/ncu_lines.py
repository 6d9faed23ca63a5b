"""Stall samples and executed instructions per source line of a CUDA kernel profiled without -lineinfo.

ncu on the GPU: `ncu --set full -o prof ...`, then `ncu -i prof.ncu-rep --page source --csv --print-source sass >
sass.csv`. Here: compile the same source with the extension's flags plus -lineinfo to a cubin and disassemble it
(`nvdisasm -g -c x.cubin > x.sass`); when its instructions match the profile's one for one, every sample belongs
to a source line (the innermost inlined one nvdisasm names).

    python3 tools/ncu_lines.py sass.csv x.sass --function 'decode_kernelILi2E13__nv_bfloat16' --per 1024 --top 40

--per N divides the executed warp instructions by N (e.g. the 32-token chunks the kernel ran) for a per-chunk
column.
"""

from __future__ import annotations

import argparse
import collections
import csv
import pathlib
import re

STALLS = ("wait", "short_sb", "long_sb", "lg", "barrier", "mio", "math", "not_selected", "selected", "branch_resolving",
          "no_inst", "dispatch", "drain", "membar", "misc", "sleep", "tex", "imc")


def disassembly(path: pathlib.Path, function: str) -> list[tuple[str, int, str]]:
    """[(file, line, instruction text)] of the function whose section name contains `function`, in address order."""
    rows, inside, where = [], False, ("?", 0)
    for text in path.read_text().splitlines():
        if text.startswith("//-----") and ".text." in text:
            inside = function in text
            continue
        if not inside:
            continue
        m = re.match(r'\s*//## File "(.+)", line (\d+)', text)
        if m:
            where = (pathlib.Path(m.group(1)).name, int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", text)
        if m:
            rows.append((where[0], where[1], m.group(2)))
    return rows


def profile(path: pathlib.Path) -> list[dict]:
    with path.open() as f:
        lines = f.read().splitlines()
    start = next(i for i, t in enumerate(lines) if t.startswith('"Address"'))
    return list(csv.DictReader(lines[start:]))


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] if text.strip() else ""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=pathlib.Path)
    ap.add_argument("sass", type=pathlib.Path)
    ap.add_argument("--function", required=True, help="a fragment of the kernel's mangled name")
    ap.add_argument("--per", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    prof = profile(args.csv)
    dis = disassembly(args.sass, args.function)
    if len(prof) != len(dis):
        raise SystemExit(f"{len(prof)} profiled instructions, {len(dis)} disassembled: not the same build")
    mismatch = sum(opcode(p["Source"]) != opcode(d[2]) for p, d in zip(prof, dis))
    if mismatch:
        raise SystemExit(f"{mismatch} opcodes differ: not the same build")
    total = sum(float(p["Warp Stall Sampling (All Samples)"] or 0) for p in prof)
    instr = sum(float(p["Instructions Executed"] or 0) for p in prof)
    per_line = collections.defaultdict(lambda: collections.Counter())
    for p, (file, line, _) in zip(prof, dis):
        c = per_line[(file, line)]
        c["samples"] += float(p["Warp Stall Sampling (All Samples)"] or 0)
        c["instr"] += float(p["Instructions Executed"] or 0)
        for s in STALLS:
            c[s] += float(p.get(f"stall_{s}") or 0)
    print(f"samples {total:.0f} instr/unit {instr / args.per:.1f}")
    for (file, line), c in sorted(per_line.items(), key=lambda kv: -kv[1]["samples"])[:args.top]:
        top2 = " ".join(f"{s}{c[s]:.0f}" for s in sorted(STALLS, key=lambda s: -c[s])[:2])
        print(f"{100 * c['samples'] / total:5.1f}% {c['instr'] / args.per:7.1f}/u {file.replace('lowbit_decode_', ''):>12} "
              f"{line:5d} {top2:28s}")


if __name__ == "__main__":
    main()

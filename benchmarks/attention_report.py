"""Outputs of benchmarks/bench_attention.py: provenance of a run and the markdown table and plot written beside
attention-bench.json (also re-rendered from a saved JSON by --render). A --runs table shows each cell's median
with its run-to-run spread: "±" half the min-max range of the run values as a share of the median, the
speed-up's [min-max] over the per-run ratios."""

from __future__ import annotations

import datetime

import torch

from benchmarks import attention_setup as setup
from benchmarks.attention_setup import D, HQ
from moekv.provenance import git_commit

KERNELS = ["bf16_paged", "int4", "int3", "int2"]


def environment(argv) -> dict:
    commit = git_commit() or "unknown"
    import triton
    return {"gpu": torch.cuda.get_device_name() if setup.DEVICE == "cuda" else "cpu (dry run)",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": commit, "torch": torch.__version__, "triton": triton.__version__,
            "command": "PYTHONPATH=src:. python " + " ".join(argv)}


def plus_minus(ms: float, spread: list[float] | None) -> str:
    """" ±1.2%": half the [min, max] range as a share of the median ("" without a spread)."""
    if not spread:
        return ""
    return f" ±{50 * (spread[1] - spread[0]) / ms:.1f}%"


def kernel_cell(row: dict, name: str) -> str:
    """"ms (x, TB/s)"; with runs "ms ±p% (x [min-max], TB/s)"."""
    if name + "_ms" not in row:
        return "-"
    ratios = row.get(name + "_speedup_spread")
    x_range = f" [{ratios[0]:.2f}-{ratios[1]:.2f}]" if ratios else ""
    return (f"{row[name + '_ms']:.4f}{plus_minus(row[name + '_ms'], row.get(name + '_spread_ms'))} "
            f"({row[name + '_speedup']:.2f}x{x_range}, {row[name + '_tbps']:.2f})")


def runs_note(runs: int) -> list[str]:
    return [f"{runs} runs of the table in one process, interleaved (run 1 of every cell, then run 2, ...): ms = the "
            f"median of the {runs} runs' medians, ± half their min-max range (share of the median); speed-up = the "
            f"median of the {runs} per-run ratios (SDPA / kernel of the same run), [min-max] of those ratios. "
            "Per-run values in the JSON (`*_runs_ms`, `*_runs_speedup`).", ""]


def write_markdown(path, env, result) -> None:
    runs = result.get("runs", 1)
    spread_head = " ±%" if runs > 1 else ""
    x_head = "x [min-max]" if runs > 1 else "x"
    lines = [f"# Decode attention, Hq={HQ} Hkv={setup.HKV} D={D}", "",
             f"GPU {env['gpu']}, {env['date']}, commit {env['commit']}, torch {env['torch']}, triton {env['triton']}",
             f"Command: `{env['command']}`", "", *([result["note"], ""] if result.get("note") else []),
             f"Median of CUDA-graph replays, {'cold L2 (flushed before each call)' if result['cold_l2'] else 'hot L2'}; "
             f"copy bandwidth {result['copy_bandwidth_tbps']:.2f} TB/s (read + write)"
             + ("" if not result.get("read_bandwidth_tbps") else
                f", read bandwidth {result['read_bandwidth_tbps']:.2f} TB/s (torch.sum over 2 GiB, cold L2)")
             + "; floors at "
             f"{result['floor_bandwidth_tbps']:.2f} TB/s, the best read bandwidth seen in the run. Speed-up = SDPA "
             "time / kernel time; TB/s over the bytes each kernel reads; floor = those bytes at that bandwidth.", "",
             *(runs_note(runs) if runs > 1 else []),
             f"| B | L | SDPA bf16 ms{spread_head} | "
             + " | ".join(f"{label} ms{spread_head} ({x_head}, TB/s)"
                          for label in ["paged bf16", "int4", "int3", "int2"]) + " | int3 floor ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = [str(r["batch"]), str(r["context"]), f"{r['sdpa_ms']:.4f}{plus_minus(r['sdpa_ms'], r.get('sdpa_spread_ms'))}"]
        cells += [kernel_cell(r, name) for name in KERNELS]
        cells.append(f"{r['int3_floor_ms']:.4f}" if "int3_floor_ms" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Page quantization (one full page per sequence, K and V, all heads, Triton kernel) vs the int3 "
              "decode step's attention time:", "", "| B | L | quantize ms | reference quantizer ms | share of a step | "
              "amortised over the 128 steps that fill a page |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "quantize_pages_ms" in r:
            lines.append(f"| {r['batch']} | {r['context']} | {r['quantize_pages_ms']:.4f} | "
                         f"{r['quantize_reference_ms']:.2f} | {100 * r['quantize_share_of_step']:.1f}% | "
                         f"{100 * r['quantize_share_amortized']:.2f}% |")
    impl_names = sorted({n for r in result["rows"] for b in setup.BITS for n in r.get(f"int{b}_impl_ms", {})})
    if impl_names:
        lines += ["", f"Low-bit implementations side by side (best launch config of each; ms{spread_head}):", "",
                  "| B | L | width | " + " | ".join(impl_names) + " |", "|---|---|---|" + "---|" * len(impl_names)]
        for r in result["rows"]:
            for b in setup.BITS:
                times, spreads = r.get(f"int{b}_impl_ms", {}), r.get(f"int{b}_impl_spread_ms", {})
                if times:
                    lines.append(f"| {r['batch']} | {r['context']} | int{b} | " + " | ".join(
                        f"{times[n]:.4f}{plus_minus(times[n], spreads.get(n))}" if n in times else "-"
                        for n in impl_names) + " |")
    lines += ["", "Launch configs chosen (swept at B=1 and B=32, L=16k):", ""]
    for r in result["rows"][:1]:
        for name in KERNELS:
            if name + "_config" in r:
                lines.append(f"- {name}: `{r[name + '_config']}`")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(path, result) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted([r for r in result["rows"] if r["batch"] == 1], key=lambda r: r["context"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    lengths = [r["context"] for r in rows]
    for name, label in [("sdpa", "SDPA bf16 (contiguous)"), ("bf16_paged", "paged bf16"), ("int4", "int4"),
                        ("int3", "int3"), ("int2", "int2")]:
        line, = ax.plot(lengths, [r[name + "_ms"] for r in rows], marker="o", label=label)
        if name in ("sdpa", "int3", "int2"):
            ax.plot(lengths, [r[name + "_floor_ms"] for r in rows], ls="--", color=line.get_color(), alpha=0.6,
                    label=f"{label} bandwidth floor")
    ax.set(xscale="log", yscale="log", xlabel="context length (B=1)", ylabel="ms", title="decode attention, B=1")
    ax.legend(fontsize=7)
    ax = axes[1]
    shapes = [r for r in result["rows"] if (r["batch"], r["context"]) in setup.SHAPES]
    for i, name in enumerate(KERNELS):
        ax.bar([j + 0.2 * i for j in range(len(shapes))], [r[name + "_speedup"] for r in shapes], width=0.2, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.3 for j in range(len(shapes))], [f"B={r['batch']}\nL={r['context'] // 1024}k" for r in shapes])
    ax.set(ylabel="speed-up over SDPA bf16", title="target shapes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

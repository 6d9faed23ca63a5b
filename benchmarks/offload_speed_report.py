"""The markdown of `bench_offload.py speed` (benchmarks/offload_speed.py builds the report it formats)."""

from __future__ import annotations

from benchmarks.offload_common import pct


def speed_markdown(report: dict) -> str:
    runs = report["runs"]
    lines = [f"# Expert offload decode speed, issue 24 modes: {report['arch']}, {report['dtype']}, {report['device']}",
             "", f"{report['date']}, commit {report['commit']}, {report['machine']['gpu'] or report['machine']['cpu']}; "
             f"{report['num_layers']} layers; expert {report['expert_bytes'] / 2**20:.0f} MiB (bf16); host->device "
             f"{report['h2d_gb_per_s']:.1f} GB/s (one expert {report['copy_ms_one_expert']:.2f} ms); host experts "
             f"{report['host_experts']}; eviction {report['eviction']}; staged threshold {report['threshold']}; batch 1, "
             f"prompt {report['prompt_len']}, {report['tokens']} timed tokens after {report['warmup']} warm-up; "
             f"{report['seconds']} s in all.", "", f"Command: `{report['command']}`", "",
             "Token identity: " + ("every checked run matched its reference (16-bit runs: the resident run of the same "
                                   "harness; staged-fp8 and staged-fp8-estimate: on-demand-fp8)." if not report["mismatches"] else
                                   f"**MISMATCH** {report['mismatches']}"), "",
             *([f"**Failed runs**: {report['failures']}", ""] if report["failures"] else []),
             "GPU busy: eager rows, union of profiled GPU activity / wall; graph rows, graph replay time / wall.", "",
             "| cache | mode | ms / token | vs on-demand | GPU busy % | hit % | copies / token | misses / token "
             "| MiB moved / token | copy ms / token | staged promoted / token | matches |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def num(run, key, fmt="{:.2f}"):
        value = run.get(key)
        return "-" if value is None else fmt.format(value)
    for run in runs:
        lines.append(f"| {run['cache_percent']}% ({run['slots']}) | {run['mode']} | {run['ms_per_token']:.2f} | "
                     f"{num(run, 'speedup_vs_on_demand', '{:.2f}x')} | {pct(run.get('gpu_busy'))} | "
                     f"{pct(run.get('hit_rate'))} | {num(run, 'copies_per_token')} | {num(run, 'misses_per_token')} | "
                     f"{num(run, 'mb_moved_per_token', '{:.0f}')} | {num(run, 'copy_ms_per_token')} | "
                     f"{num(run, 'promoted_per_token')} | {run.get('matches') or '-'} |")
    lines += staged_table(runs)
    lines += split_table(report)
    lines += guard_table(runs)
    lines += ["", "## Issue 24's targets", ""]
    for percent in sorted({r["cache_percent"] for r in runs if r["cache_percent"] < 100}):
        at = {r["mode"]: r for r in runs if r["cache_percent"] == percent}
        base = at.get("on-demand")
        if base is None:
            continue
        for mode in ("staged", "staged-estimate", "staged-fp8", "staged-fp8-estimate", "prefetch-guard",
                     "staged-guard", "staged-fp8-guard"):
            ref = at.get("on-demand-fp8" if "fp8" in mode else "on-demand")
            if mode in at and ref is not None:
                verdict = "never slower: met" if at[mode]["ms_per_token"] <= ref["ms_per_token"] else "**slower: missed**"
                lines.append(f"- {percent}%: {mode} {at[mode]['ms_per_token']:.1f} ms vs {ref['mode']} "
                             f"{ref['ms_per_token']:.1f} ms ({ref['ms_per_token'] / at[mode]['ms_per_token']:.2f}x): "
                             f"{verdict}.")
        if percent == 50:
            native = [r for m, r in at.items() if m in ("prefetch", "staged", "staged-estimate", "device-graph")
                      or m.startswith("cpu-split")]
            fp8 = [r for m, r in at.items() if m.endswith("fp8")]
            for label, group, target in (("16-bit host experts", native, 1.3), ("FP8 host experts", fp8, 2.0)):
                if group:
                    best = min(group, key=lambda r: r["ms_per_token"])
                    gain = base["ms_per_token"] / best["ms_per_token"]
                    lines.append(f"- 50%, {label}: fastest {best['mode']} {best['ms_per_token']:.1f} ms = {gain:.2f}x "
                                 f"on-demand ({base['ms_per_token']:.1f} ms); target {target}x: "
                                 f"{'met' if gain >= target else '**missed** by ' + f'{target / gain:.2f}x'}.")
    graph = [r for r in runs if r["mode"].startswith("device-graph") and r.get("graph_replay_ms")]
    if graph:
        lines.append(f"- Offloaded decode steps replay a CUDA graph: {len(graph)} device-graph runs; GPU busy "
                     + ", ".join(f"{r['mode']} {r['cache_percent']}% {pct(r['gpu_busy'])}%" for r in graph) + ".")
    lines += ["", "## The timeline simulator on this run's copy and compute times", "",
              "moe.prefetch.timeline.simulate_decode over 1024 trace tokens, per-layer compute = resident ms / layers "
              "(half attention, half experts), one expert's copy as measured (FP8: half of it); scaled to "
              f"{report['num_layers']} layers. No host overhead, so it is a lower bound for eager runs.", "",
              "| cache | host format | on-demand | prefetch | staged |", "|---|---|---|---|---|"]
    sims = report["simulated"]
    for percent in sorted({s["cache_percent"] for s in sims}):
        for fmt in ("native", "fp8"):
            row = {s["mode"]: f"{s['ms_per_token']:.1f}" for s in sims
                   if s["cache_percent"] == percent and s["host_format"] == fmt}
            lines.append(f"| {percent}% | {fmt} | {row.get('on-demand', '-')} | {row.get('prefetch', '-')} | "
                         f"{row.get('staged', '-')} |")
    lines.append("")
    return "\n".join(lines)


def _section(title: str, note: str, columns: list[str]) -> list[str]:
    """The opening lines of a report section: its title, a note, and the table's header."""
    return ["", f"## {title}", "", note, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _speed(run: dict) -> str:
    speed = run.get("speedup_vs_on_demand")
    return "-" if speed is None else f"{speed:.2f}x"


def staged_table(runs: list[dict]) -> list[str]:
    """Per staged row: the guess gate, its decisions and overruns, the guesses issued / used / dropped, and the
    budget it ended with (measured gate: per-layer budget in chunks of the measured chunk time)."""
    staged = [r for r in runs if r.get("staged")]
    if not staged:
        return []
    lines = _section("Staged rows: the guess gate",
                     "Gate: measured (budgets learned from CUDA events, moe.prefetch.gate) or estimate (session 19's "
                     "host estimate). Overruns: decision points whose misses found guess chunks still in flight. "
                     "Issued: guesses with at least one chunk copied; used: of those, routed by their layer (a miss "
                     "with a head start); dropped: issued and not routed (their copy time wasted). Budget: the final "
                     "per-layer guess budget, in chunks of the measured chunk time (mean, min - max over layers), and "
                     "its AIMD scale; host: staging's host time per token.",
                     ["cache", "mode", "gate", "decisions", "overruns", "guesses issued / used / dropped",
                      "chunks (used / dropped)", "chunk ms", "budget chunks / layer", "scale", "host ms / token"])
    def f(value, fmt="{:.2f}"):
        return "-" if value is None else fmt.format(value)
    for run in staged:
        s, budget = run["staged"], run["staged"].get("budget") or {}
        gate = s["gate"] if s["measuring"] or s["gate"] == "estimate" else "estimate (no meter)"
        chunks = f"{s['chunks']} ({s['promoted_chunks']} / {s['dropped_chunks']})"
        span = "-" if budget.get("budget_chunks_mean") is None else f"{budget['budget_chunks_mean']:.1f} " \
            f"({budget['budget_chunks_min']:.1f} - {budget['budget_chunks_max']:.1f})"
        chunk_ms = f"{f(budget.get('chunk_ms'), '{:.3f}')} ({budget['chunk_ms_source']})" if budget else "-"
        lines.append(f"| {run['cache_percent']}% | {run['mode']} | {gate} | {s['decisions']} | {s['overruns']} | "
                     f"{s['issued']} / {s['used']} / {s['wasted']} | {chunks} | {chunk_ms} | {span} | "
                     f"{f(budget.get('scale_mean'))} | {f(run.get('staging_host_ms_per_token'))} |")
    return lines


def split_table(report: dict) -> list[str]:
    """The cpu-split rows: split misses, the CPU worker's time and the block's wait for it, per token."""
    rows = [r for r in report["runs"] if r.get("cpu_split")]
    if not rows:
        return []
    model = report.get("cpu_split") or {}
    lines = _section("CPU-split rows",
                     f"CPU half measured on this host: {model.get('cpu_gb_per_s', 0):.1f} GB/s ({model.get('threads')} "
                     f"threads, one token, half an expert {model.get('cpu_ms_half_expert', 0):.2f} ms); link "
                     f"{report['h2d_gb_per_s']:.1f} GB/s; balanced fraction cpu / (cpu + link) = "
                     f"{model.get('balanced_fraction', 0):.2f}. Wait: the block's host time waiting for CPU halves (on "
                     "the critical path); differs at: first greedy token unlike the resident run (- : none).",
                     ["cache", "mode", "f", "split / token", "misses / token", "CPU ms / token", "wait ms / token",
                      "part MiB", "ms / token", "vs on-demand", "differs at"])
    for run in rows:
        s = run["cpu_split"]
        lines.append(f"| {run['cache_percent']}% | {run['mode']} | {s['fraction']} | {s['split_per_token']:.2f} | "
                     f"{run['misses_per_token']:.2f} | {s['cpu_ms_per_token']:.2f} | {s['wait_ms_per_token']:.2f} | "
                     f"{s['part_mib']:.1f} | {run['ms_per_token']:.2f} | {_speed(run)} | "
                     f"{'-' if run.get('differs_from_resident_at') is None else run['differs_from_resident_at']} |")
    return lines


def guard_table(runs: list[dict]) -> list[str]:
    """The guarded rows: the side the prefetch guard kept and the window medians it decided on."""
    rows = [r for r in runs if r.get("guard")]
    if not rows:
        return []
    lines = _section("Guarded rows: what the prefetch guard kept",
                     "moe.prefetch.guard over the warm-up and timed steps: windows of steps with the predictor on and "
                     "off alternate, the faster side by its window medians is kept (exploration in the warm-up; a probe "
                     "of the other side every `hold` windows).",
                     ["cache", "mode", "kept", "windows on / off", "median ms on", "median ms off", "ms / token",
                      "vs on-demand"])
    for run in rows:
        g = run["guard"]
        kept = {True: "prefetch", False: "on demand", None: "exploring"}[g["prefetch"]]
        lines.append(f"| {run['cache_percent']}% | {run['mode']} | {kept} | {g['windows_on']} / {g['windows_off']} | "
                     f"{g['median_ms_on']} | {g['median_ms_off']} | {run['ms_per_token']:.2f} | {_speed(run)} |")
    return lines

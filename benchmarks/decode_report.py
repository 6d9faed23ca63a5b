"""bench_decode's report: the markdown written beside the JSON, the target lines (printed and in both files) and
the one-line console summary of a row. Per-row switches (benchmarks/decode_scenarios.py) get a column each."""

from __future__ import annotations

from benchmarks import bench_moe, layer_profile
from benchmarks.decode_scenarios import SWITCHES

TARGET_MOE_PCT_COPY, TARGET_TPOT_MS, TARGET_TPOT_B64_MS = 80.0, 7.0, 35.0   # issue 17: B=64 16k int3 <= 35 ms
# issue 19: Mixtral-8x7B B=1 16k bf16 KV per weight format (ms), any shape's B=1 share of its floor (%)
TARGET_TPOT_BY_WEIGHTS, TARGET_PCT_OF_FLOOR_B1 = {"bf16": 7.0, "fp8": 4.5}, 70.0


def prefill_cell(row: dict) -> str:
    if row.get("prefill_tokens_per_s") is None:
        return "- (synthetic KV)" if row.get("synthetic_kv") else "-"
    return f"{row['prefill_tokens_per_s']:.0f}"


def ms_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def switch_header() -> str:
    """The switches' columns of a table row: "fusion | " (every registered switch, set or not)."""
    return "".join(f"{s.name} | " for s in SWITCHES)


def switch_cells(row: dict) -> str:
    """A row's switch cells: "on | " ("-" for a row without the switch, e.g. transformers')."""
    return "".join(f"{row.get(s.name) or '-'} | " for s in SWITCHES)


def switch_label(row: dict) -> str:
    """"fusion on" (every registered switch; "-" where the row has none)."""
    return ", ".join(f"{s.name} {row.get(s.name) or '-'}" for s in SWITCHES)


def switch_suffix(row: dict) -> str:
    """", fusion on" for each switch the row has, else ""."""
    return "".join(f", {s.name} {row[s.name]}" for s in SWITCHES if row.get(s.name))


def bandwidth_lines(result: dict) -> list[str]:
    """The run's measured bandwidths: read (the floors') and copy (the MoE section's "% copy")."""
    read, copy = result.get("read_bandwidth_tbps"), result.get("copy_bandwidth_tbps")
    parts = []
    if read:
        parts.append(f"read bandwidth {read:.2f} TB/s (torch.sum over 2 GiB, cold L2, median of 7: every "
                     "\"% of floor\" stands on it)")
    if copy:
        parts.append(f"copy bandwidth {copy:.2f} TB/s (copy_ of 2 GiB, (read + write) / time: the MoE layer's "
                     "\"% copy\")")
    return [f"Measured {', '.join(parts)}.", ""] if parts else []


def row_summary(row: dict) -> str:
    """The console line of one decode row."""
    busy = "-" if row["gpu_busy"] is None else f"{100 * row['gpu_busy']:.1f}%"
    graphs = "" if "cuda_graphs" not in row else \
        (", CUDA graphs" if row["cuda_graphs"] else f", eager ({row['graph_fallback']})")
    if row.get("graph_replay_ms") is not None:
        graphs += (f" (replay {row['graph_replay_ms']:.3f} ms = {100 * row['gpu_busy_replay']:.1f}% of the step, "
                   f"{row['outside_graph_ms']:.3f} ms outside)")
    floor = "" if row["floor_ms"] is None else f", {row['pct_of_floor']:.1f}% of its floor {row['floor_ms']:.3f} ms"
    return (f"  {row['tpot_ms']:.3f} ms/token, {row['tokens_per_s']:.1f} tok/s, GPU busy {busy}, "
            f"prefill {prefill_cell(row)} tok/s{graphs}{floor}")


def markdown(result: dict) -> list[str]:
    env = result["env"]
    lines = [f"# Decode benchmark: {result['model']} ({result['dtype']}, {result.get('num_layers', '?')} layers, random weights)", "",
             f"GPU {env['gpu']}, {env['date']}, commit {env['commit']}, torch {env['torch']}, triton {env['triton']}, "
             f"transformers {env['transformers']}", f"Command: `{env['command']}`", ""]
    lines += bandwidth_lines(result)
    lines += ["## Decode: time per output token", "",
              "GPU busy: union of profiled kernel intervals / wall (a lower bound; the trace undercounts graph "
              "kernels); graph replay: CUDA-event time of the step's graph replay in the same timed steps (ms, and "
              "/ wall); outside: ms / token - replay (host work, copies, eager launches); % of floor: the time to read "
              "the bytes a step needs once (non-expert weights, the expected distinct routed experts, the KV) at the "
              "read bandwidth / ms per token.", "",
              f"| B | context | system | {switch_header()}weights | KV | ms / token | % of floor | tokens/s | GPU busy "
              "| graph replay | outside | prefill tok/s | KV bits/value |",
              "|---|---|---|" + "---|" * len(SWITCHES) + "---|---|---|---|---|---|---|---|---|---|"]
    for r in result["decode"]:
        busy = "-" if r["gpu_busy"] is None else f"{100 * r['gpu_busy']:.1f}%"
        replay = "-" if r.get("graph_replay_ms") is None else \
            f"{r['graph_replay_ms']:.3f} ms ({100 * r['gpu_busy_replay']:.1f}%)"
        lines.append(f"| {r['batch']} | {r['context']} | {r['system']} | {switch_cells(r)}"
                     f"{r.get('weights', 'bf16')} | {r['kv']} | {r['tpot_ms']:.3f} | {'-' if r.get('pct_of_floor') is None else format(r['pct_of_floor'], '.1f') + '%'} | "
                     f"{r['tokens_per_s']:.1f} | {busy} | {replay} | {ms_cell(r.get('outside_graph_ms'))} | "
                     f"{prefill_cell(r)} | {r['kv_bits_per_value']:.2f} |")
    for r in result["errors"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['system']} | {switch_cells(r)}"
                     f"{r.get('weights', 'bf16')} | {r['kv']} | failed: {r['error'][:80]} | | | | | | | |")
    kinds = [r for r in result["decode"] if r.get("steps_by_kind")]
    if kinds:
        lines += ["", "## Decode steps by kind (fill: a token completes a KV page; start: one opens a page)", "",
                  f"| B | context | system | {switch_header()}KV | kind | steps | wall ms (mean) | wall ms (median) "
                  "| graph replay ms |", "|---|---|---|" + "---|" * len(SWITCHES) + "---|---|---|---|---|---|"]
        for r in kinds:
            for kind, k in r["steps_by_kind"].items():
                lines.append(f"| {r['batch']} | {r['context']} | {r['system']} | {switch_cells(r)}{r['kv']} "
                             f"| {kind} | {k['steps']} | {k['wall_ms']:.3f} | {k['wall_ms_median']:.3f} "
                             f"| {ms_cell(k['replay_ms'])} |")
    memory = [r for r in result["decode"] if r.get("device_memory")]
    if memory:
        gib = 1 << 30
        lines += ["", "## Device memory per row (torch.cuda allocated, GiB: once the row's engine was built, and the "
                  "row's peak; overlapped decode adds only its token feed, 16 bytes per sequence: compare on / off)",
                  "",
                  f"| B | context | system | {switch_header()}KV | after build | peak |",
                  "|---|---|---|" + "---|" * len(SWITCHES) + "---|---|---|"]
        for r in memory:
            m = r["device_memory"]
            lines.append(f"| {r['batch']} | {r['context']} | {r['system']} | {switch_cells(r)}{r['kv']} "
                         f"| {m['allocated_after_build'] / gib:.3f} | {m['peak_allocated'] / gib:.3f} |")
    if any("kv_bits_at_context" in r for r in result["decode"]):
        lines += ["", "KV bits per value (docs/kv-format.md §8): *held* = all-in at the lengths the engine held "
                  "when measured (the table's column); *at context* = all-in at exactly the nominal context (a "
                  "multiple of the page size: no staging page); *page cycle* = all-in averaged over context .. "
                  "context + P - 1 tokens (a partly filled page holds a whole bf16 staging page); *pages* = the "
                  "low-bit pages alone.", "", "| B | context | KV | held | at context | page cycle | pages |",
                  "|---|---|---|---|---|---|---|"]
        for r in (r for r in result["decode"] if "kv_bits_at_context" in r):
            lines.append(f"| {r['batch']} | {r['context']} | {r['kv']} | {r['kv_bits_per_value']:.3f} | "
                         f"{r['kv_bits_at_context']:.3f} | {r['kv_bits_page_cycle_mean']:.3f} | "
                         f"{r['kv_page_bits_per_value']:.3f} |")
    for row in result["decode"]:
        bd = row.get("kernel_breakdown")
        if not bd:
            continue
        lines += ["", f"## Where an eager step's GPU time goes: B={row['batch']}, {row['context']}, {row['kv']} "
                  f"(torch.profiler over the profiled steps; step wall {bd['wall_ms_per_step']:.3f} ms)", "",
                  "| group | GPU ms / step | launches / step |", "|---|---|---|"]
        lines += [f"| {g} | {v['ms_per_step']:.3f} | {v['launches_per_step']:.0f} |" for g, v in bd["groups"].items()]
        lines += ["", "| kernel | GPU ms / step | launches / step |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['ms_per_step']:.3f} | {k['launches_per_step']:.0f} |" for k in bd["kernels"]]
    profiled = [r for r in result["decode"] if r.get("layer_profile")]
    if profiled:
        lines += ["", "## Kernels of one decode layer (eager steps, torch.profiler; benchmarks/layer_profile.py)"]
    for r in profiled:
        lines += [""] + layer_profile.markdown(r["layer_profile"], f"B={r['batch']}, {r['context']}, {r['kv']} KV, "
                                               f"{r.get('weights', 'bf16')} weights, {switch_label(r)}")
    lines += ["", "## MoE layer alone (layer 0's weights)", ""] + bench_moe.layer_table(result["moe_layer"])
    if result.get("fusion_parity"):
        f = result["fusion_parity"]
        lines += ["", f"Fusion on vs off, layer 0 on {f['tokens']} tokens: residual bit-equal {f['residual_bit_equal']} "
                  f"(max |diff| {f['residual_max_abs_diff']:.3g}), MoE output max |diff| {f['moe_out_max_rel_diff']:.3g} "
                  f"of its scale, expert load equal {f['expert_load_equal']}."]
    if result.get("parity"):
        p = result["parity"]
        lines += ["", f"Parity with transformers ({p['prompt_tokens']}-token prompt, last-token logits): cosine "
                  f"{p['logits_cosine']:.5f}, max |diff| {p['logits_max_abs_diff']:.3e}, same argmax: {p['same_argmax']}."]
    lines += ["", "## Targets", ""] + [f"- {t}" for t in result["targets"]]
    return lines


def targets(result: dict) -> list[str]:
    out = []
    one = [r for r in result["moe_layer"] if r["tokens"] == 1 and r["impl"] == "moekv" and r["pct_copy"] is not None]
    if one:
        out.append(f"MoE layer at 1 token: {one[0]['pct_copy']:.1f}% of copy bandwidth (target >= {TARGET_MOE_PCT_COPY:.0f}%)")
    tpot = [r for r in result["decode"] if r["system"] == "moekv" and r["kv"] == "int3" and r["batch"] == 1
            and r["context"] == 16384]
    if tpot:
        out.append(f"B=1 16k int3: {tpot[0]['tpot_ms']:.3f} ms per token (target <= {TARGET_TPOT_MS} ms)")
    b64 = [r for r in result["decode"] if r["system"] == "moekv" and r["kv"] == "int3" and r["batch"] == 64
           and r["context"] == 16384]
    if b64:
        out.append(f"B=64 16k int3: {b64[0]['tpot_ms']:.3f} ms per token (target <= {TARGET_TPOT_B64_MS} ms)")
    hf = {r["kv"]: r for r in result["decode"] if r["system"] == "transformers-grouped_mm" and r["batch"] == 1}
    for r in result["decode"]:
        if r["system"] == "moekv" and r["batch"] == 1 and hf:
            base = next(iter(hf.values()))
            if base["context"] == r["context"]:
                out.append(f"B=1 {r['context']} {r['kv']}: {base['tpot_ms'] / r['tpot_ms']:.1f}x faster than HF "
                           f"grouped_mm ({base['tpot_ms']:.1f} ms; target >= 5x)")
    for r in result["decode"]:
        if r["system"] != "moekv" or r["context"] != 16384:
            continue
        weights, floor = r.get("weights", "bf16"), r.get("pct_of_floor")
        floor_text = "" if floor is None else f", {floor:.1f}% of its floor ({r['floor_ms']:.3f} ms)"
        goal = TARGET_TPOT_BY_WEIGHTS.get(weights) if (r["batch"], r["kv"]) == (1, "bf16") and \
            result["model"].startswith("mixtral") else None
        goal_text = "" if goal is None else f" (target <= {goal} ms)"
        if r["batch"] == 1 and not result["model"].startswith("mixtral"):
            goal_text = f" (target >= {TARGET_PCT_OF_FLOOR_B1:.0f}% of floor)"
        replay = "" if r.get("graph_replay_ms") is None else f" (graph replay {r['graph_replay_ms']:.3f} ms)"
        out.append(f"{weights} weights, B={r['batch']} 16k {r['kv']} KV{switch_suffix(r)}: {r['tpot_ms']:.3f} ms per token"
                   f"{replay}{goal_text}{floor_text}")
    for r in result["decode"]:
        if r.get("layer_profile") and r["batch"] == 1:
            p = r["layer_profile"]
            out.append(f"B=1 {r['context']} {r['kv']} KV, {switch_label(r)}: {p['kernels_per_layer']:.1f} "
                       f"kernels per layer, small (non-GEMM) kernels {p['us_per_layer']['small']:.1f} us per layer "
                       "(target < 10 us)")
    for weights in sorted({r.get("weights", "bf16") for r in result["moe_layer"]}):
        for r in result["moe_layer"]:
            if r.get("weights", "bf16") == weights and r["impl"] == "moekv" and r["pct_copy"] is not None:
                out.append(f"MoE layer, {weights} weights, {r['tokens']} token(s): {r['tbps']:.2f} TB/s = "
                           f"{r['pct_copy']:.1f}% of copy (issue 19 target >= 85% of 4.3 TB/s at 1 token)")
    return out or ["(no target-bearing rows in this run)"]

"""The report of benchmarks/bench_hf_cache.py: the per-width targets against every peer, the Pareto rows and plot,
and the markdown table."""

from __future__ import annotations

from pathlib import Path


def _row(rows: list[dict], name: str) -> dict | None:
    found = [r for r in rows if r["name"] == name and "perplexity" in r]
    return found[0] if found else None


def check_targets(rows: list[dict]) -> list[dict]:
    """The targets (issue 23): at each width, moekv int<b> with no more low-bit bits per value than a quanto / HQQ
    configuration of that width has a lower perplexity and a lower KL than it."""
    checks = []
    pairs = [(f"moekv int{r['bits']}", r["name"]) for r in rows if r["family"] in ("quanto", "hqq")]
    for ours_name, theirs_name in pairs:
        ours, theirs = _row(rows, ours_name), _row(rows, theirs_name)
        if ours is None or theirs is None:
            checks.append({"ours": ours_name, "theirs": theirs_name, "status": "not measured"})
            continue
        fewer_bits = ours["bits_per_value_lowbit"] <= theirs["bits_per_value_lowbit"] + 1e-9
        better_ppl = ours["perplexity"] < theirs["perplexity"]
        better_kl = ours["mean_kl"] < theirs["mean_kl"]
        checks.append({
            "ours": ours_name, "theirs": theirs_name, "met": fewer_bits and better_ppl and better_kl,
            "bits": [ours["bits_per_value_lowbit"], theirs["bits_per_value_lowbit"]],
            "perplexity": [ours["perplexity"], theirs["perplexity"]],
            "mean_kl": [ours["mean_kl"], theirs["mean_kl"]],
            "status": "met" if fewer_bits and better_ppl and better_kl else "missed",
        })
    return checks


def pareto_rows(rows: list[dict]) -> tuple[list[dict], list[bool]]:
    """The measured low-bit rows and whether each is on the (low-bit bits, KL) Pareto front."""
    from moekv.eval.pareto import pareto_front

    measured = [r for r in rows if "perplexity" in r and r.get("bits_per_value_lowbit") is not None]
    return measured, pareto_front([(r["bits_per_value_lowbit"], r["mean_kl"]) for r in measured])


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """KL against low-bit bits per value for every family (PNG; None without matplotlib)."""
    from moekv.eval.pareto import plot_pareto

    series: dict[str, list] = {}
    for r in pareto_rows(rows)[0]:
        series.setdefault(r["family"], []).append((r["name"], r["bits_per_value_lowbit"], r["mean_kl"]))
    return plot_pareto(series, path, "low-bit bits per value", "mean KL(DynamicCache || cache), nats", title)


def _fmt(value, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    meta, rows = report["meta"], report["rows"]
    reference = _row(rows, "DynamicCache (reference)")
    lines = [
        f"# transformers caches side by side: {meta['model_name']}, {meta['context']}-token context",
        "",
        f"- date: {meta['date']}; machine: {meta['machine']}; commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}; model dtype {report['dtype']}",
        f"- protocol: {meta['windows']} windows of {meta['context']} tokens of the validation text (offsets "
        f"{', '.join(str(o) for o in report['window_offsets'])}); per window, prefill {meta['prefill']} tokens, then "
        f"chunks of {meta['chunk']} tokens with the cache carried over; perplexity and mean KL(p_DynamicCache || "
        f"p_cache) over the {meta['evaluated_positions']} positions after the prefills; every cache keeps the newest "
        "< 128 tokens in full precision (residual_length=128).",
        "- bits per value: bytes of the stored tensors (codes + scales + zero points + moekv's outliers + the "
        "full-precision residual window) x 8 / key-value scalars held; *all-in* = mean over the evaluation steps, "
        "*low-bit* = the quantized part alone at the end.",
        f"- ms/token: median of {meta['decode_tokens']} single-token greedy steps after the first window's "
        f"{meta['context']} tokens, interleaved across caches in 8 rounds, {meta['threads']} CPU thread(s); "
        f"load average at start {meta['load_average']} (a shared machine: compare timings within one run only).",
        "",
        "| cache | all-in bits/value | low-bit bits/value | perplexity | Δ ppl | mean KL | ms/token |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "perplexity" not in r:
            lines.append(f"| {r['name']} | {r.get('skipped') or r.get('error')} |||||| ")
            continue
        delta = r["perplexity"] - reference["perplexity"] if reference else None
        lines.append(f"| {r['name']} | {_fmt(r['bits_per_value_all_in'], 3)} | {_fmt(r['bits_per_value_lowbit'], 3)} "
                     f"| {r['perplexity']:.3f} | {_fmt(delta, 3)} | {r['mean_kl']:.5f} | {r['ms_per_token']:.1f} |")
    lines += ["", "Groupings:", ""]
    for r in rows:
        lines.append(f"- {r['name']}: {r['grouping']}")
    lines += ["", "## Pareto front (low-bit bits per value against mean KL; lower is better on both)", "",
              "| cache | low-bit bits/value | mean KL | on the front |", "| --- | ---: | ---: | --- |"]
    for r, on in zip(*pareto_rows(rows)):
        lines.append(f"| {r['name']} | {r['bits_per_value_lowbit']:.3f} | {r['mean_kl']:.5f} | {'yes' if on else ''} |")
    if report.get("plot"):
        lines += ["", f"Plot: `{report['plot']}`."]
    lines += ["", "## Targets", "", "| ours | theirs | low-bit bits (ours / theirs) | perplexity | mean KL | status |",
              "| --- | --- | --- | --- | --- | --- |"]
    for c in report["targets"]:
        if c["status"] == "not measured":
            lines.append(f"| {c['ours']} | {c['theirs']} | | | | not measured |")
            continue
        lines.append(f"| {c['ours']} | {c['theirs']} | {c['bits'][0]:.3f} / {c['bits'][1]:.3f} "
                     f"| {c['perplexity'][0]:.3f} / {c['perplexity'][1]:.3f} "
                     f"| {c['mean_kl'][0]:.5f} / {c['mean_kl'][1]:.5f} | {c['status']} |")
    return "\n".join(lines) + "\n"

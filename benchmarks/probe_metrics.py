"""Model-level metrics of the KV format studies (benchmarks/probe_key_scale_codes.py, probe_fp8_tail.py): a run of
`moekv.eval.kv_runner.run_windows` against the fp32 reference, with the per-window numbers paired comparisons need."""

from __future__ import annotations

import math


def window_metrics(result, reference, windows) -> dict:
    """compare()'s metrics, Δppl % against the reference, and per window its KL(reference || result) and Δppl %."""
    from moekv.eval.kv_runner import compare

    targets = windows[:, 1:].unsqueeze(-1)
    ref, out = reference.logprobs, result.logprobs
    ref_nll = -ref[:, :-1].gather(-1, targets).squeeze(-1).mean(-1)            # [W]
    nll = -out[:, :-1].gather(-1, targets).squeeze(-1).mean(-1)
    metrics = compare(result, reference)
    return {**metrics, "ppl_delta_pct": 100.0 * (metrics["perplexity"] / math.exp(reference.nll_mean) - 1.0),
            "window_kl": (ref.exp() * (ref - out)).sum(-1).mean(-1).tolist(),
            "window_ppl_delta_pct": (100.0 * ((nll - ref_nll).exp() - 1.0)).tolist(),
            "seconds": round(result.seconds, 1)}


def model_rows(model, windows, reference, widths, modes, chunk: int, patch, variant_of, width: int = 5) -> list[dict]:
    """Every (width, mode) run through run_windows inside `patch(mode)` (the study's monkeypatch, a context manager)
    with `variant_of(bits, mode)`'s cache format, a bf16 tail; a row of window_metrics each, printed as it lands."""
    from moekv.eval.kv_runner import run_windows

    import torch

    rows = []
    for bits in widths:
        for mode in modes:
            with patch(mode):
                result = run_windows(model, windows, variant_of(bits, mode), chunk, tail_dtype=torch.bfloat16)
            rows.append({"width": bits, "mode": mode, **window_metrics(result, reference, windows)})
            print(f"model int{bits} {mode:{width}s} Δppl {rows[-1]['ppl_delta_pct']:+.4f} % KL {rows[-1]['kl']:.6f} "
                  f"({result.seconds:.0f} s)", flush=True)
    return rows


def study_parser(description: str, windows: int, modes: str, model_modes: str | None, model_help: str, out: str):
    """The command line both studies share: windows of the validation text, widths, tensor- and model-level modes,
    threads, the result folder and a pretrained model (--gguf: tensor level only)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=windows)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--widths", default="4,3,2")
    parser.add_argument("--modes", default=modes)
    parser.add_argument("--model-modes", default=model_modes, help=model_help)
    parser.add_argument("--no-model-level", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=out)
    parser.add_argument("--gguf", default=None, help="tensor level only, on a pretrained model's recorded attention "
                        "(bench_kv_parts.record_hf: 'smollm2' or a GGUF file)")
    return parser


def write_report(folder: str, stem: str, report: dict, markdown: str) -> None:
    """<folder>/<stem>.json and .md, and the markdown printed."""
    import json
    from pathlib import Path

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)

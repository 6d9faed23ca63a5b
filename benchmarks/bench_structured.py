"""Structured outputs on the bundled model: how many constrained completions parse and validate, and what the
grammar mask costs per decode step at batch 32.

Runs `--completions` constrained completions (the schemas of moekv.testing.structured_cases, in turn, seeds
0..N-1, temperature 0.8) in batches of `--batch`, counting those that parse and validate (jsonschema). The
mask's cost is timed inside the engine: the host's bitmask fill (xgrammar), the sampler's logits processing
(the bitmask unpacked and applied on the device) and the matchers' token accept, per decode step, against
the whole step time (TPOT at that batch). A run of the same batches unconstrained gives the plain step time.

    PYTHONPATH=src:. python benchmarks/bench_structured.py --out benchmarks/results/structured_cpu_tiny-shakespeare-moe
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import jsonschema
import torch

from moekv import LLM, SamplingParams
from moekv.paths import default_model_dir
from moekv.provenance import git_commit
from moekv.sampling import StructuredOutputParams
from moekv.testing.structured_cases import SCHEMAS


class Timer:
    """Wraps a function and sums its wall time."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.inner, self.seconds, self.calls = owner, name, getattr(owner, name), 0.0, 0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def restore(self):
        setattr(self.owner, self.name, self.inner)


def run(llm: LLM, count: int, batch: int, constrained: bool, max_tokens: int) -> dict:
    import moekv.sampling as sampling

    engine = llm.engine
    names = sorted(SCHEMAS)
    steps_before = engine.counters["steps"]
    step_timer = Timer(engine, "step")
    process_timer = Timer(sampling, "process_logits")
    valid, results, tokens = 0, [], 0
    grammar = None
    start = time.perf_counter()
    for first in range(0, count, batch):
        seeds = range(first, min(first + batch, count))
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=s, ignore_eos=not constrained,
                                 structured_outputs=StructuredOutputParams(json=SCHEMAS[names[s % len(names)]])
                                 if constrained else None) for s in seeds]
        if constrained and grammar is None:
            engine.sampling.grammar_matcher(params[0])          # builds the backend, so its methods can be timed
            grammar = engine.sampling._grammar
            fill_timer, accept_timer = Timer(grammar, "bitmask"), Timer(grammar, "accept")
        outs = llm.generate(["ROMEO:"] * len(params), params)
        for s, out in zip(seeds, outs):
            completion = out.outputs[0]
            tokens += len(completion.token_ids)
            if not constrained:
                continue
            schema = SCHEMAS[names[s % len(names)]]
            ok = True
            try:
                jsonschema.validate(json.loads(completion.text), schema)
            except (json.JSONDecodeError, jsonschema.ValidationError):
                ok = False
            valid += ok
            results.append({"seed": s, "schema": names[s % len(names)], "valid": ok,
                            "finish_reason": completion.finish_reason, "tokens": len(completion.token_ids)})
    wall = time.perf_counter() - start
    steps = engine.counters["steps"] - steps_before
    report = {"completions": count, "batch": batch, "constrained": constrained, "steps": steps,
              "generated_tokens": tokens, "wall_s": wall, "step_ms": 1e3 * step_timer.seconds / max(steps, 1),
              "process_logits_ms": 1e3 * process_timer.seconds / max(steps, 1)}
    step_timer.restore()
    process_timer.restore()
    if constrained:
        report.update(valid=valid, valid_share=valid / count, results=results,
                      bitmask_fill_ms=1e3 * fill_timer.seconds / max(steps, 1),
                      accept_ms=1e3 * accept_timer.seconds / max(steps, 1))
        fill_timer.restore()
        accept_timer.restore()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", default="benchmarks/results/structured_cpu_tiny-shakespeare-moe")
    args = parser.parse_args()
    commit = git_commit(dirty_paths=["src/moekv", "benchmarks/bench_structured.py"]) or "uncommitted"   # at start
    llm = LLM(model=str(default_model_dir()), max_num_seqs=args.batch)
    llm.generate(["ROMEO:"], SamplingParams(max_tokens=4))                      # warm-up
    constrained = run(llm, args.completions, args.batch, True, args.max_tokens)
    plain = run(llm, args.completions, args.batch, False, args.max_tokens)
    mask_ms = constrained["bitmask_fill_ms"] + constrained["accept_ms"] + constrained["process_logits_ms"]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "load_average_1min_at_end": os.getloadavg()[0],
                    "torch_threads": torch.get_num_threads(), "gpu": None, "torch": torch.__version__},
        "commit": commit,
        "command": "PYTHONPATH=src:. python " + " ".join(sys.argv),
        "model": "models/tiny-shakespeare-moe", "schemas": SCHEMAS,
        "constrained": constrained, "unconstrained": {k: v for k, v in plain.items() if k != "results"},
        "mask_ms_per_step": mask_ms, "mask_share_of_constrained_step": mask_ms / constrained["step_ms"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    per_schema = {}
    for r in constrained["results"]:
        ok, total = per_schema.get(r["schema"], (0, 0))
        per_schema[r["schema"]] = (ok + r["valid"], total + 1)
    lines = [
        "# Structured outputs: validity and mask overhead (bundled model, CPU)", "",
        f"date {report['date']}, commit {report['commit']}, machine {report['machine']}", "",
        f"```\n{report['command']}\n```", "",
        "| schema | valid / completions |", "| --- | --- |",
        *[f"| {name} | {ok} / {total} |" for name, (ok, total) in sorted(per_schema.items())],
        f"| **all** | **{constrained['valid']} / {constrained['completions']}** |", "",
        f"Per decode step at batch {args.batch} (mean over {constrained['steps']} constrained steps):", "",
        "| part | ms / step |", "| --- | --- |",
        f"| bitmask fill (xgrammar, host) | {constrained['bitmask_fill_ms']:.3f} |",
        f"| logits processing in the sampler (unpack + mask, device) | {constrained['process_logits_ms']:.3f} |",
        f"| matchers' token accept | {constrained['accept_ms']:.3f} |",
        f"| **mask total** | **{mask_ms:.3f}** ({100 * report['mask_share_of_constrained_step']:.1f}% of the step) |",
        f"| whole constrained step (TPOT) | {constrained['step_ms']:.3f} |",
        f"| whole unconstrained step, same batches | {plain['step_ms']:.3f} |", "",
        "The mask's parts are timed inside the constrained run itself, so their share of that run's step is the",
        "overhead; the unconstrained run (same batches, `ignore_eos`, every sequence to max_tokens) is a separate",
        "run on a shared machine (load average in the JSON) and only a rough reference.", "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

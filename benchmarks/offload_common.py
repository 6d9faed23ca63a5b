"""Shared pieces of the expert offload benchmarks (bench_offload.py, offload_speed.py): provenance, output files."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import torch

from moekv import datasets
from moekv.provenance import git_commit
from moekv.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def provenance(command: list[str]) -> dict:
    commit = git_commit(dirty_paths=["src/moekv/moe", "src/moekv/ops", "benchmarks/bench_offload.py",
                                     "benchmarks/offload_speed.py", "benchmarks/offload_speed_harness.py"])
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                        "cpu_threads": torch.get_num_threads(), "gpu": gpu, "torch": torch.__version__},
            "commit": commit or "uncommitted",
            "command": "python " + " ".join(command)}


def write(out: str, report: dict, markdown: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown)
    print(f"wrote {path.with_suffix('.json')} and {path.with_suffix('.md')}")


def pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def bundled_tokens(max_tokens: int | None) -> tuple[Path, list[int]]:
    model_dir = datasets.bundled_model_dir()
    ids = Tokenizer(model_dir).encode(datasets.validation_text())
    return model_dir, ids[:max_tokens] if max_tokens else ids

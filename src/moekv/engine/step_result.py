"""What a model-runner step hands the engine: the sampling rows' logits (eager and CUDA-graph steps alike)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    logits: torch.Tensor          # [S, V] float32: one row per chunk that samples, in chunk order
    sample_chunks: list[int]      # indices into SchedulerOutput.chunks of those rows
    # Graph decode steps only (None otherwise), read back with the step's one host read:
    finite: list[bool] | None = None         # [S] the row has no NaN / +inf and a finite value (engine rule)
    greedy_tokens: list[int] | None = None   # [S] argmax of each row (the greedy token)


def usable_rows(logits: torch.Tensor) -> torch.Tensor:
    """[S, V] -> [S] bool: the row holds no NaN and no +inf and something finite (-inf alone is a legal
    mask). Its max says it all: NaN propagates, +inf wins, and it is -inf only when nothing is finite."""
    return torch.isfinite(logits.amax(dim=-1))

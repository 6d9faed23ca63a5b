"""The scheduler's per-step decision: the contract between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from moekv.core.request import Request


@dataclass
class ScheduledChunk:
    """One request's share of a step: `num_new_tokens` tokens starting at its `num_computed_tokens`.

    A decode is a chunk of 1; a prefill may be split into several chunks over several steps.
    `sample` is true when the chunk ends at the request's last known token, so the step's logits
    for its last row give the next token.
    """

    request: Request
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def end(self) -> int:
        return self.request.num_computed_tokens + self.num_new_tokens

    @property
    def sample(self) -> bool:
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step, decided before the step runs.

    chunks: requests that run, in batch order (pages for their new tokens are already allocated).
    preempted: requests that lost their pages this step and will be recomputed from the start.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

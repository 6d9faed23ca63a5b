"""A request's state as it moves through the engine, and what the engine reports back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moekv.core.sampling_params import SamplingParams


class Detokenizer(Protocol):
    """What a request needs of its detokenizer (moekv.tokenizer.IncrementalDetokenizer is one)."""

    text: str

    def add(self, token_id: int) -> str:
        """Append one token; returns the new text."""
        ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # queued, or preempted and waiting to be recomputed
    RUNNING = "running"          # holds KV pages; prefilling or decoding
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' log-probabilities (tracked for best_of > n)
    grammar: object | None = None    # structured outputs: the request's grammar matcher (moekv.structured)
    penalty_state: object | None = None  # penalties: its token counts on the device (engine/sampling_step.py)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0     # tokens whose keys/values are in the KV cache
    num_pending_tokens: int = 0      # overlapped decode: tokens drawn on the device, not read yet (after the output)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    stop_text_end: int | None = None   # where the output text is cut when a stop string matched
    num_emitted_chars: int = 0         # output text already streamed (the rest may be a stop string's start)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, with those drawn but not read yet (overlapped decode: `token_ids` does not
        have them; the step that computes one reads it from the device)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_committed_tokens(self) -> int:
        """Computed tokens of steps already read (overlapped decode: each step not read yet computed one more,
        and drew one pending token); what prefix caching may register."""
        return self.num_computed_tokens - self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt + output tokens the host has read."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_text(self) -> str:
        text = self.detokenizer.text
        return text if self.stop_text_end is None else text[: self.stop_text_end]

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error


@dataclass
class RequestOutput:
    """What one step changed for one request (the streaming unit), plus its totals so far."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    new_logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    cumulative_logprob: float = 0.0           # the sampled tokens' summed log-probability (best_of > n)

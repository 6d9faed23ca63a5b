"""Sampling parameters of one request, validated at the boundary (the sampler is moekv.sampling)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moekv.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; shaped like vLLM's SamplingParams."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                          # -1 or 0: no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    logprobs: int | None = None              # return this many top log-probabilities per token
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {message}", param=param)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0 or not math.isfinite(self.temperature):
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise bad("logprobs", f"must be an integer >= 0, got {self.logprobs!r}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = tuple(self.stop_token_ids or ())
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

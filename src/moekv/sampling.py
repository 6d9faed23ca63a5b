"""Sampling parameters (validated at the boundary) and the batched sampler.

The sampler turns a step's logits into next tokens: temperature 0 is greedy; otherwise top-k,
then top-p filtering, then a draw from the request's own generator (seeded requests reproduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

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


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and outside the top-p nucleus of one row.

    logits [V] -> [V]. Top-p keeps the smallest set of most likely tokens whose probability
    reaches top_p (the token that crosses the threshold is kept).
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs          # probability of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> SampleResult:
    """logits [B, V] float32 -> one token per row, and top-N log-probabilities where asked."""
    logits = logits.float()
    tokens: list[int] = []
    logprob_dicts: list[dict[int, float] | None] = []
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    greedy_tokens = {}
    if greedy_rows:
        picked = torch.argmax(logits[greedy_rows], dim=-1).tolist()
        greedy_tokens = dict(zip(greedy_rows, picked))
    for row, p in enumerate(params):
        if p.greedy:
            token = greedy_tokens[row]
        else:
            filtered = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(filtered, dim=-1)
            # Exponential-race draw: argmax(p / E), E ~ Exp(1), equals a categorical draw from p.
            noise = torch.empty_like(probs).exponential_(generator=generators[row])
            token = int(torch.argmax(probs / noise))
        tokens.append(token)
        if p.logprobs is not None:
            logprob_dicts.append(top_logprobs(logits[row], token, p.logprobs))
        else:
            logprob_dicts.append(None)
    return SampleResult(tokens, logprob_dicts)


def top_logprobs(logits_row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """Log-probabilities (of the unmodified distribution) of the top-n tokens and the sampled one."""
    log_probs = torch.log_softmax(logits_row.float(), dim=-1)
    out: dict[int, float] = {}
    if n > 0:
        values, ids = torch.topk(log_probs, min(n, log_probs.shape[-1]))
        out = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist())}
    out[token] = float(log_probs[token])
    return out

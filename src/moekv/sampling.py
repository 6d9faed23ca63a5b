"""The batched sampler (SamplingParams, public here, lives in moekv.core.sampling_params).

The sampler turns a step's logits into next tokens: temperature 0 is greedy; otherwise top-k,
then top-p filtering, then a draw from the request's own generator (seeded requests reproduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.core.sampling_params import SamplingParams

__all__ = ["SamplingParams", "SampleResult", "filter_logits", "sample", "top_logprobs"]


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

"""The batched sampler (SamplingParams, public here, lives in moekv.core.sampling_params).

The sampler turns a step's logits [S, V] into next tokens, all rows at once, on the logits' device:

1. logits processors (`process_logits`): logit_bias, min_tokens (EOS and stop tokens banned), the
   repetition / frequency / presence penalties (from the tokens each row has seen), and the grammar
   token mask of structured outputs (a packed bitmask, 32 tokens per int32);
2. greedy rows take the argmax; the others: temperature -> top-k -> top-p (`filter_logits_batch`), then
   a draw from each request's own generator (seeded requests reproduce).

Log-probabilities (`logprobs`, and the sampled token's for `best_of`) are those of the unmodified
distribution. The per-row functions (`filter_logits`, `process_logits_reference`) are the references
the batched ones are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moekv.core.sampling_params import SamplingParams, StructuredOutputParams

__all__ = ["SamplingParams", "StructuredOutputParams", "SampleResult", "SamplingInputs", "draw", "filter_logits",
           "filter_logits_batch", "penalty_counts", "process_logits", "process_logits_reference", "token_counts",
           "unpack_bitmask", "sample", "top_logprobs"]


@dataclass
class SamplingInputs:
    """What the logits processors need besides the params, one entry per logits row."""

    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    bitmask: torch.Tensor | None = None      # [S, ceil(V / 32)] int32 on the logits' device; -1: all allowed
    # The penalised rows' (prompt-seen [R, V] bool, output counts [R, V] float), in row order, when the caller
    # keeps them (engine/sampling_step.py, incrementally); None: built here from the token lists.
    penalty_counts: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    sampled_logprobs: list[float | None] = field(default_factory=list)   # rows with best_of > n


# -- logits processors --------------------------------------------------------------------------------
def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, W] int32 packed (bit j of word w = token 32 w + j) -> [S, vocab_size] bool, True = allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                                   # [S, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def process_logits(logits: torch.Tensor, params: list[SamplingParams], inputs: SamplingInputs) -> torch.Tensor:
    """Every row's logit_bias, min_tokens ban, penalties and grammar mask, as batched tensor ops -> [S, V]."""
    vocab = logits.shape[-1]
    device = logits.device
    logits = logits.clone()
    bias = [(row, token, value) for row, p in enumerate(params) if p.logit_bias
            for token, value in p.logit_bias.items()]
    if bias:
        rows, tokens, values = zip(*bias)
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                          torch.tensor(values, device=device, dtype=logits.dtype), accumulate=True)
    penalised = [row for row, p in enumerate(params) if p.has_penalties]
    if penalised:
        rows = [params[r] for r in penalised]
        if inputs.penalty_counts is not None:
            seen_prompt, out_counts = inputs.penalty_counts
        else:
            seen_prompt, out_counts = penalty_counts(rows, [inputs.prompt_token_ids[r] for r in penalised],
                                                     [inputs.output_token_ids[r] for r in penalised], vocab, device)
        logits[penalised] = _penalise(logits[penalised], rows, seen_prompt, out_counts)
    unbanned = logits
    banned = [(row, token) for row, p in enumerate(params)
              if p.min_tokens and len(inputs.output_token_ids[row]) < p.min_tokens
              for token in set(p.stop_token_ids) | (set() if p.ignore_eos else set(inputs.eos_token_ids))]
    if banned:
        rows, tokens = zip(*banned)
        logits = logits.clone()
        logits[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = float("-inf")
    if inputs.bitmask is not None:
        allowed = unpack_bitmask(inputs.bitmask, vocab)                            # [S, V]
        masked = logits.masked_fill(~allowed, float("-inf"))
        # A min_tokens ban must not leave a grammar nothing to say: such rows drop the ban (no host read).
        dead = ~torch.isfinite(masked).any(dim=-1, keepdim=True)                   # [S, 1]
        logits = torch.where(dead, unbanned.masked_fill(~allowed, float("-inf")), masked)
    return logits


def penalty_counts(params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]], vocab: int,
                   device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt-seen [R, V] bool: prompt tokens, for rows with a repetition penalty; output counts [R, V])."""
    rows = len(params)
    seen_prompt = token_counts([p if params[i].repetition_penalty != 1 else [] for i, p in enumerate(prompts)],
                               rows, vocab, device) > 0
    return seen_prompt, token_counts(outputs, rows, vocab, device)


def _penalise(logits: torch.Tensor, params: list[SamplingParams], seen_prompt: torch.Tensor,
              out_counts: torch.Tensor) -> torch.Tensor:
    """logits [R, V] of the penalised rows -> penalised (seen_prompt [R, V] bool, out_counts [R, V])."""
    device = logits.device
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device, dtype=logits.dtype)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=logits.dtype)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device, dtype=logits.dtype)[:, None]
    seen = seen_prompt | (out_counts > 0)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    return logits - frequency * out_counts - presence * (out_counts > 0).to(logits.dtype)


def token_counts(token_lists: list[list[int]], rows: int, vocab: int, device) -> torch.Tensor:
    """[rows, vocab] float: how often each token occurs in each row's list (one scatter-add)."""
    counts = torch.zeros(rows, vocab, device=device)
    lengths = [len(t) for t in token_lists]
    if sum(lengths):
        flat = torch.tensor([t for tokens in token_lists for t in tokens], device=device)
        row_of = torch.repeat_interleave(torch.arange(rows, device=device), torch.tensor(lengths, device=device))
        counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=counts.dtype), accumulate=True)
    return counts


def process_logits_reference(logits_row: torch.Tensor, params: SamplingParams, prompt: list[int],
                             output: list[int], eos_token_ids=(), allowed: list[int] | None = None) -> torch.Tensor:
    """One row, one control at a time in plain Python loops (the reference for `process_logits`)."""
    row = logits_row.clone().tolist()
    for token, value in (params.logit_bias or {}).items():
        row[token] += value
    if params.repetition_penalty != 1:
        for token in set(prompt) | set(output):
            row[token] = row[token] / params.repetition_penalty if row[token] > 0 else \
                row[token] * params.repetition_penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    unbanned = list(row)
    if params.min_tokens and len(output) < params.min_tokens:
        for token in set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)):
            row[token] = float("-inf")
    if allowed is not None:
        keep = set(allowed)
        masked = [v if t in keep else float("-inf") for t, v in enumerate(row)]
        if all(v == float("-inf") for v in masked):
            masked = [v if t in keep else float("-inf") for t, v in enumerate(unbanned)]
        row = masked
    return torch.tensor(row, dtype=logits_row.dtype)


# -- filtering and the draw ---------------------------------------------------------------------------
def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and outside the top-p nucleus of one row.

    logits [V] -> [V]. Top-p keeps the smallest set of most likely tokens whose probability
    reaches top_p (the token that crosses the threshold is kept).
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs          # probability of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def filter_logits_batch(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`filter_logits` for every row at once: logits [R, V], top_k [R] long (<= 0 or >= V: off),
    top_p [R] float (1: off) -> [R, V]."""
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)       # [R, V]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))                                   # [R, 1]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))        # same order
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _to_device(values: list, device) -> torch.Tensor:
    """A small host list on the device without waiting for the stream (pageable, staged at once)."""
    return torch.tensor(values).to(device, non_blocking=True)


def draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
         inputs: SamplingInputs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw of `sample`, on the device, reading nothing back: logits [S, V] -> (the float logits [S, V],
    tokens [S] int64). Overlapped decode feeds the tokens to the next step before the host sees them."""
    raw = logits.float()
    device = raw.device
    processed = process_logits(raw, params, inputs) if inputs is not None and (
        inputs.bitmask is not None or any(p.changes_logits for p in params)) else raw
    tokens = torch.argmax(processed, dim=-1)                                               # [S]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        index = _to_device(random_rows, device)
        temperature = _to_device([params[i].temperature for i in random_rows], device)[:, None]
        top_k = _to_device([params[i].top_k for i in random_rows], device)
        top_p = _to_device([params[i].top_p for i in random_rows], device)
        filtered = filter_logits_batch(processed[index] / temperature, top_k, top_p)        # [R, V]
        probs = torch.softmax(filtered, dim=-1)
        # Exponential race: argmax(p / E), E ~ Exp(1), equals a categorical draw from p. Each row's noise
        # comes from its request's generator, so a seeded request draws the same whatever its batch.
        noise = torch.empty_like(probs)
        for j, row in enumerate(random_rows):
            noise[j].exponential_(generator=generators[row])
        tokens[index] = torch.argmax(probs / noise, dim=-1)
    return raw, tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           inputs: SamplingInputs | None = None) -> SampleResult:
    """logits [S, V] -> one token per row, and top-N log-probabilities where asked."""
    raw, tokens = draw(logits, params, generators, inputs)
    device = raw.device
    token_list = tokens.tolist()
    logprob_dicts: list[dict[int, float] | None] = [
        top_logprobs(raw[row], token_list[row], p.logprobs) if p.logprobs is not None else None
        for row, p in enumerate(params)]
    sampled: list[float | None] = [None] * len(params)
    ranked = [i for i, p in enumerate(params) if p.num_sequences > p.n]
    if ranked:
        index = torch.tensor(ranked, device=device)
        values = torch.log_softmax(raw[index], dim=-1).gather(1, tokens[index].unsqueeze(1)).squeeze(1).tolist()
        for row, value in zip(ranked, values):
            sampled[row] = value
    return SampleResult(token_list, logprob_dicts, sampled)


def top_logprobs(logits_row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """Log-probabilities (of the unmodified distribution) of the top-n tokens and the sampled one."""
    log_probs = torch.log_softmax(logits_row.float(), dim=-1)
    out: dict[int, float] = {}
    if n > 0:
        values, ids = torch.topk(log_probs, min(n, log_probs.shape[-1]))
        out = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist())}
    out[token] = float(log_probs[token])
    return out

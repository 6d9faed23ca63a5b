"""The engine's side of sampling: what the sampler needs besides the logits (the rows' tokens for the
penalties and min_tokens, the grammar bitmask of structured outputs), whether the CUDA graph's argmax
can stand in for the sampler, and, after the draw, the grammar matchers' and best_of's bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.core.request import Request
from moekv.core.sampling_params import SamplingParams
from moekv.sampling import SampleResult, SamplingInputs, draw, sample, token_counts


@dataclass
class PenaltyState:
    """One penalised request's token counts, kept on the device and brought up to date each step."""

    prompt_seen: torch.Tensor            # [V] bool: in the prompt (repetition_penalty only)
    output_counts: torch.Tensor          # [V] float: occurrences in the output
    num_counted: int = 0                 # output tokens already in output_counts


class SamplingStep:
    """One engine's sampling hooks; the grammar backend is built at the first structured request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self._grammar = None

    # -- when a request arrives ---------------------------------------------------------------------------
    def check(self, params: SamplingParams) -> None:
        """Token ids in logit_bias must be inside the vocabulary (InvalidRequestError otherwise)."""
        from moekv.errors import InvalidRequestError

        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                      f"[0, {self.vocab_size})", param="logit_bias")

    def grammar_matcher(self, params: SamplingParams):
        """A compiled grammar's matcher for a structured request (None otherwise)."""
        if params.structured_outputs is None:
            return None
        if self._grammar is None:
            from moekv.errors import InvalidRequestError
            from moekv.structured import GrammarBackend

            if self.tokenizer is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer (tokenizer.json)",
                                          param="structured_outputs")
            from moekv.structured import xgrammar_available

            if not xgrammar_available():
                raise InvalidRequestError("structured outputs need the xgrammar package, which this server "
                                          "lacks (pip install 'moekv[structured]')", param="structured_outputs")
            self._grammar = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar.matcher(params.structured_outputs)

    # -- each step ---------------------------------------------------------------------------------------
    @staticmethod
    def graph_argmax_suffices(params: list[SamplingParams]) -> bool:
        """The graph step's argmax is what the sampler would pick: greedy rows, nothing edits the logits."""
        return all(p.greedy and p.logprobs is None and not p.changes_logits for p in params)

    @staticmethod
    def overlap_safe(params: SamplingParams) -> bool:
        """Whether a request's next draw needs nothing of its last token on the host, so its decode steps may
        overlap (engine/overlap.py): no logits edits (penalties, min_tokens, logit_bias, grammar), no logprobs,
        no best_of ranking."""
        return not params.changes_logits and params.logprobs is None and params.num_sequences <= params.n

    @staticmethod
    def draw_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor | None:
        """Overlapped decode: the rows' tokens [S] on the device (what `sample` draws for overlap-safe
        requests), or None when every row is greedy (the graph's argmax is the token)."""
        params = [r.params for r in requests]
        if all(p.greedy for p in params):
            return None
        return draw(logits, params, [r.generator for r in requests])[1]

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        params = [r.params for r in requests]
        inputs = None
        constrained = any(r.grammar is not None for r in requests)
        if constrained or any(p.changes_logits for p in params):
            bitmask = self._grammar.bitmask([r.grammar for r in requests], logits.device) if constrained else None
            penalised = [r for r in requests if r.params.has_penalties]
            counts = self.penalty_counts(penalised, logits.device) if penalised else None
            inputs = SamplingInputs([r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests],
                                    self.eos_token_ids, bitmask, counts)
        return sample(logits, params, [r.generator for r in requests], inputs)

    def penalty_counts(self, requests: list[Request], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' (prompt-seen [R, V], output counts [R, V]): the prompt scattered once per request, then
        only each step's new output tokens (one scatter-add for all rows), not the whole history every step."""
        vocab = self.vocab_size
        states = []
        for request in requests:
            state = request.penalty_state
            if state is None or state.output_counts.device != device:
                prompt = request.prompt_token_ids if request.params.repetition_penalty != 1 else []
                state = request.penalty_state = PenaltyState(token_counts([prompt], 1, vocab, device)[0] > 0,
                                                             torch.zeros(vocab, device=device))
            states.append(state)
        seen = torch.stack([s.prompt_seen for s in states])                              # [R, V]
        counts = torch.stack([s.output_counts for s in states])                          # [R, V]
        rows = [i for i, (r, s) in enumerate(zip(requests, states)) for _ in r.output_token_ids[s.num_counted:]]
        if rows:
            tokens = [t for r, s in zip(requests, states) for t in r.output_token_ids[s.num_counted:]]
            counts.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                              torch.ones(len(rows), device=device), accumulate=True)
        for i, (request, state) in enumerate(zip(requests, states)):
            state.output_counts, state.num_counted = counts[i], len(request.output_token_ids)
        return seen, counts

    def after_token(self, request: Request, token: int, sampled_logprob: float | None) -> str | None:
        """Bookkeeping for one appended token; returns a finish reason the grammar decides, else None."""
        if sampled_logprob is not None:
            request.cumulative_logprob += sampled_logprob
        if request.grammar is None:
            return None
        return self._grammar.accept(request.grammar, token)

"""Sampling parameters of one request, validated at the boundary (the sampler is moekv.sampling)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from moekv.errors import InvalidRequestError

MAX_LOGIT_BIAS = 100.0     # OpenAI's range for logit_bias values


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {message}", param=param)


@dataclass(frozen=True)
class StructuredOutputParams:
    """Constrain a request's output to a grammar (grammar-constrained decoding, moekv.structured).

    Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `json_object=True` (any JSON
    object), `regex` (a regular expression the whole output must match), `choice` (one of these strings).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None

    def __post_init__(self) -> None:
        given = [name for name, value in (("json", self.json), ("json_object", self.json_object or None),
                                          ("regex", self.regex), ("choice", self.choice)) if value is not None]
        if len(given) != 1:
            raise _bad("structured_outputs", f"needs exactly one of json, json_object, regex, choice; got "
                                             f"{given or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as exc:
                raise _bad("structured_outputs", f"json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise _bad("structured_outputs", "json must be a JSON schema object")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise _bad("structured_outputs", "regex must be a non-empty string")
        if self.choice is not None:
            choice = tuple(self.choice) if not isinstance(self.choice, str) else ()
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise _bad("structured_outputs", "choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", choice)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what identifies the compiled grammar (a cache key)."""
        if self.json is not None:
            return "json", json.dumps(self.json)   # property order matters: keep it
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        return "choice", json.dumps(list(self.choice))


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
    presence_penalty: float = 0.0            # subtracted once from every token already generated
    frequency_penalty: float = 0.0           # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0          # > 1 discourages tokens of the prompt and the output
    min_tokens: int = 0                      # EOS and stop tokens are banned until this many are generated
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit (-100..100)
    n: int = 1                               # sequences returned per prompt
    best_of: int | None = None               # sequences generated per prompt (the n best returned)
    structured_outputs: StructuredOutputParams | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        bad = _bad
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
        if self.logprobs is not None and not _is_count(self.logprobs, 0):
            raise bad("logprobs", f"must be an integer >= 0, got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, f"must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 1e4:
            raise bad("repetition_penalty", f"must be a number > 0 (1: off), got {self.repetition_penalty!r}")
        if not _is_count(self.min_tokens, 0) or self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], "
                                    f"got {self.min_tokens!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not _is_count(self.n, 1):
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None:
            if not _is_count(self.best_of, 1) or self.best_of < self.n:
                raise bad("best_of", f"must be an integer >= n={self.n}, got {self.best_of!r}")
            if self.best_of > self.n and self.greedy:
                raise bad("best_of", "greater than n needs temperature > 0 (greedy sequences are all the same)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputParams):
            raise bad("structured_outputs", "must be a StructuredOutputParams")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = tuple(self.stop_token_ids or ())
        if not all(_is_count(i, 0) for i in ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def changes_logits(self) -> bool:
        """Whether anything edits this request's logits before the draw (so the plain argmax is not its pick)."""
        return (self.has_penalties or self.min_tokens > 0 or bool(self.logit_bias)
                or self.structured_outputs is not None)

    @property
    def num_sequences(self) -> int:
        """Sequences generated per prompt (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n


def _logit_bias(bias) -> dict[int, float] | None:
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias", "must map token ids to numbers")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_count(token, 0):
            raise _bad("logit_bias", f"keys must be token ids (integers >= 0), got {key!r}")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"values must be numbers in [-100, 100], got {value!r} for token {key!r}")
        out[token] = float(value)
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum

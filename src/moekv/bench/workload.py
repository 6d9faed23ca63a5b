"""What `moekv bench serve` sends and when: datasets (as `vllm bench serve` names them) and arrival times.

- `random`: prompts of random token ids (sent as token-id prompts, so their lengths are exact), input
  length uniform in [L * (1 - r), L * (1 + r)] for `--random-input-len L --random-range-ratio r`,
  output length likewise from `--random-output-len`.
- `sharegpt`: a ShareGPT-format JSON file (a list of {"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]}): the first turn is the prompt, the second turn's token count
  (through the server's /tokenize) the output length, unless `--sharegpt-output-len` fixes it.
- `validation` (moekv's default): 1-3 consecutive lines of the bundled model's validation slice.

Arrivals: `--request-rate inf` sends everything at once; a finite rate draws the gaps from a gamma
distribution of shape `--burstiness` (1: exponential, a Poisson process) and mean 1 / rate.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("validation", "random", "sharegpt")
FALLBACK_PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "MACBETH:\nIs this a dagger which I see before me,",
]


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]             # text, or token ids (random dataset)
    prompt_len: int | None              # tokens when known before sending
    output_len: int                     # max_tokens of this request


def length_range(mean: int, ratio: float) -> tuple[int, int]:
    """[mean * (1 - ratio), mean * (1 + ratio)], at least 1 token."""
    return max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))


def random_requests(count: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be positive")
    rng = random.Random(seed)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    out = []
    for _ in range(count):
        length = rng.randint(in_low, in_high)
        # token 0 is often a special token (EOS/BOS): draw from the rest of the vocabulary
        out.append(SampleRequest([rng.randrange(1, vocab_size) for _ in range(length)], length,
                                 rng.randint(out_low, out_high)))
    return out


def sharegpt_conversations(path: str) -> list[tuple[str, str]]:
    """(prompt, completion) pairs of a ShareGPT-format file: conversations with at least two turns."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--dataset-path: no such file: {path}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path} is not JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            prompt, completion = turns[0].get("value"), turns[1].get("value")
            if isinstance(prompt, str) and isinstance(completion, str) and prompt:
                pairs.append((prompt, completion))
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no conversation with two turns (ShareGPT format)")
    return pairs


def sharegpt_requests(pairs: list[tuple[str, str]], count: int, seed: int, output_len: int | None,
                      count_tokens) -> list[SampleRequest]:
    """`count` conversations (shuffled with `seed`, cycled when the file has fewer); `count_tokens(text)`
    gives the completion's token count when `output_len` is None."""
    rng = random.Random(seed)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    out = []
    for i in range(count):
        prompt, completion = pairs[order[i % len(order)]]
        length = output_len if output_len is not None else max(1, count_tokens(completion))
        out.append(SampleRequest(prompt, None, length))
    return out


def validation_requests(count: int, output_len: int, seed: int) -> list[SampleRequest]:
    """Prompts of 1-3 consecutive lines of the validation slice (a few fixed lines if it is missing)."""
    try:
        from moekv.datasets import validation_slice

        lines = [line for line in validation_slice().splitlines() if line.strip()]
    except (ImportError, FileNotFoundError):
        lines = []
    rng = random.Random(seed)
    if len(lines) < 4:
        return [SampleRequest(FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)], None, output_len) for i in range(count)]
    out = []
    for _ in range(count):
        start = rng.randrange(len(lines) - 3)
        out.append(SampleRequest("\n".join(lines[start:start + rng.randint(1, 3)]) + "\n", None, output_len))
    return out


def arrival_offsets(count: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent (all 0 for an infinite rate)."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return offsets

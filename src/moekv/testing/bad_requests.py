"""Malformed OpenAI requests for the server's tests and the soak run (benchmarks/soak.py): the cases of
issue 20 with the error each must get, and a seeded fuzzer (random JSON types, unicode with lone
surrogates and NUL, huge numbers)."""

from __future__ import annotations

import json
import random

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# (path, raw JSON body, expected code, expected param): each must be a 400 with this code and param
BAD_REQUESTS = [
    (COMPLETIONS, '{"prompt": [1, -1]}', "invalid_value", "prompt"),
    (COMPLETIONS, '{"prompt": [[1, -5]]}', "invalid_value", "prompt"),
    (COMPLETIONS, '{"prompt": [1, 9223372036854775808]}', "invalid_value", "prompt"),
    (COMPLETIONS, '{"prompt": [[2], [1, 99999999999999999999999999]]}', "invalid_value", "prompt"),
    (COMPLETIONS, '{"prompt": [999999]}', "invalid_value", "prompt"),
    (COMPLETIONS, '{"prompt": "\\ud800"}', "invalid_unicode", "prompt"),
    (COMPLETIONS, '{"prompt": ["a", "b\\udfffc"]}', "invalid_unicode", "prompt"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_unicode", "messages"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}]}',
     "invalid_unicode", "messages"),
    (CHAT, '{"messages": [{"role": "user", "content": "a", "name": "\\ud83d"}]}', "invalid_unicode", "messages"),
    (COMPLETIONS, '{"prompt": "a", "model": "\\ud800"}', "invalid_unicode", "model"),
    (COMPLETIONS, '{"prompt": "a", "stop": ["\\ud800"]}', "invalid_unicode", "stop"),
    (COMPLETIONS, '{"prompt": "a", "\\ud800": 1}', "invalid_unicode", "\\ud800"),
    (COMPLETIONS, '{"prompt": "a", "audio": {}}', "unsupported_parameter", "audio"),
    (COMPLETIONS, '{"prompt": "a", "presence_penalty": 7}', "invalid_value", "presence_penalty"),
    (COMPLETIONS, '{"prompt": "a", "max_tokens": -1}', "invalid_value", "max_tokens"),
    (COMPLETIONS, '{"prompt": "a", "top_p": 0}', "invalid_value", "top_p"),
    (COMPLETIONS, '{"prompt": [[]]}', "invalid_value", "prompt"),
    (COMPLETIONS, '{"prompt": ' + "[" * 3000 + "]" * 3000 + "}", "invalid_json", None),
    (COMPLETIONS, "{not json", "invalid_json", None),
]

FUZZED_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "seed",
                 "stream", "logprobs", "echo", "model", "stream_options", "ignore_eos", "user", "best_of",
                 "logit_bias"]


def random_string(rng: random.Random) -> str:
    alphabet = ["a", "Z", " ", "\n", "\x00", "\ud800", "\udfff", "\u00e9", "\U0001f600", "\\", '"', "~"]
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    makers = [lambda: None, lambda: rng.choice([True, False]),
              lambda: rng.choice([0, 1, -1, 2 ** 63, -2 ** 70, 7]),
              lambda: rng.choice([0.5, -1e300, 1e400, float("nan")]), lambda: random_string(rng),
              lambda: rng.randint(-3, 300),
              lambda: [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
              lambda: [rng.choice([1, 5, -1, 2 ** 64, 256]) for _ in range(rng.randint(1, 3))],
              lambda: {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 2))}]
    return makers[kind]()


def fuzzed_requests(seed: int, count: int, max_tokens: int = 2) -> list[tuple[str, bytes]]:
    """`count` (path, raw body) pairs; most are invalid, some valid (kept short: `max_tokens`)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        path = rng.choice([COMPLETIONS, CHAT])
        body = {name: random_value(rng) for name in rng.sample(FUZZED_FIELDS, rng.randint(1, 5))}
        if path == CHAT:
            body.pop("prompt", None)
            message = {"role": rng.choice(["user", "system", "robot"]), "content": random_value(rng)}
            body["messages"] = rng.choice([[message], [], random_value(rng)])
        if "max_tokens" in body and rng.random() < 0.7:
            body["max_tokens"] = max_tokens
        if isinstance(body.get("n"), int) and body["n"] > 4:
            body["n"] = 4
        bodies.append((path, json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")))
    return bodies


def error_shape_problem(status: int, body: bytes) -> str | None:
    """What is wrong with an error answer's body (None: OpenAI's shape with a non-null code)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status}: not an OpenAI error body: {body[:120]!r}"
    if set(error) != {"message", "type", "param", "code"}:
        return f"{status}: error fields {sorted(error)}"
    if not isinstance(error["code"], str) or not error["code"] or not error["message"]:
        return f"{status}: empty code or message: {error}"
    return None

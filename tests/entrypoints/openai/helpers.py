"""Building blocks for server tests without weights: a character-level tokenizer, mock engines
(optionally slow or failing on a poison token), the app in process (ASGI) or on a real uvicorn in a thread,
the openai client for either server, metric polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import httpx

from moekv.engine.async_engine import AsyncEngine
from moekv.engine.engine import Engine
from moekv.entrypoints.openai.server import build_app
from moekv.entrypoints.openai.serving import ServerConfig
from moekv.metrics import ServerMetrics, parse_metrics
from moekv.testing.bad_requests import error_shape_problem
from moekv.tokenizer import Tokenizer
from tests.mock_model import MockModel, mock_arch, mock_engine_config

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
PRINTABLE = [chr(c) for c in range(32, 127)]          # token ids 1..95, in ASCII order


def write_char_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level tokenizer with one token per byte and no merges: id 0 is <eos>, ids 1..95 are the
    printable ASCII characters in order, so with the mock model (next id = id + 1) the text after
    "a" is "bcd...". The other 161 bytes follow (ids 96..256)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    byte_char = dict(enumerate(_byte_chars()))
    vocab = {"<eos>": 0}
    for b in range(32, 127):
        vocab[byte_char[b]] = len(vocab)
    for b in range(256):
        if not 32 <= b < 127:
            vocab[byte_char[b]] = len(vocab)
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<eos>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet), in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


class SlowMockModel(MockModel):
    """MockModel that sleeps per forward (so streams last long enough to cancel) and raises when a
    poison token id is in the batch (to test failure isolation)."""

    def __init__(self, arch=None, delay_s: float = 0.0, poison_token: int | None = None):
        super().__init__(arch)
        self.delay_s = delay_s
        self.poison_token = poison_token

    def forward(self, input_ids, positions, kv_cache, meta):
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.poison_token is not None and bool((input_ids == self.poison_token).any()):
            raise RuntimeError("poisoned batch")
        return super().forward(input_ids, positions, kv_cache, meta)


def make_engine(tokenizer_dir: Path | None, delay_s: float = 0.0, poison_token: int | None = None,
                max_model_len: int = 96, num_pages: int = 128, page_size: int = 4, max_num_seqs: int = 16,
                max_num_batched_tokens: int = 256) -> Engine:
    tokenizer = Tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    vocab = tokenizer.vocab_size if tokenizer is not None else 64
    config = mock_engine_config(max_model_len=max_model_len, page_size=page_size, num_pages=num_pages,
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    model = SlowMockModel(mock_arch(vocab_size=vocab, max_position_embeddings=512), delay_s, poison_token)
    return Engine(config, model=model, tokenizer=tokenizer)


def make_app(engine: Engine, name: str = "mock", **config):
    metrics = ServerMetrics(name)
    async_engine = AsyncEngine(engine, metrics)
    return build_app(async_engine, ServerConfig(served_model_name=name, **config)), async_engine


@contextlib.contextmanager
def running_app(engine: Engine, name: str = "mock", **config):
    """make_app's (app, async engine) with the engine loop started, shut down on the way out."""
    app, async_engine = make_app(engine, name, **config)
    async_engine.start()
    try:
        yield app, async_engine
    finally:
        async_engine.shutdown()


def asgi_call(app, fn, timeout_s: float = 60, raise_app_exceptions: bool = True, base_url: str = "http://test",
              **client_options):
    """`await fn(http)` against `app` in process: an httpx.AsyncClient over an ASGI transport (an exception
    escaping the app fails the call when raise_app_exceptions), the whole call bounded by timeout_s."""
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url=base_url, **client_options) as http:
            return await fn(http)
    return asyncio.run(asyncio.wait_for(main(), timeout=timeout_s))


def openai_client(server, api_key: str, timeout: float = 30):
    """The official openai client for a running server (anything with .url): no retries, so errors show."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def error_of(response: httpx.Response, status: int | None = None) -> dict:
    """The `error` object of an error answer, after checking OpenAI's error shape: a body of exactly one
    `error` with exactly message / type / param / code, a non-empty code and message
    (moekv.testing.bad_requests.error_shape_problem, the soak's check too), no traceback in the text; and the
    HTTP status when `status` is given."""
    if status is not None:
        assert response.status_code == status, response.text
    assert error_shape_problem(response.status_code, response.content) is None, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert "Traceback" not in response.text
    return body["error"]


def bad_request(call, *args, **kwargs) -> dict:
    """`call(*args, **kwargs)` through the openai client must be answered with a 400 (BadRequestError);
    returns the error body (message, param, code) for the caller's assertions."""
    import openai
    import pytest

    with pytest.raises(openai.BadRequestError) as info:
        call(*args, **kwargs)
    return info.value.body


def stream_texts(chunks, n: int = 2) -> dict[int, str]:
    """The text of each of n choices from a streamed chat answer's chunks (delta.content by choice index)."""
    texts = {index: "" for index in range(n)}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    return texts


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadedServer:
    """A real uvicorn serving `app` on a free port in a background thread (`options`: more uvicorn.Config)."""

    def __init__(self, app, **options):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=2, **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def read_metrics(base_url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{base_url}/metrics", timeout=10).text)


def wait_idle(base_url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the KV cache is empty; returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = read_metrics(base_url)
        if (values.get("moekv:num_requests_running") == 0 and values.get("moekv:num_requests_waiting") == 0
                and values.get("moekv:kv_cache_usage_perc") == 0):
            return values
        if time.monotonic() > deadline:
            return values
        time.sleep(0.05)

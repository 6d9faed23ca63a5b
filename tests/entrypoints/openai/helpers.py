"""Building blocks for server tests without weights: a character-level tokenizer, mock engines
(optionally slow or failing on a poison token), a real uvicorn in a thread, metric polling."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx

from moekv.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from moekv.engine.async_engine import AsyncEngine
from moekv.engine.engine import Engine
from moekv.entrypoints.openai.server import build_app
from moekv.entrypoints.openai.serving import ServerConfig
from moekv.metrics import ServerMetrics, parse_metrics
from moekv.tokenizer import Tokenizer
from tests.mock_model import MockModel, mock_arch

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
    config = EngineConfig(
        model=ModelConfig(model="mock", max_model_len=max_model_len),
        cache=CacheConfig(kv_cache_dtype="fp32", page_size=page_size, num_pages=num_pages),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        device=DeviceConfig("cpu"))
    model = SlowMockModel(mock_arch(vocab_size=vocab, max_position_embeddings=512), delay_s, poison_token)
    return Engine(config, model=model, tokenizer=tokenizer)


def make_app(engine: Engine, name: str = "mock", **config):
    metrics = ServerMetrics(name)
    async_engine = AsyncEngine(engine, metrics)
    return build_app(async_engine, ServerConfig(served_model_name=name, **config)), async_engine


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

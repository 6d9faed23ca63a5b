"""Start `python -m moekv serve ...` as users do, wait for /health, and stop it with a signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.entrypoints.openai.helpers import free_port, write_char_tokenizer
from tests.helpers import bundled_model

REPO = Path(__file__).resolve().parents[3]   # the checkout root (PYTHONPATH=src resolves from here)


def tiny_random_model(folder: Path) -> Path:
    """A tiny random Mixtral checkpoint with the character tokenizer (when the bundled model is absent)."""
    from tests.hf_fixtures import make_checkpoint

    checkpoint, _ = make_checkpoint(folder, "mixtral", vocab_size=257, bos_token_id=None, eos_token_id=0,
                                    max_position_embeddings=1024)
    write_char_tokenizer(checkpoint)
    return checkpoint


def served_model(tmp_path_factory) -> Path:
    """The bundled checkpoint, else a tiny random stand-in in a fresh temporary folder (needs transformers:
    skips without it)."""
    import pytest

    bundled = bundled_model()
    if bundled is not None:
        return bundled
    pytest.importorskip("transformers", reason="no bundled model and no transformers to build a stand-in")
    return tiny_random_model(tmp_path_factory.mktemp("tiny-random"))


class ServerProcess:
    def __init__(self, model: Path, log_path: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [sys.executable, "-m", "moekv", "serve", "--model", str(model), "--port", str(self.port),
                        *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180.0) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"the server did not become healthy in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int | None:
        """Send `sig`; returns the exit code, or None if it had to be killed after `timeout_s`."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            self._log.close()
            return self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None
        finally:
            self._log.close()

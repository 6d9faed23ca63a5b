"""Bounded connections on a real uvicorn with moekv's protocol (issue 20, item 4): the connection cap
(503 in OpenAI's shape), the header timeout (slowloris), the body read timeout (408), the keep-alive
timeout, and ambiguous framing (Content-Length with Transfer-Encoding: 400, connection closed)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from moekv.config import ServerLimits
from moekv.entrypoints.openai.http_limits import uvicorn_options
from moekv.errors import ConfigError
from tests.entrypoints.openai.helpers import ThreadedServer, make_app, make_engine

LIMITS = ServerLimits(max_connections=8, header_timeout_s=0.6, read_timeout_s=0.6, keep_alive_timeout_s=0.6)


@pytest.fixture(scope="module")
def server(char_tokenizer_dir):
    engine = make_engine(char_tokenizer_dir)
    app, _ = make_app(engine, limits=LIMITS)
    with ThreadedServer(app, **uvicorn_options(LIMITS)) as running:
        yield running


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    while True:
        piece = sock.recv(65536)
        if not piece:
            return data, time.monotonic() - started
        data += piece


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="max_connections"):
        ServerLimits(max_connections=0)
    with pytest.raises(ConfigError, match="header_timeout_s"):
        ServerLimits(header_timeout_s=float("inf"))


def test_one_connection_over_the_cap_gets_a_503_and_the_rest_still_work(server):
    held = [connect(server) for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)
    extra = connect(server)
    raw, _ = read_until_closed(extra)
    status, error = status_and_error(raw)
    assert status == 503 and error["code"] == "too_many_connections"
    held[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")   # the held connections are served
    assert held[0].recv(4096).startswith(b"HTTP/1.1 200")
    for sock in held:
        sock.close()
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200   # free slots again


def test_partial_headers_are_cut_at_the_header_timeout(server):
    """Slowloris: sockets that trickle headers (or send nothing) are closed after ~header_timeout_s."""
    sockets = [connect(server) for _ in range(6)]
    for index, sock in enumerate(sockets):
        if index % 2 == 0:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    time.sleep(0.3)
    for sock in sockets[::2]:
        sock.sendall(b"a")   # still trickling: the timeout counts from the request's first byte
    results = [read_until_closed(sock) for sock in sockets]
    for raw, elapsed in results:
        assert elapsed < LIMITS.header_timeout_s + 2
        status, error = status_and_error(raw)
        assert status == 408 and error["code"] == "request_timeout"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_stalled_body_is_a_408(server):
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    raw, elapsed = read_until_closed(sock)
    assert elapsed < LIMITS.read_timeout_s + 3
    status, error = status_and_error(raw)
    assert status == 408 and error["code"] == "request_timeout" and "--read-timeout" in error["message"]


def test_an_idle_keep_alive_connection_is_closed(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    raw, elapsed = read_until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 200")
    assert LIMITS.keep_alive_timeout_s - 0.1 < elapsed < LIMITS.keep_alive_timeout_s + 2


def test_content_length_with_transfer_encoding_is_rejected(server):
    body = b'{"prompt": "a", "max_tokens": 2}'
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    raw, _ = read_until_closed(sock)
    assert b"connection: close" in raw.lower()   # closed at once, not left open for a smuggled request
    status, error = status_and_error(raw)
    assert status == 400 and error["code"] == "ambiguous_framing"

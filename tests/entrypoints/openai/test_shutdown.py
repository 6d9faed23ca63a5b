"""Graceful SIGTERM on a live `moekv serve` (issue 20, item 3): no new connections, running requests
finish within --shutdown-timeout, then every open stream ends with an error event and `data: [DONE]`
(a complete chunked body), a pending non-streamed answer is a 503 `aborted`, one log line per request
ended, no traceback, exit status 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.subprocess_server import ServerProcess

SHUTDOWN_TIMEOUT_S = 1.5


def _post(url: str, body: dict, results: dict, key: str, first_chunk: threading.Event | None = None) -> None:
    """POST and keep what came back: status, the whole (streamed) text, or the exception."""
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as response:
            text = ""
            for piece in response.iter_text():
                text += piece
                if first_chunk is not None and "data: {" in text:
                    first_chunk.set()
            results[key] = (response.status_code, text)
    except Exception as exc:   # an incomplete chunked body raises here
        results[key] = exc
    if first_chunk is not None:
        first_chunk.set()


def _events(text: str) -> list:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def test_sigterm_finishes_short_requests_and_ends_long_streams(model_dir, tmp_path):
    process = ServerProcess(model_dir, tmp_path / "server.log", "--max-model-len", "1024", "--num-pages", "512",
                            "--page-size", "16", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)).start()
    url = f"{process.url}/v1/completions"
    long_body = {"prompt": "ROMEO:\n", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    results: dict = {}
    started = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=_post, args=(url, long_body, results, f"long{i}", started[i]))
               for i in range(3)]
    threads.append(threading.Thread(target=_post, args=(
        url, {**long_body, "stream": False, "prompt": "JULIET:\n"}, results, "plain")))
    for thread in threads:
        thread.start()
    assert all(event.wait(120) for event in started)
    time.sleep(0.3)   # the non-streamed request is queued too
    # A short request still running when the signal arrives finishes within the timeout.
    short_started = threading.Event()
    short = threading.Thread(target=_post, args=(url, {**long_body, "max_tokens": 12}, results, "short",
                                                 short_started))
    short.start()
    assert short_started.wait(60)
    signalled = time.monotonic()
    process.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):   # no new connections once shutting down
        httpx.post(url, json={"prompt": "a"}, timeout=5)
    code = process.stop(signal.SIGTERM, timeout_s=30)
    elapsed = time.monotonic() - signalled
    for thread in [*threads, short]:
        thread.join(30)
    log = process.log()
    assert code == 0, log[-3000:]
    assert SHUTDOWN_TIMEOUT_S <= elapsed < SHUTDOWN_TIMEOUT_S + 10, elapsed

    status, text = results["short"]
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in _events(text)[:-1]]
    assert finish[-1] == "length"
    for key in ("long0", "long1", "long2"):
        assert not isinstance(results[key], Exception), results[key]   # a complete chunked body
        status, text = results[key]
        events = _events(text)
        assert status == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "aborted" and error["type"] == "server_error"
        assert len(events) > 3   # it streamed tokens before the end
    status, text = results["plain"]
    assert status == 503 and json.loads(text)["error"]["code"] == "aborted"
    assert log.count("ended unfinished (abort)") == 4, log[-3000:]   # one line per request ended
    assert "Traceback" not in log and "Cancel" not in log, log[-3000:]

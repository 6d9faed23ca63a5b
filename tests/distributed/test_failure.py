"""A rank that fails makes every expert-parallel rank stop at once, with its error, instead of leaving
them inside a collective (distributed.failure): the flag and its watcher on their own, then torchrun
launches (gloo, 2 processes) where one rank raises in the middle of a step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from moekv.distributed import failure
from tests.distributed.helpers import REPO, WORKER


# -- the flag and the watcher, in one process ------------------------------------------------------------
def test_first_failure_wins_and_peers_see_it():
    store = dist.HashStore()
    seen = []
    event = threading.Event()

    def on_peer_failure(rank, message):
        seen.append((rank, message))
        event.set()

    watcher = failure.FailureMonitor(store, rank=0, poll_s=0.01, on_peer_failure=on_peer_failure)
    failing = failure.FailureMonitor(store, rank=1, poll_s=0)
    watcher.start()
    try:
        assert failing.report("RuntimeError: boom") == "rank 1: RuntimeError: boom"
        assert failing.report("a later error") == "rank 1: RuntimeError: boom"       # the first one stays
        assert event.wait(5.0)
    finally:
        watcher.stop()
    assert seen == [(0, "rank 1: RuntimeError: boom")]
    assert watcher.failure == "rank 1: RuntimeError: boom"


def test_own_failure_does_not_trigger_the_watcher():
    store = dist.HashStore()
    calls = []
    monitor = failure.FailureMonitor(store, rank=1, poll_s=0.01, on_peer_failure=lambda *a: calls.append(a))
    monitor.start()
    try:
        monitor.report("ValueError: mine")
        time.sleep(0.2)
    finally:
        monitor.stop()
    assert calls == []
    assert monitor.failed_here and monitor.failure == "rank 1: ValueError: mine"


def test_collective_section_reports_and_then_refuses(monkeypatch):
    store = dist.HashStore()
    monitor = failure.FailureMonitor(store, rank=0, poll_s=0)
    monkeypatch.setattr(failure, "_monitor", monitor)
    with failure.collective_section("a config check", unreported=(KeyError,)):
        pass
    with pytest.raises(KeyError):
        with failure.collective_section("a config check", unreported=(KeyError,)):
            raise KeyError("alike on every rank")
    assert monitor.peek() is None                          # an error every rank raises alike is not reported
    with pytest.raises(RuntimeError, match="boom"):
        with failure.collective_section("step 3"):
            raise RuntimeError("boom")
    flag = monitor.peek()
    assert flag.startswith("rank 0: RuntimeError: boom (in step 3)") and "Traceback" in flag
    with pytest.raises(failure.ExpertParallelError, match="cannot continue.*rank 0: RuntimeError: boom"):
        with failure.collective_section("step 4"):
            raise AssertionError("never reached")


# -- torchrun: one rank raises mid-step ----------------------------------------------------------------
def launch_failing(tmp_path: Path, scenario: dict, timeout: float = 240.0):
    """Run a failing ep_worker scenario on 2 gloo ranks; (return code, output, seconds)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"scenarios": [scenario]}))
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join((str(REPO), str(REPO / "src"))), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONWARNINGS": "ignore", "MOEKV_EP_EXIT_GRACE_S": "0.2"}
    began = time.monotonic()
    try:
        result = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node=2", str(WORKER), str(spec),
                                 str(out_dir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the ranks hung for {timeout} s after rank 1 failed\n{exc.stdout}\n{exc.stderr}") from None
    return result.returncode, result.stdout + result.stderr, time.monotonic() - began


def test_rank_that_fails_and_stays_alive_stops_the_others(tmp_path):
    """The defect this guards against: rank 1 raises mid-step and catches it (a process that lives on);
    rank 0, waiting in that step's next collective, used to hang until the group's timeout."""
    code, output, seconds = launch_failing(tmp_path, dict(name="swallow", kind="fail", fail_rank=1, fail_after=3,
                                                          swallow=True, sleep=600))
    assert code != 0, output
    assert "rank 1: caught RuntimeError('injected failure on rank 1')" in output
    assert "rank 0: stopping because another expert-parallel rank failed" in output
    assert "rank 1: RuntimeError: injected failure on rank 1 (in lockstep step" in output
    assert seconds < 120, f"took {seconds:.0f} s\n{output}"


def test_follower_that_raises_stops_the_serving_leader(tmp_path):
    """engine.leader: a follower's step raises (uncaught: the process ends); the leader stops too, with the error."""
    code, output, seconds = launch_failing(tmp_path, dict(name="serve_fail", kind="fail", fail_rank=1, fail_after=3,
                                                          serve=True))
    assert code != 0, output
    assert "injected failure on rank 1" in output
    assert "finished although" not in output
    assert seconds < 120, f"took {seconds:.0f} s\n{output}"

"""Fail fast when one expert-parallel rank fails, instead of leaving the others inside a collective.

Every MoE layer is a collective, so a rank that raises in the middle of a step (or before its first
step) leaves the others waiting for data that never comes: with NCCL until the watchdog's timeout,
with gloo until the failed process's sockets close (never, if it catches the error and lives on).
Two mechanisms, set up by `groups.init_expert_parallel`:

- a failure flag in the rendezvous store every rank already shares (the TCPStore of
  `init_process_group`): a rank whose lockstep step, control collective, follower loop, rebalance
  or top level raises writes "rank r: <traceback>" to it (`report_failure`; the first writer wins,
  so a rank failing *because* another died never hides the cause);
- a watcher thread on every rank polls the flag (every `MOEKV_EP_POLL_S`, default 0.2 s). When
  another rank has failed, it prints that rank's error to stderr and ends this process with status
  `PEER_FAILED_EXIT` (75): a thread blocked in a collective cannot be woken any other way. Under
  torchrun the agent then stops every rank still running and reports the failure.

The failing rank keeps its exception (it propagates as usual); its later collective calls raise
`ExpertParallelError` at once (`check_healthy`) instead of pairing with collectives the others never
make, and if it exits with the failure recorded, the exit skips `destroy_process_group` (which can
wait forever on NCCL work a dead peer never finishes). A deadlock that raises nothing is bounded by
the process groups' timeouts (`groups.device_timeout`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager

from moekv import envs
from moekv.errors import MoekvError

PEER_FAILED_EXIT = 75            # exit status of a rank ended because another rank failed
_KEY = "moekv/expert_parallel_failed"
_MAX_MESSAGE = 8000              # characters of a traceback kept in the store


class ExpertParallelError(MoekvError):
    """The expert-parallel group cannot go on: a rank failed (this one or another)."""


def describe(exc: BaseException, where: str | None = None) -> str:
    """A one-paragraph account of `exc` with its traceback (what peers print)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    if len(text) > _MAX_MESSAGE:
        text = "...\n" + text[-_MAX_MESSAGE:]
    head = f"{type(exc).__name__}: {exc}" + (f" (in {where})" if where else "")
    return f"{head}\n{text}"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
            pass


def exit_on_peer_failure(rank: int, message: str) -> None:
    """Default reaction to another rank's failure: say why, then end this process now."""
    grace = envs.ep_exit_grace_s(1.0)      # let the failed rank print its own traceback first
    indented = "\n".join("    " + line for line in message.splitlines())
    sys.stderr.write(f"\n[moekv] rank {rank}: stopping because another expert-parallel rank failed "
                     f"(exit status {PEER_FAILED_EXIT}); its error:\n{indented}\n")
    _flush()
    time.sleep(max(0.0, grace))
    _flush()
    os._exit(PEER_FAILED_EXIT)


class FailureMonitor:
    """This process's view of the group's failure flag (see the module docstring)."""

    def __init__(self, store, rank: int, poll_s: float | None = None, on_peer_failure=exit_on_peer_failure):
        self.store = store
        self.rank = rank
        self.poll_s = poll_s if poll_s is not None else envs.ep_poll_s(0.2)
        # a restarted torchrun attempt must not see the flag of the attempt before
        self.key = f"{_KEY}/{envs.torchrun_restart_count()}"
        self.on_peer_failure = on_peer_failure
        self.failure: str | None = None          # the first failure this process knows of
        self.failed_here = False                 # this rank reported a failure of its own
        self.noted = False                       # said once that this rank's error may follow another's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the flag -------------------------------------------------------------------------------
    def report(self, message: str) -> str:
        """Record this rank's failure (the first one anywhere wins); returns the flag's value."""
        entry = f"rank {self.rank}: {message}"
        first = entry
        try:
            first = self.store.compare_set(self.key, "", entry).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store is gone (its host ended): nobody left to tell
            pass
        self.failed_here = True
        if self.failure is None:
            self.failure = first
        return first

    def peek(self) -> str | None:
        """The flag's value, or None while no rank has failed (or the store is unreachable)."""
        try:
            if not self.store.check([self.key]):
                return None
            return self.store.get(self.key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            return None

    # -- the watcher ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None and self.poll_s > 0:
            self._thread = threading.Thread(target=self._watch, name="moekv-ep-failure-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, 5 * self.poll_s))

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if not self.store.check([self.key]):
                    continue
                message = self.store.get(self.key).decode(errors="replace")
            except Exception:  # noqa: BLE001 - the store's host ended (normal at shutdown): stop watching
                return
            if self._stop.is_set():
                return
            if self.failure is None:
                self.failure = message
            if message.startswith(f"rank {self.rank}:"):
                return                            # our own failure: the exception is on its way up
            self.on_peer_failure(self.rank, message)
            return


_monitor: FailureMonitor | None = None


def start_monitor(store, rank: int, **kwargs) -> FailureMonitor:
    """Install (once per process) and start the watcher; returns the monitor."""
    global _monitor
    if _monitor is None:
        _monitor = FailureMonitor(store, rank, **kwargs)
        _monitor.start()
        _install_excepthook()
    return _monitor


def stop_monitor() -> FailureMonitor | None:
    """Stop the watcher (before the process group, and with it the store, goes away)."""
    global _monitor
    monitor, _monitor = _monitor, None
    if monitor is not None:
        monitor.stop()
    return monitor


def monitor() -> FailureMonitor | None:
    return _monitor


def report_failure(exc: BaseException | str, where: str | None = None) -> None:
    """Tell every rank that this one failed (no-op outside expert parallelism)."""
    if _monitor is None:
        return
    if isinstance(exc, ExpertParallelError) and _monitor.failure is not None:
        return                                    # already reported, or a peer's failure seen here
    message = exc if isinstance(exc, str) else describe(exc, where)
    first = _monitor.report(message)
    if not first.startswith(f"rank {_monitor.rank}:") and not _monitor.noted:
        _monitor.noted = True
        sys.stderr.write(f"[moekv] rank {_monitor.rank}: this error may follow from an earlier failure, "
                         f"{first.splitlines()[0]}\n")
        _flush()


def check_healthy() -> None:
    """Raise ExpertParallelError if any rank is known to have failed (call before a collective)."""
    if _monitor is None:
        return
    failure = _monitor.failure
    if failure is None and _monitor.failed_here:
        failure = f"rank {_monitor.rank}: an earlier error"
    if failure is not None:
        raise ExpertParallelError("the expert-parallel group cannot continue after a failure: "
                                  f"{failure.splitlines()[0]}; restart every rank")


@contextmanager
def collective_section(where: str, unreported: tuple[type[BaseException], ...] = ()):
    """Around code that runs collectives in lockstep with the other ranks: refuse to start on a
    broken group, and report any exception that escapes (the others are, or will be, waiting).
    `unreported`: exception types every rank raises alike at the same point (e.g. a ConfigError
    from the shared configuration), which leave nobody waiting."""
    check_healthy()
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, unreported):
            report_failure(exc, where)
        raise


def failed() -> bool:
    return _monitor is not None and (_monitor.failure is not None or _monitor.failed_here)


_previous_excepthook = None


def _install_excepthook() -> None:
    """An uncaught exception on a rank (model build, a script's own code) is reported to the others
    after Python has printed it."""
    global _previous_excepthook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook

    def hook(exc_type, exc, tb):
        _previous_excepthook(exc_type, exc, tb)
        _flush()
        if exc is not None and not isinstance(exc, (SystemExit,)):
            if exc.__traceback__ is None:
                exc = exc.with_traceback(tb)
            report_failure(exc, "uncaught on this rank")

    sys.excepthook = hook

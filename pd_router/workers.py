"""``pd-router --workers N``: N router processes on one listening socket, kept at N.

The parent binds the socket (``cli.listen``) and forks the workers, which inherit it; the
kernel hands each new connection to one of them. Fork rather than spawn: a forked worker
has the socket, the parsed settings and the imported modules already and starts at once,
where a spawned one would import everything again (a second of CPU on a small host, each
restart included) and need the socket passed to it. Forking is safe because the parent
never holds a thread or an event loop: it only waits for signals, synchronously, from the
first fork to the last.

Each worker is a whole router, with its own client of the shared pool (``--state``: its
own id and lease in Redis) and its own health prober: N times the probes, and a node's
state is each worker's own. Linux only (``sigtimedwait``, ``prctl``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NoReturn

log = logging.getLogger("pd_router.workers")

# Enough for any host a router runs on; a typo (--workers 800) is refused, not forked.
MAX_WORKERS = 64
RESTART_DELAY = 1.0
# A worker slot is started at most this often in any minute, the first start included, so
# that a worker dying at start-up costs a few forks a minute and not a core.
STARTS_PER_MINUTE = 5
MINUTE = 60.0

_SIGNALS = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
_PR_SET_PDEATHSIG = 1


def supervise(count: int, work: Callable[[int], None], sock: socket.socket) -> int:
    """Run ``work(K)`` in worker processes K = 1..count, each started again when it ends on
    its own, until SIGTERM or SIGINT, which every worker is sent. ``sock`` is the socket
    they serve, closed here once none will be started again. Returns the exit status: 0
    if every worker ended well after the signal."""
    # Blocked and taken with sigtimedwait rather than handled: the loop below is all the
    # parent does, and a handler running between two of its steps would be a second one.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        return _Supervisor(work, mask, sock).run(count)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def tag_logs(worker: int, fmt: str) -> None:
    """Mark this process's log lines with its worker number: a ``worker`` key in JSON, and in
    text ``worker=K`` first in the message, as the request lines write their fields."""

    def tag(record: logging.LogRecord) -> bool:
        if fmt == "json":
            setattr(record, "fields", {"worker": worker, **getattr(record, "fields", {})})
        else:
            record.msg = f"worker={worker} {record.msg}"
        return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(tag)


class _Supervisor:
    def __init__(
        self, work: Callable[[int], None], mask: Iterable[int], sock: socket.socket
    ) -> None:
        self.work = work
        self.mask = mask
        self.sock = sock
        self.running: dict[int, int] = {}  # pid: worker
        self.due: dict[int, float] = {}  # worker: when to start it again
        self.starts: dict[int, deque[float]] = {}
        self.stopping: set[int] = set()  # the signals sent to the workers
        self.failed = False

    def run(self, count: int) -> int:
        for worker in range(1, count + 1):
            self.starts[worker] = deque(maxlen=STARTS_PER_MINUTE)
            self.start(worker)
        while self.running or self.due:
            soonest = min(self.due.values(), default=None)
            info: signal.struct_siginfo | None
            if soonest is None:
                info = signal.sigwaitinfo(_SIGNALS)
            else:
                info = signal.sigtimedwait(_SIGNALS, max(0.0, soonest - time.monotonic()))
            if info is not None and info.si_signo == signal.SIGCHLD:
                self.reap()
            elif info is not None:
                self.stop(info.si_signo)
            now = time.monotonic()
            for worker in [w for w, when in self.due.items() if when <= now]:
                del self.due[worker]
                self.start(worker)
        log.info("all workers exited")
        return 1 if self.failed else 0

    def start(self, worker: int) -> None:
        self.starts[worker].append(time.monotonic())
        # Whatever is buffered would be written again by the worker.
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            self.restart_later(worker, f"could not be started ({exc})")
            return
        if pid == 0:
            _be_worker(worker, self.work, parent, self.mask)
        self.running[pid] = worker
        log.info("worker %d started (pid %d)", worker, pid)

    def reap(self) -> None:
        for pid, worker in list(self.running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            del self.running[pid]
            code = os.waitstatus_to_exitcode(status)
            if not self.stopping:
                self.restart_later(worker, f"(pid {pid}) {_ended(code)}")
            # Killed by the signal sent: it had not yet set up the graceful handling of it,
            # so it had nothing to drain.
            elif code != 0 and -code not in self.stopping:
                self.failed = True
                log.error("worker %d (pid %d) %s while stopping", worker, pid, _ended(code))

    def restart_later(self, worker: int, what: str) -> None:
        starts = self.starts[worker]
        delay = RESTART_DELAY
        if len(starts) == starts.maxlen:
            delay = max(delay, starts[0] + MINUTE - time.monotonic())
        log.error("worker %d %s; starting it again in %.1f s", worker, what, delay)
        self.due[worker] = time.monotonic() + delay

    def stop(self, sig: int) -> None:
        log.info("%s: stopping %d workers", signal.Signals(sig).name, len(self.running))
        self.stopping.add(sig)
        self.due.clear()
        # As a single router does: new connections refused at once once the workers close
        # theirs, rather than queued for no one until the parent exits.
        self.sock.close()
        # An exited worker stays a zombie until reaped: its PID cannot be anyone else's yet.
        for pid in self.running:
            os.kill(pid, sig)


def die_with_parent(parent: int) -> None:
    """This process gets SIGTERM when ``parent``, the one that forked it, ends (even by
    SIGKILL: the kernel sends it; more precisely when the thread that forked it ends); one
    whose parent ended already exits at once. Linux only (``prctl``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        raise SystemExit(0)  # it was gone before the request


def _be_worker(
    worker: int, work: Callable[[int], None], parent: int, mask: Iterable[int]
) -> NoReturn:
    code = 1
    try:
        # Out of the terminal's process group: Ctrl-C reaches the parent alone, which
        # passes it on once; uvicorn takes a second SIGINT for "stop now, don't drain".
        os.setsid()
        # A worker left without its parent (SIGKILL, the OOM killer) would hold the port,
        # unsupervised: the kernel sends it SIGTERM, and it drains and exits.
        die_with_parent(parent)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        work(worker)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:
        log.exception("worker %d failed", worker)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Not SystemExit: the parent's stack is not the worker's to unwind (its finally
        # blocks, atexit, the demo's engines).
        os._exit(code)


def _ended(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"

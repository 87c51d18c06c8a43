"""Start and stop simulated engines as subprocesses, from tests and demos.

Blocking and standard-library only, so it works from any test style (sync, anyio, trio).
It only runs this package's own engines (fixed argv, no shell), and stops each one
by its own PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess  # nosec B404
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Self

Role = Literal["prefill", "decode"]

_HOST = "127.0.0.1"
_BIND_RETRIES = 3


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def listens(pid: int, port: int, protocol: Literal["tcp", "udp"] = "tcp") -> bool:
    """Whether ``pid``, or a process it started, holds the socket bound to ``port`` (TCP:
    listening), from Linux's /proc; elsewhere, assumed. A server's answer on a port picked
    for it may come from another test's, which took the port first."""
    if not Path(f"/proc/net/{protocol}").exists():
        return True
    # TCP_LISTEN; a bound UDP socket is TCP_CLOSE.
    state = "0A" if protocol == "tcp" else "07"
    bound: set[str] = set()
    for table in (f"/proc/net/{protocol}", f"/proc/net/{protocol}6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            # local address (hex ip:port), remote address, state, ..., inode
            fields = row.split()
            if fields[3] == state and int(fields[1].rsplit(":", 1)[1], 16) == port:
                bound.add(f"socket:[{fields[9]}]")
    pending = [pid]
    while pending:
        proc = Path(f"/proc/{pending.pop()}")
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in bound:
                    return True
            for task in (proc / "task").iterdir():
                pending.extend(int(child) for child in (task / "children").read_text().split())
        except OSError:
            continue  # it exited meanwhile, or a descriptor closed as it was read
    return False


class ServerProcess:
    """A local HTTP server in its own process on 127.0.0.1, healthy when GET /health is 200.

    Subclasses say how to start it (``command``); this class owns its PID and its log.
    """

    name = "server"
    # Set for a server that speaks HTTPS: how to reach it (its CA, a client certificate).
    tls: ssl.SSLContext | None = None
    # Run in the child before the server's program (``subprocess.Popen``'s ``preexec_fn``):
    # the demo's has the kernel end it with the demo, SIGKILL included.
    preexec: Callable[[], None] | None = None

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        *,
        port: int | None = None,
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.extra_args = list(extra_args)
        # Variables set for the process on top of this one's environment.
        self.env = dict(env or {})
        # A port picked here may be grabbed by someone else before the engine binds it;
        # only then is it safe to retry with another one.
        self._port_is_ours = port is None
        self.port = port if port is not None else free_port()
        self._keep_log = log_path is not None
        # A temporary log is made at start() so that an engine never started leaves no file.
        self.log_path: Path | None = Path(log_path) if log_path is not None else None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://{_HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> Self:
        if self._process is not None:
            raise RuntimeError(f"{self.name} on port {self.port} already started")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="pd-router-sim-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(  # nosec B603
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env} if self.env else None,
                preexec_fn=self.preexec,
            )
        return self

    def log(self) -> str:
        """What the engine printed (warnings and errors only)."""
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Block until GET /health answers 200; raises RuntimeError with the engine's log.

        The default is generous because a healthy process returns as soon as it answers,
        and a CI run saw a router print nothing for its first 20 s while the machine
        stalled."""
        deadline = time.monotonic() + timeout
        attempts = 1
        while True:
            if self._process is None:
                raise RuntimeError("engine not started")
            code = self._process.poll()
            if code is not None:
                if (
                    self._port_is_ours
                    and attempts < _BIND_RETRIES
                    and "address already in use" in self.log().lower()
                ):
                    attempts += 1
                    self._process = None
                    self.port = free_port()
                    self.start()
                    continue
                raise RuntimeError(
                    f"{self.name} exited with {code} before it was healthy:\n{self.log()}"
                )
            try:
                health = f"{self.url}/health"
                with _open("GET", health, None, timeout=1.0, context=self.tls) as response:
                    if response.status == 200 and listens(self._process.pid, self.port):
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} on port {self.port} not healthy after {timeout}s:\n"
                    f"{self.log()}"
                )
            time.sleep(0.05)

    def wait_exit(self, timeout: float) -> int | None:
        """Wait for the process to exit by itself (after a signal it was sent, say): its exit
        code, or None if it still ran after ``timeout``. Unlike ``stop`` it sends nothing: a
        second SIGTERM to a router finishing a graceful shutdown would kill it."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 5.0) -> int | None:
        """Terminate this PID, kill it if it lingers past ``timeout``, reap it; its exit code."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
        if not self._keep_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None
        return code

    def kill(self) -> None:
        """SIGKILL this PID, as a crash would, and reap it; the log is kept for a restart."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, port={self.port}, pid={self.pid})"


class EngineProcess(ServerProcess):
    """One simulated engine (``python -m pd_router.sim ROLE``)."""

    def __init__(
        self,
        role: Role,
        extra_args: Sequence[str] = (),
        *,
        port: int | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        super().__init__(extra_args, port=port, log_path=log_path)
        self.role: Role = role
        self.name = f"{role} engine"

    @property
    def engine_id(self) -> str:
        """The engine id, unless ``--engine-id`` in extra_args overrides it."""
        if "--engine-id" in self.extra_args:
            return self.extra_args[self.extra_args.index("--engine-id") + 1]
        return f"sim-{self.role}-{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "pd_router.sim",
            self.role,
            "--host",
            _HOST,
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def stats(self) -> dict[str, Any]:
        return _call("GET", f"{self.url}/sim/stats", context=self.tls)

    def configure(self, **changes: Any) -> dict[str, Any]:
        """POST /sim/config; returns the engine's whole config afterwards."""
        return _call("POST", f"{self.url}/sim/config", changes, context=self.tls)

    def reset(self) -> dict[str, Any]:
        """Zero the counters and forget request ids; pinned blocks stay."""
        return _call("POST", f"{self.url}/sim/reset", {}, context=self.tls)


class RouterProcess(ServerProcess):
    """``python -m pd_router`` in front of the given engines, on 127.0.0.1."""

    name = "router"

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *args: str,
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        super().__init__(
            ["--prefill", *prefill, "--decode", *decode, *args], env=env, log_path=log_path
        )

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "pd_router", "--host", _HOST, "--port", str(self.port)]
        return [*argv, *self.extra_args]


class SimFleet:
    """N prefill and M decode engines, started together and all healthy inside ``with``;
    with ``models``, N and M for each of them (grouped by model, in the given order)."""

    def __init__(
        self,
        prefill: int = 1,
        decode: int = 1,
        *,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        models: Sequence[str] = (),
        startup_timeout: float = 30.0,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.prefill: list[EngineProcess] = []
        self.decode: list[EngineProcess] = []
        # No model named: the engines' own default.
        for named in [["--model", model] for model in models] or [[]]:
            self.prefill += [
                EngineProcess("prefill", [*prefill_args, *named]) for _ in range(prefill)
            ]
            self.decode += [EngineProcess("decode", [*decode_args, *named]) for _ in range(decode)]
        for engine in self.engines:
            engine.preexec = preexec
        self.startup_timeout = startup_timeout

    @property
    def engines(self) -> list[EngineProcess]:
        return [*self.prefill, *self.decode]

    def start(self) -> SimFleet:
        try:
            # Start every process first so that their imports overlap.
            for engine in self.engines:
                engine.start()
            for engine in self.engines:
                engine.wait_healthy(self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()

    def reset(self) -> None:
        for engine in self.engines:
            engine.reset()

    def __enter__(self) -> SimFleet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _open(
    method: str,
    url: str,
    payload: object,
    timeout: float,
    context: ssl.SSLContext | None = None,
) -> Any:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("content-type", "application/json")
    # Only ever http(s)://127.0.0.1 URLs built above.
    return urllib.request.urlopen(request, timeout=timeout, context=context)  # nosec B310


def _call(
    method: str,
    url: str,
    payload: object = None,
    timeout: float = 10.0,
    context: ssl.SSLContext | None = None,
) -> dict[str, Any]:
    try:
        with _open(method, url, payload, timeout, context) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise RuntimeError(f"{method} {url} answered {exc.code}: {detail}") from None

"""A real ``redis-server`` for tests: 127.0.0.1 only, a free port, no persistence (a replica
of another if asked).

``RedisServer`` is a context manager; ``stop()`` and ``kill()`` end it (by its PID only),
``start()`` brings it back on the same port, with no data unless ``persistence``, as
after a restart. The ``redis_server`` fixture (``tests/conftest.py``) is one server per
test module; a test that stops, kills or freezes its server starts its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess  # nosec B404
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import anyio
import anyio.abc
import trustme
from anyio.abc import SocketStream

from pd_router.sim.fleet import free_port, listens

MISSING = (
    "redis-server is not on PATH: these tests need a real Redis. `.ci/run` installs it "
    "(apt-get install redis-server); on Debian or Ubuntu run that yourself."
)
START_SECONDS = 10.0
STOP_SECONDS = 5.0


class RedisServer:
    def __init__(
        self,
        *,
        password: str | None = None,
        persistence: bool = False,
        tls: trustme.LeafCert | None = None,
        debug: bool = False,
        replica_of: int | None = None,
    ) -> None:
        """``debug``: DEBUG SLEEP and the other DEBUG commands allowed (a test's faults).
        ``replica_of``: a replica of the server on that port of 127.0.0.1 (a failover's)."""
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError(MISSING)
        self.executable = executable
        self.password = password
        self.persistence = persistence
        self.tls = tls
        self.debug = debug
        self.replica_of = replica_of
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="pd-router-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.process is not None, "the server is not running"
        return self.process.pid

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self) -> None:
        """Start (again, on the same port); returns once it answers PING."""
        assert self.process is None, "already running"
        args = [
            self.executable,
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--dir", str(self.dir),
            "--daemonize", "no",
        ]  # fmt: skip
        if not self.persistence:
            args += ["--save", "", "--appendonly", "no"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.debug:
            args += ["--enable-debug-command", "yes"]
        if self.replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            cert, key = self.dir / "cert.pem", self.dir / "key.pem"
            self.tls.cert_chain_pems[0].write_to_path(str(cert))
            self.tls.private_key_pem.write_to_path(str(key))
            args += ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
            args += ["--tls-auth-clients", "no"]
        with open(self.dir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(  # nosec B603
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self._wait_until_it_answers()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within STOP_SECONDS."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
        process.wait(STOP_SECONDS)

    def kill(self) -> None:
        """SIGKILL: the server's sockets close at once, with no goodbye."""
        assert self.process is not None, "the server is not running"
        process, self.process = self.process, None
        os.kill(process.pid, signal.SIGKILL)
        process.wait(STOP_SECONDS)

    def log(self) -> str:
        return (self.dir / "redis.log").read_text(errors="replace")

    def _wait_until_it_answers(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            if self._answers_ping() and listens(self.process.pid, self.port):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"redis-server on 127.0.0.1:{self.port} did not answer PING within "
            f"{START_SECONDS:g} s; its log:\n{self.log()[-2000:]}"
        )

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                if self.tls is None:
                    return self._pong(sock)
                # Whether it answers, not who it is: the tests check certificates.
                context = ssl._create_unverified_context()
                with context.wrap_socket(sock) as tls_sock:
                    return self._pong(tls_sock)
        except OSError:
            return False

    @staticmethod
    def _pong(sock: socket.socket) -> bool:
        sock.sendall(b"PING\r\n")
        # +PONG, or -NOAUTH when a password is required: either way, it serves.
        return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))


def _left() -> contextlib.AbstractContextManager[None]:
    """A side of a proxied connection that ended by a reset (a router closes a connection
    whose reply it cannot use) or while the other side closed it: the connection's end,
    not the proxy's failure."""
    return contextlib.suppress(
        anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionResetError
    )


class DroppingProxy:
    """A TCP proxy to Redis that, while ``dropping``, forwards commands but closes the
    client's connection instead of forwarding a reply: the call ran, its reply is lost.
    While ``lying`` (bytes), it forwards those instead of each reply (``lied`` counts them),
    as a proxy or a server that is not Redis might.
    A connection that forwards a command holding ``holding`` (bytes) forwards nothing back
    from then on and stays open, as a link the network stopped answering on, until
    ``let_go``. While ``delaying`` (an event), what a client sends is forwarded only once
    that event is set (``delayed`` counts it; ``forwarded_late`` once it went), even after
    the client gave up and closed: a command that reaches Redis late, when the test says.
    New connections go to ``port`` as it is then: set it, and clients fail over as they
    would behind Sentinel or a DNS name."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.dropping = False
        self.dropped = 0
        self.delaying: anyio.Event | None = None
        self.delayed = 0
        self.forwarded_late = 0
        self.lying: bytes | None = None
        self.lied = 0
        self.holding: bytes | None = None
        self.held = 0
        self._let_go = anyio.Event()

    def let_go(self) -> None:
        """The connections held are closed."""
        self._let_go.set()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
        await listener.serve(self._relay)

    async def _relay(self, client: SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", self.port) as upstream:
            async with anyio.create_task_group() as tg:

                stuck = False

                async def forward() -> None:
                    nonlocal stuck
                    with _left():
                        async for data in client:
                            if self.holding is not None and self.holding in data:
                                stuck = True
                            if self.delaying is not None:
                                until = self.delaying
                                self.delayed += 1
                                with anyio.CancelScope(shield=True):
                                    await until.wait()
                                    await upstream.send(data)
                                self.forwarded_late += 1
                                continue
                            await upstream.send(data)
                    tg.cancel_scope.cancel()

                tg.start_soon(forward)
                with _left():
                    async for data in upstream:
                        if stuck:
                            self.held += 1
                            await self._let_go.wait()
                            break
                        if self.dropping:
                            self.dropped += 1
                            break
                        if self.lying is not None:
                            self.lied += 1
                            data = self.lying
                        await client.send(data)
                tg.cancel_scope.cancel()

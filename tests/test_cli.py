"""The command line's first five minutes: bad values refused in one line before anything
starts, a taken port refused with a hint (and no engines left behind by the demo),
``--port 0``. The real CLI runs as a subprocess."""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess  # nosec B404
import sys
import time
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

# Engines nobody listens on: enough for the router to start, or to refuse other flags.
ENGINES = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
IN_USE = "address already in use; pass --port to choose another (or --port 0 for any free port)"


def environment(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """This environment without the tester's own PD_ROUTER_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_ROUTER_")}
    return {**env, **extra}


def run(*argv: str, env: Mapping[str, str] = {}) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # nosec B603
        [sys.executable, "-m", "pd_router", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=environment(env),
    )


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a start refused with exit 2; before it only argparse's usage."""
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    *usage, last = done.stderr.splitlines()
    assert ": error: " in last, done.stderr
    assert all(line.startswith(("usage: ", " ")) for line in usage), done.stderr
    return last


def listening(family: socket.AddressFamily, host: str) -> socket.socket:
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} here")
    sock.listen()
    return sock


def marked(mark: str) -> list[int]:
    """Live processes that inherited ``mark`` in their environment from a test's command."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue  # someone else's, or gone meanwhile
    return pids


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (
            [*ENGINES, "--port", "70000"],
            {},
            "pd-router: error: argument --port: must be a whole number from 0 to 65535 "
            "(0: any free port), got '70000'",
        ),
        (
            [*ENGINES],
            {"PD_ROUTER_PORT": "-1"},
            "pd-router: error: PD_ROUTER_PORT: must be a whole number from 0 to 65535",
        ),
        (
            [*ENGINES, "--connect-timeout", "0"],
            {},
            "pd-router: error: argument --connect-timeout: must be a number of seconds > 0",
        ),
        (
            ["demo", "--ttft", "-1"],
            {},
            "pd-router demo: error: argument --ttft: must be a number of seconds >= 0, got '-1'",
        ),
        (
            ["demo", "--itl", "-1"],
            {},
            "pd-router demo: error: argument --itl: must be a number of seconds >= 0, got '-1'",
        ),
        (
            ["demo", "--decode-nodes", "0"],
            {},
            "pd-router demo: error: argument --decode-nodes: must be a whole number >= 1, got '0'",
        ),
        (
            ["demo", "--port", "65536"],
            {},
            "pd-router demo: error: argument --port: must be a whole number from 0 to 65535",
        ),
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    assert refusal(run(*argv, env=env)).startswith(expected)


@pytest.mark.parametrize(
    ("family", "host", "shown"),
    [(socket.AF_INET, "127.0.0.1", "127.0.0.1"), (socket.AF_INET6, "::1", "[::1]")],
)
def test_a_taken_port_is_one_line_with_a_hint(
    family: socket.AddressFamily, host: str, shown: str
) -> None:
    with listening(family, host) as taken:
        port = taken.getsockname()[1]
        done = run(*ENGINES, "--host", host, "--port", str(port))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"pd-router: error: cannot listen on {shown}:{port}: {IN_USE}\n"


def test_the_demo_on_a_taken_port_starts_no_engine() -> None:
    mark = f"pd-router-test-cli-{uuid.uuid4().hex}"
    seen: set[int] = set()
    with listening(socket.AF_INET, "127.0.0.1") as taken:
        port = taken.getsockname()[1]
        demo = subprocess.Popen(  # nosec B603
            [sys.executable, "-m", "pd_router", "demo", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment({"CLI_TEST_MARK": mark}),
        )
        # Watched while it runs: engines started, then stopped on the way out, would leave
        # no trace afterwards.
        deadline = time.monotonic() + 30
        while demo.poll() is None and time.monotonic() < deadline:
            seen.update(marked(mark))
            time.sleep(0.01)
        if demo.poll() is None:
            demo.kill()
        stdout, stderr = demo.communicate()
    engines = sorted(seen - {demo.pid})
    for pid in marked(mark):
        os.kill(pid, signal.SIGKILL)
    assert engines == [], "the demo started simulated engines"
    # No banner: it is printed once the engines are up.
    assert demo.returncode == 2 and stdout == ""
    assert stderr == f"pd-router demo: error: cannot listen on 127.0.0.1:{port}: {IN_USE}\n"


class Running:
    """The CLI as a process of ours, its output read as it comes."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] = {}) -> None:
        self.process = subprocess.Popen(  # nosec B603
            [sys.executable, "-m", "pd_router", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=environment(env),
        )
        self.output = {"stdout": b"", "stderr": b""}

    def wait_for(self, stream: str, pattern: str, timeout: float = 20.0) -> re.Match[bytes]:
        """The first match of ``pattern`` in what the process wrote to ``stream``."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for name in self.output:
                selector.register(getattr(self.process, name), selectors.EVENT_READ, name)
            while not (found := re.search(pattern.encode(), self.output[stream])):
                left = deadline - time.monotonic()
                assert left > 0, f"no {pattern!r} in {self.output}"
                for key, _ in selector.select(left):
                    self.output[key.data] += os.read(key.fd, 65536)
                assert self.process.poll() is None, f"exited early: {self.output}"
        return found

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=20)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        assert self.process.stdout is not None and self.process.stderr is not None
        self.process.stdout.close()
        self.process.stderr.close()
        return code


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:  # nosec B310
        body: bytes = response.read()
        return body


@pytest.mark.parametrize(("host", "shown"), [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_port_0_serves_and_logs_the_port_it_got(host: str, shown: str) -> None:
    if host == "::1":
        listening(socket.AF_INET6, host).close()  # skips without IPv6
    router = Running([*ENGINES, "--host", host, "--port", "0", "--health-interval", "0"])
    try:
        port = int(router.wait_for("stderr", rf"listening on http://{re.escape(shown)}:(\d+)")[1])
        assert port != 0
        assert b"pd_router_queue_depth" in get(f"http://{shown}:{port}/metrics")
    finally:
        assert router.stop() == 0

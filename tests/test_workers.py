"""``pd-router --workers N``: the real CLI as a subprocess, in front of simulated engines and
a real Redis. Both workers serve; more than one worker needs ``--state``; a killed worker is
started again while the other serves on; SIGTERM drains every worker and leaves no process;
a worker dying at start-up is started a bounded number of times a minute."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess  # nosec B404
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd_router.edge.protocol import LINGER
from pd_router.sim.fleet import SimFleet
from tests.helpers import RawClient, RouterProcess, wait_for
from tests.redis_server import RedisServer

SHORT = {"model": "sim-model", "prompt": "hello workers", "max_tokens": 4}
SHUTDOWN = 10.0
# Starting a router, or a worker again, on two cores that a test suite also loads.
START = 30.0
NEEDS_STATE = (
    "pd-router: error: --workers 2 needs --state: without a shared pool each worker would "
    "count the slots on its own\n"
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=1, decode_args=["--slots", "64", "--itl", "0.02"]) as engines:
        yield engines


@contextmanager
def workers(fleet: SimFleet, redis: RedisServer) -> Iterator[RouterProcess]:
    """The router with two workers, once both have joined the shared pool."""
    router = RouterProcess(
        [e.url for e in fleet.prefill],
        [e.url for e in fleet.decode],
        "--workers", "2",
        "--state", redis.url,
        "--decode-slots", "16",
        "--shutdown-timeout", str(SHUTDOWN),
    )  # fmt: skip
    with router:
        wait_for(lambda: len(ready(router)) == 2, timeout=START, what="both workers ready")
        yield router


def ready(router: RouterProcess) -> dict[int, int]:
    """Worker number: PID, for the workers whose latest start has reached the shared pool."""
    started: dict[int, int] = {}
    joined: dict[int, int] = {}
    for line in router.log().splitlines():
        if found := re.search(r"worker=(\d+) Started server process \[(\d+)\]", line):
            started[int(found[1])] = int(found[2])
            joined.pop(int(found[1]), None)
        elif found := re.search(r"worker=(\d+) shared state available", line):
            joined[int(found[1])] = started[int(found[1])]
    return joined


def served_by(router: RouterProcess) -> list[int]:
    """The worker of each request line logged so far."""
    return [int(w) for w in re.findall(r"pd_router\.access: worker=(\d+) request ", router.log())]


def post(url: str, attempts: int = 1) -> int:
    """A request on a connection of its own; its status. A connection a killed worker took
    ends without an answer: that one is tried again, up to ``attempts`` in all."""
    for _ in range(attempts - 1):
        try:
            return httpx.post(f"{url}/v1/completions", json=SHORT, timeout=30).status_code
        except httpx.TransportError:
            pass
    return httpx.post(f"{url}/v1/completions", json=SHORT, timeout=30).status_code


def alive(pid: int) -> bool:
    """Running, or stopped: anything but gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_both_workers_serve(fleet: SimFleet, redis_server: RedisServer) -> None:
    with workers(fleet, redis_server) as router:
        pids = ready(router)
        assert sorted(children(router.pid or 0)) == sorted(pids.values())
        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(lambda _: post(router.url), range(40)))
        assert statuses == [200] * 40
        wait_for(lambda: len(served_by(router)) == 40, what="40 request lines")
        assert set(served_by(router)) == {1, 2}
        # The engines are probed once for the fleet, not once per worker.
        assert len(re.findall(r"worker=\d .*probes the engines for the fleet", router.log())) == 1


def test_every_scrape_shows_every_workers_series_whichever_worker_answers(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    """The kernel gives each connection to either worker: a scrape answered by one worker
    with its own counts alone went 8, 8, 2, 8 for 10 requests (a counter reset each time)."""
    with workers(fleet, redis_server) as router:
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda _: post(router.url), range(20))) == [200] * 20
        wait_for(lambda: set(served_by(router)) == {1, 2}, what="both workers serving")
        answered_by = set()
        deadline = time.monotonic() + START
        scrapes: list[dict[str, float]] = []
        while len(answered_by) < 2 or len(scrapes) < 6:
            assert time.monotonic() < deadline, f"scrapes answered by {answered_by}: {scrapes}"
            with httpx.Client() as client:  # a connection of its own: either worker's
                answered_by.add(client.get(f"{router.url}/health").json()["worker"])
            with httpx.Client() as client:
                text = client.get(f"{router.url}/metrics").text
            ok: dict[str, float] = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if (
                        sample.name == "pd_router_requests_total"
                        and sample.labels["outcome"] == "ok"
                        and sample.labels["endpoint"] == "completions"
                    ):
                        ok[sample.labels["worker"]] = sample.value
            scrapes.append(ok)
            if sum(ok.values()) < 20:
                time.sleep(0.2)  # a worker's file is at most a second old
                scrapes.pop()
        assert answered_by == {1, 2}
        assert all(set(ok) == {"1", "2"} and sum(ok.values()) == 20 for ok in scrapes), scrapes


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--workers", "2"], NEEDS_STATE),
        (
            ["--workers", "65", "--state", "redis://127.0.0.1:9"],
            "pd-router: error: argument --workers: must be a whole number >= 1 and <= 64, "
            "got '65'\n",
        ),
        (
            ["--workers", "0"],
            "pd-router: error: argument --workers: must be a whole number >= 1 and <= 64, "
            "got '0'\n",
        ),
    ],
)
def test_bad_workers_are_refused_in_one_line(argv: list[str], expected: str) -> None:
    engines = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_ROUTER_")}
    done = subprocess.run(  # nosec B603
        [sys.executable, "-m", "pd_router", *engines, *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines(keepends=True)[-1] == expected
    if expected == NEEDS_STATE:
        assert done.stderr == expected, "one line, no usage"


def test_one_worker_is_the_single_process(fleet: SimFleet) -> None:
    with RouterProcess([e.url for e in fleet.prefill], [e.url for e in fleet.decode]) as router:
        assert post(router.url) == 200
        assert children(router.pid or 0) == []
        assert "worker" not in router.log()


def test_a_killed_worker_is_started_again_and_the_router_serves_throughout(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    with workers(fleet, redis_server) as router:
        before = ready(router)
        statuses: list[int] = []
        done = threading.Event()

        def load() -> None:
            while not done.is_set():
                statuses.append(post(router.url, attempts=3))

        client = threading.Thread(target=load)
        client.start()
        try:
            wait_for(lambda: len(statuses) >= 5, what="requests before the kill")
            os.kill(before[1], signal.SIGKILL)
            wait_for(
                lambda: ready(router).get(1, before[1]) != before[1],
                timeout=START,
                what="worker 1 started again",
            )
            after = ready(router)
            count = len(statuses)
            wait_for(
                lambda: len(statuses) >= count + 10,
                timeout=START,
                what="requests after the restart",
            )
        finally:
            done.set()
            client.join(30)
        assert statuses and set(statuses) == {200}
        assert after[2] == before[2], "worker 2 was left alone"
        assert parent_of(after[1]) == router.pid
        assert not alive(before[1])
        line = f"worker 1 (pid {before[1]}) was killed by SIGKILL; starting it again in 1.0 s"
        assert line in router.log()


def test_sigterm_drains_every_worker_and_leaves_no_process(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    with workers(fleet, redis_server) as router:
        pids = ready(router).values()
        body = {**SHORT, "max_tokens": 250, "stream": True}  # 5 s at 0.02 s a token
        stream = RawClient(router.url, "/v1/completions", body)
        stream.read_until(b"data: ")
        assert router.pid is not None
        os.kill(router.pid, signal.SIGTERM)
        signalled = time.monotonic()
        host, port = router.url.removeprefix("http://").split(":")
        wait_for(lambda: refused(host, int(port)), what="new connections refused")
        assert "stream=True" not in router.log(), "refused while the stream still drains"
        received = stream.read_all()
        assert b"data: [DONE]" in received and received.endswith(b"\r\n0\r\n\r\n"), received
        assert b'"error"' not in received
        code = router.wait_exit(SHUTDOWN + LINGER + 5)
        assert code == 0, router.log()
        assert time.monotonic() - signalled < SHUTDOWN + LINGER + 5
        assert [pid for pid in pids if alive(pid)] == []
        assert "SIGTERM: stopping 2 workers" in router.log()
        assert "all workers exited" in router.log()


def test_workers_do_not_outlive_a_killed_parent(fleet: SimFleet, redis_server: RedisServer) -> None:
    with workers(fleet, redis_server) as router:
        pids = ready(router).values()
        # Where the workers' series meet for /metrics: the parent's, removed by the last
        # worker out when the parent cannot.
        (metrics,) = Path(tempfile.gettempdir()).glob(f"pd-router-metrics-{router.pid}-*")
        router.kill()
        wait_for(
            lambda: not any(alive(pid) for pid in pids),
            timeout=SHUTDOWN + LINGER + 5,
            what="the workers gone with their parent",
        )
        assert not metrics.exists()


CRASHING = """
import socket
import sys
from pd_router.ops import logs
from pd_router import workers
workers.RESTART_DELAY = 0.05
workers.STARTS_PER_MINUTE = 3
logs.configure("info", "text")

def crash(worker):
    sys.exit(3)

sys.exit(workers.supervise(1, crash, socket.socket()))
"""


def test_a_worker_dying_at_start_is_started_a_bounded_number_of_times(tmp_path: Path) -> None:
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "wb") as log:
        supervisor = subprocess.Popen(  # nosec B603
            [sys.executable, "-c", CRASHING], stderr=log, stdin=subprocess.DEVNULL
        )
    try:
        wait_for(lambda: log_path.read_text().count("exited with code 3") == 3, what="3 ends")
        time.sleep(1)  # time for starts beyond the bound, were there any
        text = log_path.read_text()
        assert text.count("worker 1 started") == 3, text
        delays = re.findall(r"exited with code 3; starting it again in ([\d.]+) s", text)
        assert [float(d) < 1 for d in delays] == [True, True, False], text
        assert float(delays[2]) > 55, "the third start was the minute's last"
    finally:
        supervisor.send_signal(signal.SIGTERM)
        code = supervisor.wait(10)
    assert code == 0, "stopped while waiting to start it again: nothing ran, nothing failed"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_workers_lines_name_it(fmt: str) -> None:
    script = (
        "from pd_router import workers\n"
        "from pd_router.ops import logs\n"
        f"logs.configure('info', {fmt!r})\n"
        f"workers.tag_logs(3, {fmt!r})\n"
        "logs.request_finished({'status': 200})\n"
    )
    done = subprocess.run(  # nosec B603
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    if fmt == "json":
        line = json.loads(done.stderr)
        assert line["worker"] == 3 and line["status"] == 200
    else:
        assert done.stderr.rstrip().endswith("pd_router.access: worker=3 request status=200")


STOPPING = """
import signal
import socket
import sys
from pd_router.ops import logs
from pd_router import workers
logs.configure("info", "text")
code = int(sys.argv[1])

def work(worker):
    if code:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(code))
    # Else SIGTERM ends it as it would a worker that had not yet set up its own handling.
    print("serving", flush=True)
    while True:
        signal.pause()

sys.exit(workers.supervise(1, work, socket.socket()))
"""


@pytest.mark.parametrize("code", [0, 5])
def test_the_exit_status_says_whether_a_worker_failed_while_stopping(code: int) -> None:
    """Killed by the SIGTERM passed on is a worker with nothing to drain, no failure (exit
    0); one exiting with an error while stopping makes the supervisor's status 1."""
    supervisor = subprocess.Popen(  # nosec B603
        [sys.executable, "-c", STOPPING, str(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert supervisor.stdout is not None
        assert supervisor.stdout.readline() == "serving\n"
        supervisor.send_signal(signal.SIGTERM)
        _, stderr = supervisor.communicate(timeout=START)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    assert supervisor.returncode == (1 if code else 0), stderr
    assert ("exited with code 5 while stopping" in stderr) == bool(code), stderr
    assert "all workers exited" in stderr


EXITING = """
import socket
import sys
from pd_router import serve, workers
workers.supervise = lambda count, work, sock: int(sys.argv[1])
parser, actions = serve.router_parser()
args = serve.parse_router_args(parser, actions, sys.argv[2:], {})
serve.serve(args, serve.build_router(args), socket.socket())
"""


@pytest.mark.parametrize("code", [0, 1])
def test_the_routers_exit_status_is_its_workers_supervisors(code: int) -> None:
    argv = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
    argv += ["--workers", "2", "--state", "redis://127.0.0.1:9"]
    done = subprocess.run(  # nosec B603
        [sys.executable, "-c", EXITING, str(code), *argv],
        capture_output=True,
        text=True,
        timeout=START,
    )
    assert done.returncode == code, done.stderr

"""Client connection limits, end to end: the router's CLI in front of simulated engines,
clients on raw sockets that send slowly, stall, idle, crowd in, or are cut off by SIGTERM.

Each case checks what the offending client gets (an OpenAI-shaped answer and a closed
connection, within the limit's bound), that the router let go of the request, and that
another client was served meanwhile."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pd_router.sim.fleet import SimFleet
from tests.fleet.test_fleet_e2e import Stream, echo
from tests.helpers import RouterProcess, complete, wait_for

BODY = json.dumps({"model": "sim-model", "prompt": "slow body", "max_tokens": 2}).encode()


# How late a timeout of the router may fire here: each case sets its timeout to 1 s, and
# checks it fires not before, and before this much more (then it would be never, or a
# different clock). A loaded machine has been seen to run a second or two late.
LATE = 20


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=1, decode_args=["--slots", "64", "--itl", "0.05"]) as fleet:
        yield fleet


def router_for(fleet: SimFleet, *args: str) -> RouterProcess:
    urls = ([e.url for e in fleet.prefill], [e.url for e in fleet.decode])
    return RouterProcess(*urls, "--decode-slots", "8", *args)


def connect(router: RouterProcess) -> socket.socket:
    host, port = router.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def head(length: int, method: str = "POST", path: str = "/v1/completions") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def request(body: bytes = BODY) -> bytes:
    return head(len(body)) + body


def read_response(sock: socket.socket, timeout: float = 10) -> tuple[int, dict[str, str], Any]:
    """One response with a Content-Length: status, headers, the JSON body."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection ended before a response head: {data!r}"
        data += chunk
    raw_head, body = data.split(b"\r\n\r\n", 1)
    status_line, *lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "connection ended inside a response body"
        body += chunk
    return int(status_line.split()[1]), headers, json.loads(body)


def ends(sock: socket.socket, timeout: float) -> bytes:
    """Whatever arrives until the router closes the connection; fails after ``timeout``."""
    sock.settimeout(timeout)
    rest = b""
    try:
        while chunk := sock.recv(65536):
            rest += chunk
    except ConnectionResetError:
        pass
    return rest


def drip(sock: socket.socket, seconds: float) -> bytes:
    """Send a byte every 0.1 s until the router answers (or ``seconds`` pass); the answer."""
    sock.settimeout(0.1)
    for _ in range(int(seconds / 0.1)):
        try:
            sock.sendall(b" ")
            return sock.recv(65536)
        except TimeoutError:
            continue
    raise AssertionError(f"no answer after dripping for {seconds} s")


def closed_by(router: RouterProcess, reason: str) -> float:
    return router.metrics()[f"pd_router_client_connections_closed_total{{reason={reason}}}"]


def assert_error(answer: tuple[int, dict[str, str], Any], status: int, code: str) -> None:
    got, headers, body = answer
    assert (got, body["error"]["code"]) == (status, code), answer
    assert headers["connection"] == "close" and body["error"]["message"]


def test_a_slow_head_gets_408_within_the_header_timeout(fleet: SimFleet) -> None:
    with router_for(fleet, "--header-timeout", "1") as router:
        silent = connect(router)
        slow = connect(router)
        started = time.monotonic()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nX-Pad: ")
        assert complete(router, "meanwhile").status_code == 200
        # A byte every 0.1 s: progress, yet the head as a whole is late.
        answer = drip(slow, 1 + LATE)
        answered = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"code":"request_timeout"' in answer
        ends(slow, LATE)
        assert 0.9 < answered < 1 + LATE, answered
        # A connection that sent nothing is closed as quietly as an idle one.
        assert ends(silent, LATE) == b""
        assert time.monotonic() - started < 1 + LATE
        # The head's clock starts at its first byte, not at the previous response.
        with connect(router) as kept:
            kept.sendall(request())
            assert read_response(kept)[0] == 200
            time.sleep(1.5)
            kept.sendall(request())
            assert read_response(kept)[0] == 200
            kept.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nX-Pad: ")
            started = time.monotonic()
            assert drip(kept, 1 + LATE).startswith(b"HTTP/1.1 408 ")
            assert 0.9 < time.monotonic() - started < 1 + LATE
        assert closed_by(router, "header_timeout") == 3
        router.assert_idle()


def test_a_stalled_or_trickling_body_gets_408_and_its_request_ends(fleet: SimFleet) -> None:
    with router_for(fleet, "--body-timeout", "1") as router:
        before = router.metrics()
        stalled = connect(router)
        stalled.sendall(request()[:-10])
        trickling = connect(router)
        trickling.sendall(request()[:-30])
        started = time.monotonic()
        assert complete(router, "meanwhile").status_code == 200
        answer = drip(trickling, 1 + LATE)  # 10 bytes a second: far below 1 KiB/s
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"bytes/s" in answer
        assert_error(read_response(stalled), 408, "request_timeout")
        ends(stalled, LATE)
        ends(trickling, LATE)
        assert time.monotonic() - started < 1 + LATE
        # Both requests ended in the app as a client gone, at once: its receive() said so
        # while these clients still hold their sockets open.
        aborted = "pd_router_requests_total{endpoint=completions,outcome=client_aborted}"
        wait_for(
            lambda: router.metrics()[aborted] - before[aborted] == 2,
            timeout=LATE,
            what="the app to see both clients gone",
        )
        # A body that keeps coming at 8 KiB/s for longer than one window is served.
        padded = BODY[:-1] + b" " * 12_000 + b"}"
        with connect(router) as steady:
            steady.sendall(head(len(padded)))
            for offset in range(0, len(padded), 2048):
                steady.sendall(padded[offset : offset + 2048])
                time.sleep(0.25)
            assert read_response(steady)[0] == 200
        assert closed_by(router, "body_timeout") == 2
        health = httpx.get(f"{router.url}/health", timeout=5).json()
        assert (health["decode_slots_in_use"], health["queue_depth"]) == (0, 0)
        router.assert_idle()


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(fleet: SimFleet) -> None:
    with router_for(fleet, "--idle-timeout", "1", "--header-timeout", "5") as router:
        with connect(router) as kept:
            kept.sendall(request())
            assert read_response(kept)[0] == 200
            time.sleep(0.5)
            kept.sendall(request())  # still open after half the idle timeout
            assert read_response(kept)[0] == 200
            idle_since = time.monotonic()
            assert complete(router, "meanwhile").status_code == 200
            assert ends(kept, 1 + LATE) == b""
            assert 0.9 < time.monotonic() - idle_since < 1 + LATE


def test_connections_over_the_cap_get_503_and_running_streams_finish(fleet: SimFleet) -> None:
    with router_for(fleet, "--max-connections", "4") as router:
        stream = Stream(router, "held open", 60, "cap")  # 3 s of tokens
        stream.start()
        wait_for(lambda: bool(stream.events), what="the stream flowing")
        idle = [connect(router) for _ in range(3)]
        for sock in idle:  # kept alive: connection 2, 3 and 4
            sock.sendall(head(0, "GET", "/health"))
            assert read_response(sock)[0] == 200
        with connect(router) as control:  # beyond the cap, the operator's paths only
            control.sendall(head(0, "GET", "/health"))
            assert read_response(control)[0] == 200
        with connect(router) as refused:
            refused.sendall(head(0, "GET", "/v1/models"))
            answer = read_response(refused)
            assert_error(answer, 503, "too_many_connections")
            assert answer[1]["retry-after"] == "1"
            assert ends(refused, 4) == b""
        over = httpx.get(f"{router.url}/v1/models", timeout=5)
        assert over.status_code == 503
        assert over.json()["error"]["code"] == "too_many_connections"
        stream.join(30)
        assert stream.completed() and stream.text == echo(stream.prompt, 60), stream.events[-2:]
        for sock in idle:
            sock.close()
        wait_for(lambda: complete(router, "room again").status_code == 200, what="served again")
        assert closed_by(router, "too_many_connections") >= 2
        router.assert_idle()


def test_sigterm_does_not_wait_for_a_request_still_being_sent(fleet: SimFleet) -> None:
    shutdown_timeout = 10  # the stream's 2 s of tokens fit, however slow the machine
    with router_for(
        fleet,
        *("--shutdown-timeout", str(shutdown_timeout)),
        *("--body-timeout", "60", "--header-timeout", "60"),
    ) as router:
        stream = Stream(router, "finishing", 40, "term")  # 2 s of tokens
        stream.start()
        wait_for(lambda: bool(stream.events), what="the stream flowing")
        half_body = connect(router)
        half_body.sendall(request()[:-10])
        half_head = connect(router)
        half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n")
        assert complete(router, "meanwhile").status_code == 200
        assert router.pid is not None
        started = time.monotonic()
        os.kill(router.pid, signal.SIGTERM)
        for sock in (half_body, half_head):
            assert_error(read_response(sock, LATE), 503, "shutting_down")
            ends(sock, LATE)
        stream.join(30)
        assert stream.completed() and stream.text == echo(stream.prompt, 40), stream.events[-2:]
        assert router.wait_exit(timeout=shutdown_timeout + LATE) == 0, router.log()[-2000:]
        assert time.monotonic() - started < shutdown_timeout + LATE


def test_sigterm_does_not_wait_for_a_client_that_stopped_reading() -> None:
    # Events of 20 kB as fast as the engine makes them: the router's buffers for a client
    # that reads nothing fill within a second.
    with SimFleet(decode_args=["--slots", "4", "--itl", "0.001"]) as fleet:
        with router_for(fleet, "--shutdown-timeout", "1") as router:
            body = {"model": "sim-model", "prompt": "w" * 20_000, "max_tokens": 4000}
            with connect(router) as deaf:
                deaf.sendall(request(json.dumps({**body, "stream": True}).encode()))
                wait_for(lambda: router.in_use() == 1, what="the stream started")
                time.sleep(1)
                assert router.pid is not None
                started = time.monotonic()
                os.kill(router.pid, signal.SIGTERM)
                # Shutdown timeout, then LINGER (2 s) for the failed stream's last words.
                assert router.wait_exit(timeout=1 + 2 + LATE) == 0, router.log()[-2000:]
                assert time.monotonic() - started < 1 + 2 + LATE


def test_bytes_that_are_not_http_get_an_openai_shaped_400(fleet: SimFleet) -> None:
    """uvicorn's own answer was plain text."""
    with router_for(fleet) as router:
        sock = connect(router)
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, body = read_response(sock)
        assert (status, headers["content-type"]) == (400, "application/json")
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
        assert ends(sock, 5) == b""
        assert complete(router, "after the garbage").status_code == 200


# A stream far longer than any wait here (0.05 s a token): a slot freed before its end was
# freed because its client left.
ENDLESS = json.dumps(
    {"model": "sim-model", "prompt": "endless", "max_tokens": 4000, "stream": True}
).encode()


def streaming(router: RouterProcess, then: bytes = b"") -> socket.socket:
    """A connection whose stream of ``ENDLESS`` has begun, ``then`` sent right behind it."""
    sock = connect(router)
    sock.sendall(request(ENDLESS) + then)
    sock.settimeout(10)
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 "), first
    return sock


def test_a_client_leaving_with_a_request_pipelined_behind_its_stream_frees_its_slot(
    fleet: SimFleet,
) -> None:
    """The client pipelines a second request behind a stream, then leaves mid-stream: the
    stream's request ends as a client gone, its slot freed and its engine let go, as
    without the second request. Before, uvicorn told only the newest request of the
    connection (the queued one): the stream went on into the closed connection until the
    engine finished, its slot held all along, and was logged ``ok``."""
    with router_for(fleet) as router:
        before = router.metrics()
        streaming(router, then=request()).close()
        aborted = "pd_router_requests_total{endpoint=completions,outcome=client_aborted}"
        wait_for(
            lambda: router.metrics()[aborted] - before[aborted] == 1,
            what="the stream's request to end as its client gone",
        )
        router.assert_idle()
        assert complete(router, "after").status_code == 200
        assert "failed inside the router" not in router.log()


def test_bytes_that_are_not_http_behind_a_stream_end_it_without_an_answer_inside_it(
    fleet: SimFleet,
) -> None:
    """Bytes that are not HTTP arrive while a stream is being answered on the connection:
    the connection is closed (the stream's request ends as its client gone), and no 400 is
    written into the stream's body. Before, a 400's head and JSON came in the middle of the
    chunked stream."""
    with router_for(fleet) as router:
        sock = streaming(router)
        sock.sendall(b"BOGUS\x00 / HTTP/1.1\r\n\r\n")
        rest = ends(sock, LATE)
        assert b"HTTP/1.1 400" not in rest and b"invalid_request_error" not in rest, rest[-300:]
        router.assert_idle()
        assert complete(router, "after").status_code == 200


def test_an_h2c_upgrade_offer_gets_a_400_that_says_so(fleet: SimFleet) -> None:
    """``curl --http2`` on http:// offers an upgrade to h2c with its request: the router
    speaks HTTP/1.1 only, and says so. Before, the parser gave the body to the upgrade: a
    valid request got 400 "request body is empty", and the connection answered nothing
    more."""
    body = json.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 2}).encode()
    offer = (
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nConnection: Upgrade, HTTP2-Settings"
        b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with router_for(fleet) as router:
        sock = connect(router)
        sock.sendall(offer)
        status, headers, answer = read_response(sock)
        assert (status, headers["connection"]) == (400, "close")
        assert "HTTP/1.1 only" in answer["error"]["message"], answer
        assert ends(sock, LATE) == b""
        assert complete(router, "after").status_code == 200
        assert "Traceback" not in router.log()

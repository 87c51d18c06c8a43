"""No client can hurt another: each case sends its attack through a real router, and checks
that bystanders were served meanwhile, that the slot counters balance, and that the router's
memory and open files came back within a bound.

The router runs through its CLI in front of a simulated prefill engine and ``LyingEngine``
as its decode engine, which answers bystanders correctly and lies on request. Verdicts on
the node are kept out of the way (``--unhealthy-after 1000``): this suite is about what
clients get, ``test_liveness*`` about what the router concludes of an engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from pd_router.sim.fleet import SimFleet
from tests.helpers import RouterProcess, wait_for
from tests.lying_engine import (
    COMPLETION,
    STREAM,
    STREAM_HEAD,
    Flood,
    Lie,
    LyingEngine,
    chunk,
    endless,
    endless_header,
    endless_trailer,
    error_event,
    events,
    http,
    slowly,
    then,
    token,
)

TOKEN = "adversary"
# What one case may leave behind in the router process, after warm-up.
RSS_BOUND = 96 << 20
FD_BOUND = 16


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) << 10


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def prefill() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=0) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def liar() -> Iterator[LyingEngine]:
    with LyingEngine() as engine:
        yield engine


@pytest.fixture(scope="module")
def router(prefill: SimFleet, liar: LyingEngine) -> Iterator[RouterProcess]:
    args = ["--decode-slots", "4", "--unhealthy-after", "1000", "--admin-token", TOKEN]
    args += ["--max-response-bytes", str(8 << 20), "--queue-timeout", "10"]
    with RouterProcess([prefill.prefill[0].url], [liar.url], *args) as server:
        for _ in range(20):  # warm-up: imports, pools, allocator arenas
            assert httpx.post(f"{server.url}/v1/completions", json=BODY).status_code == 200
        yield server


BODY = {"model": "sim-model", "prompt": "hello pd router", "max_tokens": 2}


def lie(name: str, **extra: Any) -> dict[str, Any]:
    return {**BODY, "prompt": f"lie:{name}", **extra}


class Bystanders(threading.Thread):
    """Normal clients, one request after another (streamed and not) until stopped."""

    def __init__(self, router: RouterProcess) -> None:
        super().__init__(daemon=True)
        self.url = f"{router.url}/v1/completions"
        self.stop = threading.Event()
        self.served = 0
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                stream = self.served % 2 == 1
                response = client.post(self.url, json={**BODY, "stream": stream})
                expected = STREAM if stream else b'" fine"'
                if response.status_code != 200 or expected not in response.content:
                    self.failures.append(f"{response.status_code} {response.text[:200]}")
                self.served += 1


@contextmanager
def attacked(router: RouterProcess) -> Iterator[None]:
    """Bystanders served all along; afterwards the slots balance and resources are back."""
    pid = router.pid
    assert pid is not None
    before_rss, before_fds = rss(pid), fds(pid)
    bystanders = Bystanders(router)
    bystanders.start()
    try:
        yield
        served = bystanders.served
        wait_for(lambda: bystanders.served >= served + 3, timeout=20, what="bystanders")
    finally:
        bystanders.stop.set()
        bystanders.join(30)
    assert bystanders.failures == []
    router.assert_idle()
    wait_for(lambda: fds(pid) <= before_fds + FD_BOUND, what="the router's open files")
    wait_for(lambda: rss(pid) <= before_rss + RSS_BOUND, what="the router's memory")


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    "answer",
    [
        http(204, b"hello", reason="No Content"),
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
        http(999, b"hi"),
        http(302, b"", "location: http://elsewhere/"),
    ],
    ids=["204-with-body", "101", "999", "302"],
)
def test_a_status_no_engine_sends_is_a_502_and_the_clients_connection_lives_on(
    router: RouterProcess, liar: LyingEngine, answer: bytes
) -> None:
    liar.lies["status"] = answer
    with attacked(router), httpx.Client(timeout=10) as client:
        response = client.post(f"{router.url}/v1/completions", json=lie("status"))
        assert response.status_code == 502
        assert "not an answer an engine gives" in error_of(response)["message"]
        again = client.post(f"{router.url}/v1/completions", json=BODY)  # same connection
        assert again.status_code == 200


def test_an_engine_page_is_logged_and_never_passed_on(
    router: RouterProcess, liar: LyingEngine
) -> None:
    page = b"<html><pre>Traceback: File secret_handler.py, line 42</pre></html>"
    liar.lies["page"] = http(500, page, "content-type: text/html")
    liar.lies["json"] = http(400, b'{"error": {"message": "max_tokens is too large"}}')
    with attacked(router):
        response = httpx.post(f"{router.url}/v1/completions", json=lie("page"))
        assert response.status_code == 500
        message = error_of(response)["message"]
        assert message.endswith("HTTP 500") and "secret" not in response.text
        response = httpx.post(f"{router.url}/v1/completions", json=lie("json"))
        assert response.status_code == 400
        assert error_of(response)["message"].endswith("max_tokens is too large")
    assert "secret_handler.py" in router.log()


def test_endless_error_pages_and_answers_are_cut_off_and_cost_no_memory(
    router: RouterProcess, liar: LyingEngine
) -> None:
    """A 50 MiB error page was read whole; a 300 MiB answer took the router to 955 MB."""
    liar.lies["page"] = endless(503)
    liar.lies["answer"] = endless(200)
    with attacked(router):
        for _ in range(3):
            response = httpx.post(f"{router.url}/v1/completions", json=lie("page"), timeout=30)
            assert response.status_code == 503 and error_of(response)["message"].endswith("503")
            response = httpx.post(f"{router.url}/v1/completions", json=lie("answer"), timeout=30)
            assert response.status_code == 502
            assert error_of(response)["code"] == "response_too_large"


@pytest.mark.parametrize(
    ("lie_of", "says"),
    [
        (endless_header(64 << 20), "no answer: status line and headers larger than 65536 bytes"),
        (
            endless_trailer(48 << 20),
            "connection lost: more than 65536 bytes after the head that are no body",
        ),
    ],
    ids=["head-64MiB", "trailer-48MiB"],
)
def test_an_engine_head_or_trailer_of_megabytes_is_a_502_and_stalls_nobody(
    router: RouterProcess, liar: LyingEngine, lie_of: Lie, says: str
) -> None:
    """httptools builds a head's field values by concatenation (time quadratic in their
    size), and a chunked body's trailer fields alike. A head of 64 MiB was answered 200
    after 5.1 s and held the router's loop 2.5 s (everyone's /health waited), 400 MiB
    ended in a 504 while bytes were arriving; a 48 MiB trailer was answered 200 after
    3.7 s and held /health up to 2.3 s. Both are bounded at 64 KiB."""
    liar.lies["huge-head"] = lie_of
    failures_before = protocol_errors(router)
    health = HealthWatch(router)
    with attacked(router):
        health.start()
        try:
            wait_for(lambda: health.polls >= 3, what="/health polled")
            response = httpx.post(f"{router.url}/v1/completions", json=lie("huge-head"), timeout=60)
            polls = health.polls
            wait_for(lambda: health.polls >= polls + 3, what="/health polled after")
        finally:
            health.stop.set()
            health.join(30)
    assert response.status_code == 502
    assert error_of(response) == {
        "message": f"decode engine {liar.url}/v1/completions: {says}",
        "type": "upstream_error",
        "param": None,
        "code": "response_head_too_large",
    }
    # An engine breaking the protocol: hard evidence against the node, as invalid HTTP is.
    assert protocol_errors(router) == failures_before + 1
    assert health.failures == [] and health.polls > 0
    print(f"\n/health meanwhile: {health.polls} polls, slowest {health.slowest * 1000:.1f} ms")


def protocol_errors(router: RouterProcess) -> float:
    """Engine answers that broke the protocol, as the router counted them (hard evidence)."""
    prefix = "pd_router_upstream_errors_total{kind=protocol,"
    return sum(v for k, v in router.metrics().items() if k.startswith(prefix))


class HealthWatch(threading.Thread):
    """Another client's ``GET /health`` all along: how long the router's loop kept it."""

    def __init__(self, router: RouterProcess) -> None:
        super().__init__(daemon=True)
        self.url = f"{router.url}/health"
        self.stop = threading.Event()
        self.polls = 0
        self.slowest = 0.0
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                response = client.get(self.url)
                self.slowest = max(self.slowest, time.perf_counter() - started)
                self.polls += 1
                if response.status_code != 200:
                    self.failures.append(f"{response.status_code} {response.text[:200]}")
                time.sleep(0.01)


def test_sse_quirks_and_non_json_answers(router: RouterProcess, liar: LyingEngine) -> None:
    crlf = events(token(" a"), token(" b"), b"[DONE]", crlf=True)
    liar.lies["crlf"] = http(200, crlf, "content-type: text/event-stream")
    late = STREAM + events(token(" after the end"))
    liar.lies["late"] = http(200, late, "content-type: text/event-stream")
    liar.lies["text"] = http(200, b"hello, not JSON", "content-type: text/plain")
    # SSE drops one space after the field's colon, if there is one: the same events.
    bare = b"".join(b"data:" + payload + b"\n\n" for payload in (token(" a"), b"[DONE]"))
    liar.lies["bare"] = http(200, bare, "content-type: text/event-stream")
    url = f"{router.url}/v1/completions"
    with attacked(router):
        response = httpx.post(url, json=lie("crlf", stream=True))
        assert response.status_code == 200 and response.content == crlf
        # Before: "decode stream ended without [DONE]", an error event, and a failure
        # counted against the engine for each such stream.
        response = httpx.post(url, json=lie("bare", stream=True))
        assert response.status_code == 200 and response.content == bare
        response = httpx.post(url, json=lie("late", stream=True))
        assert response.status_code == 200 and response.content == STREAM
        response = httpx.post(url, json=lie("text"))
        assert response.status_code == 502
        assert error_of(response)["message"].endswith("answer is not JSON")


def test_an_answer_nested_deeper_than_the_router_writes_goes_on_as_it_came(
    router: RouterProcess, liar: LyingEngine
) -> None:
    """Its usage cannot be fixed (orjson reads 1,024 levels and writes 254): before, a 500
    for a plain answer, and a poured stream cut short of its usage and [DONE] (or held
    until the stall timeout) that the log called ok."""
    deep = b'{"choices": [], "usage": {"prompt_tokens": 3}, "x": ' + b"[" * 300 + b"]" * 300
    deep += b"}"
    liar.lies["deep"] = http(200, deep, "content-type: application/json")
    liar.lies["deep-stream"] = then(2, chunk(events(deep, b"[DONE]")), hold=True)
    url = f"{router.url}/v1/completions"
    with attacked(router):
        response = httpx.post(url, json=lie("deep"))
        assert (response.status_code, response.content) == (200, deep)
        response = httpx.post(url, json=lie("deep-stream", stream=True), timeout=10)
        assert response.status_code == 200
        assert response.content == events(token(" 0"), token(" 1"), deep, b"[DONE]")


@pytest.mark.parametrize(
    ("tail", "says", "hold"),
    [
        (b"0\r\n\r\n", "decode stream ended without [DONE]", False),
        (chunk(b"data: " + b"x" * (2 << 20)), "an upstream event exceeded 1048576 bytes", True),
    ],
    ids=["ends-without-done", "oversized-event"],
)
def test_a_stream_that_breaks_after_its_pour_began_ends_in_one_error_event(
    router: RouterProcess, liar: LyingEngine, tail: bytes, says: str, hold: bool
) -> None:
    """Past its first event a stream is poured from the engine connection's callback; an
    engine that breaks the stream there still gives the client its events, then exactly one
    error event and ``[DONE]``, and its slot back."""
    liar.lies["broken"] = then(3, tail, hold)
    before = router.metrics()
    with attacked(router):
        response = httpx.post(f"{router.url}/v1/completions", json=lie("broken", stream=True))
    assert response.status_code == 200
    poured = events(*(token(f" {index}") for index in range(3)))
    assert response.content.startswith(poured)
    error, done, nothing = response.content[len(poured) :].split(b"\n\n")
    assert json.loads(error.removeprefix(b"data: "))["error"]["message"].endswith(says)
    assert (done, nothing) == (b"data: [DONE]", b"")
    errors = "pd_router_requests_total{endpoint=completions,outcome=decode_error}"
    assert router.metrics()[errors] == before.get(errors, 0) + 1


def test_an_engine_that_holds_its_body_open_after_done_does_not_hold_the_slot(
    router: RouterProcess, liar: LyingEngine
) -> None:
    """A decode engine that sends ``[DONE]`` and then neither ends its chunked body nor
    closes: the client has its whole answer at once, and the slot is back within the
    second the router gives the body's end (``AFTER_DONE``), not at the read timeout (600 s
    by default; before, the stall watch also made the node unhealthy meanwhile)."""
    liar.lies["held"] = then(2, chunk(events(b"[DONE]")), hold=True)
    ok = "pd_router_requests_total{endpoint=completions,outcome=ok}"
    before = router.metrics().get(ok, 0)
    with attacked(router):
        started = time.monotonic()
        response = httpx.post(f"{router.url}/v1/completions", json=lie("held", stream=True))
        assert response.content == events(token(" 0"), token(" 1"), b"[DONE]")
        wait_for(lambda: router.in_use() == 0, timeout=15, what="the slot back")
        assert time.monotonic() - started < 15
    assert router.metrics()[ok] >= before + 1


def test_an_engine_that_sends_on_after_done_does_not_hold_the_slot(
    router: RouterProcess, liar: LyingEngine
) -> None:
    """As one that holds its body open, but sending junk chunks for ever: the client has its
    answer at ``[DONE]``, and the slot is back within ``AFTER_DONE``, not at the end of a
    body that never ends."""

    async def babble(writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD)
        writer.write(chunk(events(token(" 0"), b"[DONE]")))
        while True:
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(chunk(b"junk after the end\n\n"))

    liar.lies["babble"] = babble
    with attacked(router):
        response = httpx.post(f"{router.url}/v1/completions", json=lie("babble", stream=True))
        assert response.content == events(token(" 0"), b"[DONE]")
        wait_for(lambda: router.in_use() == 0, timeout=15, what="the slot back")


def test_a_stream_longer_than_the_read_timeout_flows_whole_while_bytes_come() -> None:
    """``--read-timeout`` is the longest silence, not the longest stream: a poured stream
    (the engine connection's callback writes to the client) moves the deadline with each
    read."""
    with SimFleet(1, 1) as fleet:
        fleet.decode[0].configure(itl=0.15)
        urls = [fleet.prefill[0].url], [fleet.decode[0].url]
        with RouterProcess(*urls, "--read-timeout", "1") as router:
            body = {**BODY, "max_tokens": 16, "stream": True, "ignore_eos": True}
            started = time.monotonic()
            response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
            assert time.monotonic() - started > 2, "the stream outlasted the read timeout"
            assert response.status_code == 200
            assert response.content.endswith(b"data: [DONE]\n\n")
            assert b'"error"' not in response.content
            router.assert_idle()


def test_a_client_that_stops_reading_for_a_while_then_reads_on_gets_its_whole_answer(
    router: RouterProcess, liar: LyingEngine
) -> None:
    """Its buffer full, the router holds the engine back; once it reads again, the engine
    is read again (``when_writable``): the answer goes on to its end. The engine writes
    until it is held back, however much the sockets take (Linux grows a loopback socket's
    receive buffer up to ``tcp_rmem``'s maximum, 32 MiB here: a fixed 27 MB answer once
    fitted whole in the kernel's buffers), and ends its answer once the client reads."""
    flood = Flood()
    piece = chunk(events(*[token(" flood")] * 64))
    reading = threading.Event()
    pieces = 0

    async def long_answer(writer: asyncio.StreamWriter) -> None:
        nonlocal pieces
        writer.write(STREAM_HEAD)
        while not reading.is_set():
            writer.write(piece)
            await writer.drain()
            flood.sent += len(piece)
            pieces += 1
        writer.write(chunk(events(b"[DONE]")) + b"0\r\n\r\n")
        await writer.drain()

    liar.lies["long"] = long_answer
    with attacked(router):
        with slow_reader(router, "long") as client:
            wait_for(lambda: flood.sent > 256 << 10, what="the answer under way")
            # Were the router reading on into its memory, the engine would never stall.
            wait_for(lambda: stalled(flood), what="the engine held back by the router")
            reading.set()
            client.settimeout(30)
            got = b""
            while not got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                data = client.recv(1 << 16)
                assert data, "the router closed the connection"
                got += data
        assert got.count(b"data: ") == pieces * 64 + 1


@pytest.mark.parametrize(
    ("tokens", "code", "outcome"),
    [(0, 500, "decode_error"), (0, 400, "bad_request"), (2, 500, "decode_error")],
    ids=["first-500", "first-400", "mid-stream"],
)
def test_an_engines_error_event_is_the_requests_failure(
    router: RouterProcess, liar: LyingEngine, tokens: int, code: int, outcome: str
) -> None:
    """vLLM reports an error raised while it generates as one ``data: {"error": ...}``
    event, then ``[DONE]``. First, before any token: the client gets a real error status,
    the engine's. After tokens: the client has them, the error event and ``[DONE]`` as the
    engine sent them. Either way the request is counted failed, a 5xx against the node as
    any 5xx is (before, both were ``ok``, their TTFT counted as a success's, and the
    first was a 200 whose only event was the error)."""
    liar.lies["erring"] = then(tokens, chunk(events(error_event(code), b"[DONE]")) + b"0\r\n\r\n")
    counted = f"pd_router_requests_total{{endpoint=completions,outcome={outcome}}}"
    before = router.metrics()
    with attacked(router):
        response = httpx.post(f"{router.url}/v1/completions", json=lie("erring", stream=True))
    if tokens:
        assert response.status_code == 200
        assert response.content == events(
            *(token(f" {index}") for index in range(tokens)), error_event(code), b"[DONE]"
        )
    else:
        assert response.status_code == code
        error = error_of(response)
        assert error["type"] == "upstream_error" and error["message"].endswith(": boom")
        assert error["message"].startswith("decode engine http://")
    after = router.metrics()
    assert after[counted] == before.get(counted, 0) + 1
    kind = "http_5xx" if code >= 500 else "http_4xx"
    errors = f"pd_router_upstream_errors_total{{kind={kind},node=1,role=decode,url={liar.url}}}"
    assert after[errors] == before.get(errors, 0) + 1


def test_a_client_that_stops_reading_then_leaves_frees_its_slot_and_its_engine(
    router: RouterProcess, liar: LyingEngine
) -> None:
    """A client that reads nothing fills its socket; the router then holds the engine back
    (it reads no more of it) instead of buffering. Gone while held, the client costs the
    router neither the slot nor the engine connection."""
    flood = Flood()
    liar.lies["flood"] = flood
    with attacked(router):
        with slow_reader(router, "flood"):
            wait_for(lambda: flood.sent > 1 << 20, what="the flood under way")
            wait_for(lambda: stalled(flood), what="the engine held back by the router")
            assert not flood.closed.is_set()
        assert flood.closed.wait(30), "the engine's connection was closed"
    aborted = "pd_router_requests_total{endpoint=completions,outcome=client_aborted}"
    assert router.metrics().get(aborted, 0) >= 1


def test_a_client_that_stops_reading_and_stays_loses_its_request_after_send_timeout() -> None:
    """The same client, but it never leaves: before, its slot and engine were held until
    it did (with one slot, everyone else got 429 meanwhile). ``--send-timeout`` seconds
    after its buffer filled, the router aborts the connection and the request ends as the
    client's leaving."""
    flood = Flood()
    with SimFleet(prefill=1, decode=0) as sims, LyingEngine() as liar:
        liar.lies["flood"] = flood
        args = ["--decode-slots", "1", "--send-timeout", "2", "--stall-timeout", "1"]
        with RouterProcess([sims.prefill[0].url], [liar.url], *args) as router:
            with slow_reader(router, "flood"):
                wait_for(lambda: flood.sent > 1 << 20, what="the flood under way")
                assert flood.closed.wait(30), "the engine's connection was closed"
                wait_for(lambda: router.in_use() == 0, timeout=10, what="the slot back")
                answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=10)
                assert answer.status_code == 200, "the next client is served"
            metrics = router.metrics()
            assert metrics["pd_router_client_connections_closed_total{reason=send_timeout}"] == 1
            aborted = "pd_router_requests_total{endpoint=completions,outcome=client_aborted}"
            assert metrics[aborted] == 1
            assert (
                metrics.get(
                    "pd_router_node_state{node=1,role=decode,state=serving,url=" + liar.url + "}"
                )
                == 1
            ), "the engine is not blamed"
            router.assert_idle()


@contextmanager
def slow_reader(router: RouterProcess, lie_name: str) -> Iterator[socket.socket]:
    """A client that asked for the lie's stream and reads nothing until the test says so:
    a small receive buffer, which it fills at once."""
    body = json.dumps(lie(lie_name, stream=True)).encode()
    with socket.create_connection(("127.0.0.1", router.port)) as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        yield client


def stalled(flood: Flood) -> bool:
    """The flood wrote nothing for a while: the router stopped reading it."""
    sent = flood.sent
    time.sleep(0.5)
    return flood.sent == sent


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"notjson", "not valid JSON"),
        (b'{"model": "m", "prompt": 123}', "'prompt' must be"),
        (b'{"model": "m", "prompt": "x", "seed": 18446744073709551616}', "out of range"),
        (b'{"model": "m", "prompt": "x", "x": ' + b"[" * 300 + b"]" * 300 + b"}", "deeper"),
        (b'{"model": "m", "prompt": "x", "x": ' + b"[" * 1100 + b"]" * 1100 + b"}", "deeper"),
    ],
    ids=["notjson", "prompt-123", "int-2^64", "depth-300", "depth-1100"],
)
def test_odd_bodies_get_a_400_before_any_slot_is_taken(
    router: RouterProcess, raw: bytes, says: str
) -> None:
    """A body nested 254-1024 levels deep was a 500 after a slot was taken."""
    before = router.metrics()
    response = httpx.post(
        f"{router.url}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and says in error_of(response)["message"]
    after = router.metrics()
    taken = "pd_router_slot_acquisitions_total"
    assert after[taken] == before[taken]
    bad = "pd_router_requests_total{endpoint=completions,outcome=bad_request}"
    assert after[bad] == before.get(bad, 0) + 1
    assert httpx.post(f"{router.url}/v1/completions", json=BODY).status_code == 200


def test_queued_requests_with_one_id_stay_distinct_and_each_can_be_aborted(
    router: RouterProcess, liar: LyingEngine
) -> None:
    liar.lies["hold"] = slowly(40, 0.1)
    url = f"{router.url}/v1/completions"
    holders = [
        threading.Thread(
            target=httpx.post, args=(url,), kwargs={"json": lie("hold"), "timeout": 30}
        )
        for _ in range(4)
    ]
    for holder in holders:
        holder.start()
    wait_for(lambda: router.in_use() == 4, what="every slot held")
    answers: dict[int, httpx.Response] = {}

    def queued(index: int) -> None:
        answers[index] = httpx.post(url, json=BODY, headers={"x-request-id": "twin"}, timeout=30)

    twins = [threading.Thread(target=queued, args=(i,)) for i in range(2)]
    for twin in twins:
        twin.start()
    wait_for(lambda: router.metrics()["pd_router_queue_depth"] == 2, what="both twins queued")
    admin = {"authorization": f"Bearer {TOKEN}"}
    aborted = httpx.post(f"{router.url}/admin/requests/twin.2/abort", headers=admin)
    assert aborted.status_code == 200
    for thread in [*twins, *holders]:
        thread.join(30)
    by_id = {response.headers["x-request-id"]: response for response in answers.values()}
    assert set(by_id) == {"twin", "twin.2"}
    assert by_id["twin"].status_code == 200
    assert by_id["twin.2"].status_code == 503 and error_of(by_id["twin.2"])["code"] == "abort"
    router.assert_idle()


def test_failed_large_requests_give_their_memory_back(router: RouterProcess) -> None:
    """Ten ~30 MB prompts the prefill engine refused took the router from 366 to 1,021 MB,
    kept through reference cycles the tuned collector never visited."""
    prompt = "word " * (6 << 20)
    with attacked(router):
        # Five: kept, they would be ~300 MB, three times RSS_BOUND.
        for _ in range(5):
            response = httpx.post(
                f"{router.url}/v1/completions", json={**BODY, "prompt": prompt}, timeout=60
            )
            assert response.status_code == 400
            assert "maximum context length" in error_of(response)["message"]


@pytest.mark.parametrize(
    ("method", "path", "status", "says"),
    [
        ("GET", "/", 404, "no route GET /"),
        ("GET", "/v1/completions", 405, "GET is not allowed on /v1/completions"),
        ("PUT", "/admin/nodes", 405, "PUT is not allowed on /admin/nodes"),
        ("POST", "/v1/completions/", 404, "did you mean /v1/completions?"),
        # The admin API is on here (--admin-token): a path it lacks is just not there.
        ("GET", "/admin/node", 404, "no route GET /admin/node"),
    ],
)
def test_other_routes_and_methods_get_openai_errors_not_redirects(
    router: RouterProcess, method: str, path: str, status: int, says: str
) -> None:
    response = httpx.request(method, router.url + path, headers={"host": "evil.example"})
    assert response.status_code == status and says in error_of(response)["message"]
    assert "location" not in response.headers
    if status == 405:  # every method the path takes (/admin/nodes: two routes)
        allowed = {"/v1/completions": "POST", "/admin/nodes": "GET, HEAD, POST"}
        assert response.headers["allow"] == allowed[path]


def test_events_over_the_limit_fail_their_own_requests_and_say_nothing_against_the_engine(
    prefill: SimFleet, liar: LyingEngine
) -> None:
    """A stream whose event passes 1 MiB (vLLM sends a long prompt's logprobs in one event
    for ``echo`` with ``logprobs``) is what its request asked for, as an answer over
    ``--max-response-bytes`` is: each such request ends in one error event, and the engine
    stays serving for everyone else, its health judged as by default. Before, each counted
    as hard evidence (a ``protocol`` error): three made a healthy decode node dead, and
    every other request on it failed with it."""
    liar.lies["huge"] = then(1, chunk(b"data: " + b"x" * (2 << 20)), hold=True)
    with RouterProcess([prefill.prefill[0].url], [liar.url], "--decode-slots", "4") as router:
        url = f"{router.url}/v1/completions"
        for _ in range(4):
            response = httpx.post(url, json=lie("huge", stream=True), timeout=30)
            assert b"event_too_large" in response.content, response.content[-300:]
        assert httpx.post(url, json=BODY, timeout=30).status_code == 200
        metrics = router.metrics()
        errors = {
            key.split("kind=")[1].split(",")[0]: value
            for key, value in metrics.items()
            if key.startswith("pd_router_upstream_errors_total") and value
        }
        assert errors == {"too_large": 4}, errors
        serving = [
            key
            for key, value in metrics.items()
            if key.startswith("pd_router_node_state") and value
        ]
        assert all("state=serving" in key for key in serving), serving


def test_a_prefill_that_ends_at_its_first_token_is_answered_by_the_decode_engine() -> None:
    """A prompt whose first token ends it (an end-of-sequence, or the client's own stop
    token): vLLM's prefill engine answers ``finish_reason: stop`` and no
    ``kv_transfer_params`` (it keeps KV only for a prefill cut at its max_tokens). That is
    the request's own outcome: the decode engine computes the prompt itself and answers,
    and nothing counts against the prefill engine. Before, each such request got a 502,
    was tried again on another prefill node, and counted as hard evidence against both:
    three made every prefill node dead. (A prefill answer cut at its length with no
    params is still the engine's fault: a kv_producer that is not one.)"""
    stopped = dict(COMPLETION, kv_transfer_params=None)
    stopped["choices"] = [{"index": 0, "text": "", "finish_reason": "stop"}]
    misconfigured = dict(COMPLETION, kv_transfer_params=None)
    with (
        LyingEngine() as prefill,
        SimFleet(prefill=0, decode=1, decode_args=["--standalone"]) as decode,
    ):
        prefill.lies["stop"] = http(200, json.dumps(stopped).encode())
        prefill.lies["length"] = http(200, json.dumps(misconfigured).encode())
        urls = [prefill.url], [decode.decode[0].url]
        with RouterProcess(*urls, "--unhealthy-after", "2") as router:
            url = f"{router.url}/v1/completions"
            for stream in (False, True, False, True):
                answer = httpx.post(url, json=lie("stop", stream=stream), timeout=30)
                assert answer.status_code == 200, answer.text
            metrics = router.metrics()
            assert not any(
                value for key, value in metrics.items() if key.startswith("pd_router_upstream")
            )
            assert metrics["pd_router_requests_total{endpoint=completions,outcome=ok}"] == 4
            refused = httpx.post(url, json=lie("length"), timeout=30)
            assert refused.status_code == 502 and "kv_producer" in refused.text
            assert "local_prefill=True" in router.log()

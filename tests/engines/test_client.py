"""The engine HTTP client (``pd_router.engines.client`` over ``.connection``) on real sockets.

Most engines here are scripted raw servers on 127.0.0.1: each reads the request and writes
exact bytes, so framing, keep-alive, hang-ups and garbage are driven byte by byte. One test
runs the simulated decode engine under uvicorn, in this event loop, as the real peer.

Every test runs on plain asyncio and on uvloop (what uvicorn runs the router on when it is
installed): the client is asyncio-only, and the two loops' transports differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import ssl
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
import trustme

from pd_router.engines import client as upstream_module
from pd_router.engines.client import Response, Upstream
from pd_router.engines.connection import HIGH_WATER, MAX_HEAD, EngineConnection
from pd_router.errors import Evidence, UpstreamError
from pd_router.fleet.nodes import Failure

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
        return ("asyncio", {"use_uvloop": True})
    return "asyncio"


async def chunks(response: Response) -> AsyncIterator[bytes]:
    while data := await response.next_chunk():
        yield data


# ---------------------------------------------------------------------------- scripted engine


@dataclass
class Request:
    line: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased, in the order sent
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        values = [value for key, value in self.headers if key == name]
        assert len(values) <= 1, f"header {name!r} sent {len(values)} times"
        return values[0] if values else None


@dataclass
class Conn:
    """One connection the scripted engine accepted, with what it saw on it."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    requests: list[Request] = field(default_factory=list)
    # The router closed (FIN) or reset its side: how an engine learns to abort.
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def sock(self) -> socket.socket:
        sock: socket.socket = self.writer.get_extra_info("socket")
        return sock

    async def request(self) -> Request | None:
        """The next request (head and Content-Length body), or None once the router left."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.gone.set()
            return None
        line, *lines = head[:-4].split(b"\r\n")
        headers = []
        for raw in lines:
            name, _, value = raw.partition(b":")
            headers.append((name.strip().lower(), value.strip()))
        request = Request(line, headers, b"")
        length = request.header(b"content-length")
        if length is not None:
            request.body = await self.reader.readexactly(int(length))
        self.requests.append(request)
        return request

    async def send(self, *pieces: bytes, pause: float = 0.0) -> None:
        """Each piece in its own write, flushed, ``pause`` seconds apart."""
        for index, piece in enumerate(pieces):
            if index and pause:
                await asyncio.sleep(pause)
            self.writer.write(piece)
            await self.writer.drain()

    async def until_gone(self) -> None:
        """Read (and drop) whatever comes until the router closes its side."""
        try:
            while await self.reader.read(65536):
                pass
        except ConnectionError:
            pass
        self.gone.set()

    def close(self) -> None:
        self.writer.close()

    def reset(self) -> None:
        """Close with a TCP RST instead of a FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


Handler = Callable[[Conn], Awaitable[None]]


class Engine:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections: list[Conn] = []
        self.errors: list[BaseException] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self.port = 0

    scheme = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.port}"

    @property
    def requests(self) -> list[Request]:
        return [request for conn in self.connections for request in conn.requests]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        conn = Conn(reader, writer)
        self.connections.append(conn)
        try:
            await self.handler(conn)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except BaseException as exc:  # a broken script must fail its test, not just log
            self.errors.append(exc)
        finally:
            writer.close()


@asynccontextmanager
async def scripted_engine(
    handler: Handler, tls: ssl.SSLContext | None = None
) -> AsyncIterator[Engine]:
    engine = Engine(handler)
    if tls is not None:
        engine.scheme = "https"
    server = await asyncio.start_server(engine.serve, HOST, 0, ssl=tls)
    engine.port = server.sockets[0].getsockname()[1]
    try:
        yield engine
    finally:
        server.close()
        for task in engine.tasks:
            task.cancel()
        await asyncio.gather(*engine.tasks, return_exceptions=True)
        await server.wait_closed()
    assert not engine.errors, engine.errors


@asynccontextmanager
async def engine_client(
    connect_timeout: float = 30.0, read_timeout: float = 30.0
) -> AsyncIterator[Upstream]:
    """A client whose timeouts fire only in the tests that set them: a second was seen to
    run out on a loaded machine (a connect to a local engine)."""
    client = Upstream(connect_timeout=connect_timeout, read_timeout=read_timeout)
    try:
        yield client
    finally:
        await client.close()


def answer(status: int = 200, body: bytes = b"", *headers: bytes, reason: bytes = b"OK") -> bytes:
    head = b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n" % (status, reason, len(body))
    return head + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


async def within(awaitable: Awaitable[Any], seconds: float = 1.0) -> Any:
    return await asyncio.wait_for(awaitable, seconds)


def idle(client: Upstream) -> list[EngineConnection]:
    return [conn for pool in client._idle.values() for conn in pool]


async def until(check: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def serve_requests(conn: Conn, reply: bytes) -> None:
    """Answer every request on the connection with ``reply``, keeping it alive."""
    while await conn.request() is not None:
        await conn.send(reply)


async def never_answers(conn: Conn) -> None:
    await conn.request()
    await conn.until_gone()


async def serve_ok(conn: Conn) -> None:
    await serve_requests(conn, answer(200, b"ok"))


async def post_ok(client: Upstream, url: str, request_id: str) -> None:
    """One request, its "ok" answer read whole and the response closed (so pooled if fit)."""
    with await client.post(url, {}, request_id) as response:
        assert await response.read() == b"ok"


async def two_requests_on_two_connections(
    handler: Handler, after_each: Callable[[Engine, Upstream], Awaitable[None]]
) -> None:
    """Two requests, each answered "ok"; ``after_each`` runs after each. The second must
    have needed a connection of its own: the first one was not pooled, or was dropped."""
    async with scripted_engine(handler) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        for request_id in ("a", "b"):
            await post_ok(client, url, request_id)
            await after_each(engine, client)
    assert [len(conn.requests) for conn in engine.connections] == [1, 1]


async def stream_until_it_breaks(client: Upstream, url: str) -> tuple[bytes, UpstreamError]:
    """The bytes a stream yielded before the error it ended with."""
    got = []
    with pytest.raises(UpstreamError) as caught:
        with await client.post(url, {}, "r") as response:
            async for data in chunks(response):
                got.append(data)
    return b"".join(got), caught.value


async def until_not_pooled(engine: Engine, client: Upstream) -> None:
    await until(lambda: idle(client) == [])


async def dropped_at_once(engine: Engine, client: Upstream) -> None:
    """The connection just used is not pooled, and the router closes it."""
    assert idle(client) == []
    await within(engine.connections[-1].gone.wait())


def refused_port() -> socket.socket:
    """A bound socket that does not listen: connecting to its port is refused (RST)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((HOST, 0))
    return sock


# ---------------------------------------------------------------------------- the request


async def test_post_sends_one_well_formed_request_and_reads_a_content_length_answer() -> None:
    reply = orjson.dumps({"choices": [{"text": " hi"}]})

    async def handler(conn: Conn) -> None:
        await serve_requests(conn, answer(200, reply, b"content-type: application/json"))

    payload = {"prompt": "h\u00e9llo \u2713", "max_tokens": 3, "stream": False, "n": None}
    async with scripted_engine(handler) as engine, engine_client() as client:
        url = f"{engine.url}/prefix/v1/completions"
        with await client.post(url, payload, "req-\u00e91") as response:
            assert response.status == 200
            assert response.url == url
            assert await response.read() == reply

    [request] = engine.requests
    assert request.line == b"POST /prefix/v1/completions HTTP/1.1"
    assert request.header(b"host") == f"{HOST}:{engine.port}".encode()
    assert request.header(b"content-type") == b"application/json"
    assert request.header(b"content-length") == str(len(request.body)).encode()
    assert request.header(b"x-request-id") == "req-\u00e91".encode()
    assert request.header(b"transfer-encoding") is None
    assert request.body == orjson.dumps(payload)
    assert orjson.loads(request.body) == payload
    # Nothing but that one request came on the connection.
    assert len(engine.connections) == 1


async def test_read_of_a_chunked_answer_sent_in_pieces() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(
            CHUNKED_HEAD + chunk(b"hello"),
            chunk(b" wor"),
            chunk(b"ld") + LAST_CHUNK,
            pause=0.01,
        )
        await conn.until_gone()

    async with scripted_engine(handler) as engine, engine_client() as client:
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            assert await response.read() == b"hello world"
            # Read to its end: the connection went back to the pool.
        assert len(idle(client)) == 1


async def test_get_json_parses_a_200_and_raises_on_other_statuses() -> None:
    models = {"object": "list", "data": [{"id": "m"}]}

    async def handler(conn: Conn) -> None:
        while (request := await conn.request()) is not None:
            if request.line == b"GET /v1/models HTTP/1.1":
                await conn.send(answer(200, orjson.dumps(models)))
            else:
                await conn.send(answer(500, b'{"message": "boom"}'))

    async with scripted_engine(handler) as engine, engine_client() as client:
        assert await client.get_json(engine.url + "/v1/models") == models
        with pytest.raises(UpstreamError, match="boom"):
            await client.get_json(engine.url + "/other")
    get = engine.requests[0]
    assert get.header(b"content-length") is None and get.body == b""


# ---------------------------------------------------------------------------- streaming and reuse


async def test_chunks_stream_in_order_coalesced_and_the_connection_is_reused() -> None:
    events = [b"data: %d\n\n" % i for i in range(4)]
    client_took = asyncio.Event()

    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + chunk(events[0]))
        await within(client_took.wait())
        client_took.clear()
        await conn.send(chunk(events[1]))
        await within(client_took.wait())
        # Two chunks in one write: they reach the router together.
        await conn.send(chunk(events[2]) + chunk(events[3]))
        await within(client_took.wait())
        await conn.send(LAST_CHUNK)
        await serve_requests(conn, answer(200, b"second"))

    async with scripted_engine(handler) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        got = []
        with await client.post(url, {"stream": True}, "a") as response:
            async for data in chunks(response):
                got.append(data)
                client_took.set()
        # Each write as its own piece, as soon as it arrived; the pair coalesced.
        assert got == [events[0], events[1], events[2] + events[3]]
        with await client.post(url, {}, "b") as response:
            assert await response.read() == b"second"

    assert len(engine.connections) == 1
    assert len(engine.connections[0].requests) == 2


async def test_an_answer_not_read_to_its_end_closes_its_connection() -> None:
    async def handler(conn: Conn) -> None:
        request = await conn.request()
        assert request is not None
        if request.header(b"x-request-id") == b"abandoned":
            await conn.send(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
            await conn.until_gone()
        else:
            await conn.send(answer(200, b"ok"))
            await serve_ok(conn)

    async with scripted_engine(handler) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        with await client.post(url, {}, "abandoned") as response:
            assert await response.next_chunk() == b"data: 1\n\n"
        # The engine sees its peer go: that is how it learns to abort the request.
        await within(engine.connections[0].gone.wait())
        assert idle(client) == []
        await post_ok(client, url, "next")

    assert [len(conn.requests) for conn in engine.connections] == [1, 1]


async def test_an_answer_that_arrived_whole_but_was_not_read_leaves_no_stale_bytes() -> None:
    async def handler(conn: Conn) -> None:
        while (request := await conn.request()) is not None:
            await conn.send(answer(200, request.header(b"x-request-id") or b""))

    async with scripted_engine(handler) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        with await client.post(url, {}, "unread") as response:
            conn = response._conn
            await until(lambda: conn.complete)  # all in, none taken
        with await client.post(url, {}, "next") as response:
            assert await response.read() == b"next"


async def test_a_second_close_does_not_close_a_connection_reused_meanwhile() -> None:
    async with scripted_engine(serve_ok) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        with await client.post(url, {}, "first") as first:
            assert await first.read() == b"ok"
            first.close()  # pooled
            with await client.post(url, {}, "second") as second:
                assert second._conn is first._conn
                first.close()  # must not touch the connection `second` now uses
                assert await second.read() == b"ok"
        # The context manager's own close of `first` ran last: still nothing closed.
        [pooled] = idle(client)
        assert pooled is first._conn
        with await client.post(url, {}, "third") as third:
            assert await third.read() == b"ok"

    assert [len(conn.requests) for conn in engine.connections] == [3]
    assert not engine.connections[0].gone.is_set()


async def test_cancelled_while_waiting_for_the_head_closes_the_connection() -> None:
    async with scripted_engine(never_answers) as engine, engine_client(read_timeout=5) as client:

        async def call() -> None:
            with await client.post(engine.url + "/v1/completions", {}, "r"):
                pass

        task = asyncio.ensure_future(call())
        await until(lambda: len(engine.requests) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await within(engine.connections[0].gone.wait())
        assert idle(client) == []


async def test_an_idle_connection_the_engine_closed_is_replaced() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        # No "connection: close": like uvicorn dropping a keep-alive connection later.
        await conn.send(answer(200, b"ok"))
        conn.close()

    # The router notices the peer's FIN and drops the connection from its pool, so the
    # next request opens a new one.
    await two_requests_on_two_connections(handler, until_not_pooled)


@pytest.fixture
def short_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream_module, "KEEPALIVE_SECONDS", 0.05)


@pytest.mark.usefixtures("short_keepalive")
async def test_a_connection_idle_longer_than_keepalive_is_not_reused() -> None:
    async with scripted_engine(serve_ok) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        await post_ok(client, url, "a")
        await post_ok(client, url, "b")  # fresh: reused
        await asyncio.sleep(0.1)
        await post_ok(client, url, "c")  # too old: a new connection
        # ...and the old one was closed, not left open.
        await within(engine.connections[0].gone.wait())

    assert [len(conn.requests) for conn in engine.connections] == [2, 1]


@pytest.mark.usefixtures("short_keepalive")
async def test_a_connection_too_old_is_not_reused_even_before_the_sweep_ran() -> None:
    """A loop that runs the sweep's timer late (a stall) still never sends on a connection
    idle longer than the keep-alive: the engine may be closing it."""
    async with scripted_engine(serve_ok) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        await post_ok(client, url, "a")
        assert client._sweep is not None
        client._sweep.cancel()  # as late as can be
        await asyncio.sleep(0.1)
        assert len(idle(client)) == 1, "nothing swept it"
        await post_ok(client, url, "b")  # too old: a new connection
        await within(engine.connections[0].gone.wait())

    assert [len(conn.requests) for conn in engine.connections] == [1, 1]


@pytest.mark.usefixtures("short_keepalive")
async def test_an_idle_connection_is_closed_after_keepalive_with_no_request_to_find_it() -> None:
    async with scripted_engine(serve_ok) as engine, engine_client() as client:
        await post_ok(client, engine.url + "/v1/completions", "a")
        assert len(idle(client)) == 1
        await within(engine.connections[0].gone.wait())
        await until(lambda: idle(client) == [])


@pytest.mark.usefixtures("short_keepalive")
async def test_an_engine_whose_idle_connections_were_all_closed_leaves_no_entry() -> None:
    """Engines come and go (DNS: a new address per pod): the pool keeps nothing of one
    it has no connection to, where it kept an entry per address ever seen."""
    async with scripted_engine(serve_ok) as engine, engine_client() as client:
        await post_ok(client, engine.url + "/v1/completions", "a")
        await within(engine.connections[0].gone.wait())
        await until(lambda: client._idle == {} and client._forget == {})


@pytest.mark.usefixtures("short_keepalive")
async def test_connections_idle_since_different_times_are_each_closed_in_their_turn() -> None:
    # One timer closes the idle connections: armed for the oldest, then for the next one.
    async with scripted_engine(serve_ok) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        first = await client.post(url, {}, "a")
        second = await client.post(url, {}, "b")  # the first is not idle: a connection more
        assert await first.read() == b"ok"
        first.close()
        await asyncio.sleep(0.03)
        assert await second.read() == b"ok"
        second.close()
        assert len(idle(client)) == 2
        await within(engine.connections[0].gone.wait())
        await within(engine.connections[1].gone.wait())
        await until(lambda: idle(client) == [])


async def test_an_answer_saying_connection_close_is_not_pooled() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(answer(200, b"ok", b"connection: close"))
        await conn.until_gone()  # the router closes it, the engine does not have to

    await two_requests_on_two_connections(handler, dropped_at_once)


async def test_bytes_the_engine_sends_while_idle_drop_the_connection() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(answer(200, b"ok"))
        await asyncio.sleep(0.02)
        await conn.send(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")
        await serve_ok(conn)

    await two_requests_on_two_connections(handler, until_not_pooled)


async def test_a_second_answer_in_the_same_bytes_is_not_taken_for_body() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        # One write: the answer asked for, then one nobody asked for.
        await conn.send(answer(200, b"ok") + answer(200, b"unasked"))
        await serve_ok(conn)

    # A connection out of step with its engine is dropped, not pooled.
    await two_requests_on_two_connections(handler, dropped_at_once)


# ---------------------------------------------------------------------------- failures


@pytest.fixture
def engine_ca() -> trustme.CA:
    return trustme.CA()


def tls_for(ca: trustme.CA) -> ssl.SSLContext:
    """A server context with a certificate for 127.0.0.1 that ``ca`` signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(HOST).configure_cert(context)
    return context


async def test_an_https_engine_is_verified_by_the_ca_in_ssl_cert_file(
    engine_ca: trustme.CA, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "engines-ca.pem"
    engine_ca.cert_pem.write_to_path(str(bundle))
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))  # what an operator sets for a private CA

    async def handler(conn: Conn) -> None:
        while await conn.request() is not None:
            await conn.send(CHUNKED_HEAD, chunk(b"data: 1\n\n"), chunk(b"data: 2\n\n"))
            await conn.send(LAST_CHUNK)

    async with scripted_engine(handler, tls_for(engine_ca)) as engine, engine_client() as client:
        assert engine.url.startswith("https://")
        for _ in range(2):
            with await client.post(engine.url + "/v1/completions", {}, "r") as response:
                assert b"".join([data async for data in chunks(response)]) == (
                    b"data: 1\n\ndata: 2\n\n"
                )
    assert len(engine.connections) == 1, "the TLS connection is kept alive and reused"
    request = engine.requests[0]
    assert request.header(b"host") == f"{HOST}:{engine.port}".encode()


async def test_an_https_engine_with_a_certificate_nobody_trusts_is_a_tls_failure(
    engine_ca: trustme.CA,
) -> None:
    """Soft evidence (the router's trust may be what is wrong), not unreachable (fatal)."""

    async def handler(conn: Conn) -> None:
        await conn.request()

    async with scripted_engine(handler, tls_for(engine_ca)) as engine, engine_client() as client:
        with pytest.raises(UpstreamError) as caught:
            await client.post(engine.url + "/v1/completions", {}, "r")
    assert caught.value.kind == "tls"
    assert "TLS handshake failed: the engine's certificate is not trusted" in (caught.value.message)


async def test_connection_refused_is_unreachable() -> None:
    with refused_port() as sock:
        url = f"http://{HOST}:{sock.getsockname()[1]}/v1/completions"
        async with engine_client() as client:
            with pytest.raises(UpstreamError) as caught:
                with await client.post(url, {}, "r"):
                    pass
    assert caught.value.kind == "unreachable"
    assert caught.value.evidence is Evidence.FATAL
    assert caught.value.status == 502
    assert url in caught.value.message


async def test_connect_timeout() -> None:
    # A listener whose accept queue is full drops new SYNs: connect() hangs, on loopback.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((HOST, 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(3)]
        try:
            for filler in fillers:
                filler.setblocking(False)
                filler.connect_ex((HOST, port))
            await asyncio.sleep(0.05)
            try:
                fillers[-1].getpeername()
            except OSError:
                pass
            else:
                pytest.skip("this kernel completes connects to a full accept queue")
            async with engine_client(connect_timeout=0.2, read_timeout=5) as client:
                started = time.monotonic()
                with pytest.raises(UpstreamError) as caught:
                    with await client.post(f"http://{HOST}:{port}/v1/completions", {}, "r"):
                        pass
                elapsed = time.monotonic() - started
        finally:
            for filler in fillers:
                filler.close()
    assert caught.value.kind == "connect_timeout" and caught.value.undelivered
    assert "unreachable: connect timed out after 0.2 s" in caught.value.message
    assert 0.15 < elapsed < 1.0


async def test_no_answer_is_a_timeout_and_the_connection_is_closed() -> None:
    async with scripted_engine(never_answers) as engine, engine_client(read_timeout=0.2) as client:
        started = time.monotonic()
        with pytest.raises(UpstreamError) as caught:
            with await client.post(engine.url + "/v1/completions", {}, "r"):
                pass
        elapsed = time.monotonic() - started
        await within(engine.connections[0].gone.wait())
    assert caught.value.kind == "timeout"
    assert 0.15 < elapsed < 1.0


async def test_a_stall_mid_stream_is_a_timeout_after_the_bytes_that_arrived() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await conn.until_gone()

    async with scripted_engine(handler) as engine, engine_client(read_timeout=0.2) as client:
        got, error = await stream_until_it_breaks(client, engine.url + "/v1/completions")
        await within(engine.connections[0].gone.wait())
    assert got == b"data: 1\n\n"
    assert error.kind == "timeout"


async def test_the_read_timeout_is_between_bytes_not_for_the_whole_answer() -> None:
    pieces = [chunk(b"data: %d\n\n" % i) for i in range(6)]

    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD, *pieces, LAST_CHUNK, pause=0.5)
        await conn.until_gone()

    # 3.5 s of answer, a byte every 0.5 s, never 2 s without one (unless the machine stalls
    # for 1.5 s): the timer moved along, it never fired.
    async with scripted_engine(handler) as engine, engine_client(read_timeout=2) as client:
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            assert b"".join([data async for data in chunks(response)]) == b"".join(
                b"data: %d\n\n" % i for i in range(6)
            )


@pytest.mark.parametrize("hang_up", ["close", "reset"])
async def test_engine_gone_mid_chunked_body_is_a_broken_stream_after_its_bytes(
    hang_up: str,
) -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + chunk(b"data: 1\n\n"), chunk(b"data: 2\n\n"), pause=0.02)
        await asyncio.sleep(0.05)  # the router takes the bytes before the hang-up
        conn.close() if hang_up == "close" else conn.reset()

    async with scripted_engine(handler) as engine, engine_client() as client:
        got, error = await stream_until_it_breaks(client, engine.url + "/v1/completions")
        assert idle(client) == []
    assert got == b"data: 1\n\ndata: 2\n\n"
    assert error.kind == "broken_stream"
    assert "stream broken" in error.message


async def test_a_content_length_body_cut_short_is_a_broken_stream() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 40)
        conn.close()

    async with scripted_engine(handler) as engine, engine_client() as client:
        with pytest.raises(UpstreamError) as caught:
            with await client.post(engine.url + "/v1/completions", {}, "r") as response:
                await response.read()
    assert caught.value.kind == "broken_stream"


async def test_an_engine_that_closes_without_answering_is_a_broken_stream() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        conn.close()

    async with scripted_engine(handler) as engine, engine_client() as client:
        with pytest.raises(UpstreamError) as caught:
            with await client.post(engine.url + "/v1/completions", {}, "r"):
                pass
    assert caught.value.kind == "broken_stream"
    assert "no answer" in caught.value.message
    # A new connection is not retried: the engine took the request and dropped it.
    assert len(engine.connections) == 1


async def test_a_request_on_a_pooled_connection_the_engine_drops_is_not_sent_again() -> None:
    """No byte of answer does not mean the engine did not take the request (a non-streamed
    answer is silent until it is done): it is reported, never re-sent."""

    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(answer(200, b"first"))
        await conn.request()
        conn.close()

    async with scripted_engine(handler) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        with await client.post(url, {}, "r") as response:
            assert await response.read() == b"first"
        with pytest.raises(UpstreamError) as caught:
            await client.post(url, {}, "r")
    assert caught.value.kind == "broken_stream"
    assert [len(conn.requests) for conn in engine.connections] == [2]


async def test_garbage_instead_of_http_is_a_protocol_error() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await conn.until_gone()

    async with scripted_engine(handler) as engine, engine_client() as client:
        with pytest.raises(UpstreamError) as caught:
            with await client.post(engine.url + "/v1/completions", {}, "r"):
                pass
        # The router drops a connection it cannot parse.
        await within(engine.connections[0].gone.wait())
    assert caught.value.kind == "protocol"


async def test_a_head_of_64_kib_is_read_with_the_body_sent_in_the_same_bytes() -> None:
    body = b"the body"
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nx-pad: " % len(body)
    head += b"p" * (MAX_HEAD - len(head) - 4) + b"\r\n\r\n"
    assert len(head) == MAX_HEAD

    async def handler(conn: Conn) -> None:
        while await conn.request() is not None:
            await conn.send(head + body)  # one write: the head's end and the body together

    async with scripted_engine(handler) as engine, engine_client() as client:
        for _ in range(2):
            with await client.post(engine.url + "/v1/completions", {}, "r") as response:
                assert await response.read() == body
    assert [len(conn.requests) for conn in engine.connections] == [2]  # kept alive


async def test_a_head_larger_than_64_kib_is_a_protocol_error_read_no_further() -> None:
    """A header line without end: refused once 64 KiB of head arrived, with what it
    is, and the connection dropped (the engine's writes then fail)."""
    sent = 0

    async def handler(conn: Conn) -> None:
        nonlocal sent
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nx-endless: ")
        with contextlib.suppress(ConnectionError):
            while sent < 64 << 20:
                await conn.send(b"x" * (64 << 10))
                sent += 64 << 10
        conn.gone.set()

    async with scripted_engine(handler) as engine, engine_client(read_timeout=30) as client:
        with pytest.raises(UpstreamError) as caught:
            await within(client.post(engine.url + "/v1/completions", {}, "r"), 10)
        await within(engine.connections[0].gone.wait(), 10)
    error = caught.value
    assert (error.kind, error.code, error.status) == ("protocol", "response_head_too_large", 502)
    assert error.message == (
        f"{engine.url}/v1/completions: no answer: "
        f"status line and headers larger than {MAX_HEAD} bytes"
    )
    assert error.evidence is Evidence.HARD
    assert sent < 64 << 20  # the router stopped reading: what it had not read was refused


async def test_an_invalid_chunk_is_a_protocol_error_after_the_valid_bytes() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + chunk(b"data: 1\n\n"), b"zz\r\nnot a chunk\r\n", pause=0.02)
        await conn.until_gone()

    async with scripted_engine(handler) as engine, engine_client() as client:
        got, error = await stream_until_it_breaks(client, engine.url + "/v1/completions")
        await within(engine.connections[0].gone.wait())
    assert got == b"data: 1\n\n"
    assert error.kind == "protocol"


@pytest.mark.parametrize(
    "status, body, kind, message",
    [
        (
            503,
            b'{"error": {"message": "engine is overloaded", "type": "x", "code": 503}}',
            "http_5xx",
            "engine is overloaded",
        ),
        (
            400,
            b'{"object": "error", "message": "max_tokens is too large", "code": 400}',
            "http_4xx",
            "max_tokens is too large",
        ),
        (500, b"<html>Traceback: secret.py line 3</html>", "http_5xx", "HTTP 500"),
    ],
)
async def test_error_carries_the_engines_status_kind_and_message(
    status: int, body: bytes, kind: str, message: str
) -> None:
    async def handler(conn: Conn) -> None:
        await serve_requests(conn, answer(status, body, b"content-type: application/json"))

    async with scripted_engine(handler) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        for request_id in ("a", "b"):
            with await client.post(url, {}, request_id) as response:
                assert response.status == status
                error = await response.error()
            assert error.kind == kind
            assert error.status == status
            assert message in error.message
            assert url in error.message
            assert "secret" not in error.message, "a page is logged, never passed on"
            assert error.engine_fault is (kind != "http_4xx")

    # The error body was read to its end: an error answer does not cost a connection.
    assert [len(conn.requests) for conn in engine.connections] == [2]


# ---------------------------------------------------------------------------- probe


@pytest.mark.parametrize("status", [101, 204, 304, 307, 999])
async def test_a_status_no_engine_answers_with_is_a_protocol_error_its_body_unread(
    status: int,
) -> None:
    """Passed on, a 204 with a body broke the client's next request on that connection,
    a 101 hung it, a 999 made uvicorn send nothing at all."""

    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 %d Odd\r\ncontent-length: 5\r\n\r\nhello" % status)
        await conn.until_gone()

    async with scripted_engine(handler) as engine, engine_client() as client:
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            assert response.status == status
            error = await within(response.error())
        assert (error.status, error.kind) == (502, "protocol")
        assert f"answered HTTP {status}" in error.message
        await until(lambda: engine.connections[0].gone.is_set())
        assert idle(client) == []


async def test_an_error_body_is_read_up_to_a_few_kib_and_the_connection_closed() -> None:
    """A 50 MiB error page was read whole to quote 200 characters of it."""
    page = b"x" * (50 << 20)

    async def handler(conn: Conn) -> None:
        await conn.request()
        with contextlib.suppress(ConnectionError):
            await conn.send(answer(500, page))
        await conn.until_gone()

    async with scripted_engine(handler) as engine, engine_client() as client:
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            error = await within(response.error())
        assert (error.status, error.kind) == (500, "http_5xx")
        await until(lambda: engine.connections[0].gone.is_set())
        assert idle(client) == []


async def test_an_answer_over_max_response_bytes_is_refused_and_not_held() -> None:
    async def handler(conn: Conn) -> None:
        while await conn.request() is not None:
            with contextlib.suppress(ConnectionError):
                await conn.send(answer(200, b"y" * 5000))

    async with scripted_engine(handler) as engine, engine_client() as client:
        client.max_response_bytes = 4096
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            with pytest.raises(UpstreamError) as caught:
                await response.read()
        error = caught.value
        assert (error.status, error.code, error.kind) == (502, "response_too_large", "too_large")
        assert error.evidence is None and not error.engine_fault
        client.max_response_bytes = 5000
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            assert await response.read() == b"y" * 5000


async def test_probe_200_is_healthy_and_a_503_is_reported() -> None:
    async def handler(conn: Conn) -> None:
        while (request := await conn.request()) is not None:
            healthy = request.line == b"GET /health HTTP/1.1"
            await conn.send(answer(200) if healthy else answer(503, b"starting"))

    async with scripted_engine(handler) as engine, engine_client() as client:
        assert await client.probe(engine.url + "/health", 1.0) is None
        sick = await client.probe(engine.url + "/sick", 1.0)
        assert sick == Failure("probe status", "health check answered 503", Evidence.SOFT)
    probe = engine.requests[0]
    assert probe.header(b"host") == f"{HOST}:{engine.port}".encode()
    assert probe.header(b"content-length") is None


async def test_probe_without_answer_in_time_reports_the_timeout() -> None:
    async with scripted_engine(never_answers) as engine, engine_client(read_timeout=10) as client:
        started = time.monotonic()
        problem = await client.probe(engine.url + "/health", 0.2)
        assert time.monotonic() - started < 1.0
        await within(engine.connections[0].gone.wait())
    assert problem == Failure(
        "probe timeout", "health check: no answer within 0.2 s", Evidence.SOFT
    ), "slow: soft evidence, never enough for dead"


async def test_probe_of_a_refused_port_reports_it() -> None:
    with refused_port() as sock:
        async with engine_client() as client:
            problem = await client.probe(f"http://{HOST}:{sock.getsockname()[1]}/health", 1.0)
    assert problem is not None
    assert (problem.kind, problem.evidence) == ("probe refused", Evidence.HARD)
    assert problem.message.startswith("health check failed:")
    assert "unreachable" in problem.message


# ---------------------------------------------------------------------------- transport


class Flood:
    """An engine answering 8 MiB as fast as TCP takes it, which notes when the router stops
    reading (``stalled``: TCP pushes back to it)."""

    def __init__(self, seed: int) -> None:
        self.total = 8 << 20
        self.payload = random.Random(seed).randbytes(self.total)
        self.written = 0
        self.stalled = asyncio.Event()

    async def __call__(self, conn: Conn) -> None:
        await conn.request()
        conn.writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % self.total)
        while self.written < self.total:
            conn.writer.write(self.payload[self.written : self.written + (64 << 10)])
            self.written = min(self.total, self.written + (64 << 10))
            drain = asyncio.ensure_future(conn.writer.drain())
            done, _ = await asyncio.wait({drain}, timeout=0.2)
            if not done:
                self.stalled.set()
                await drain
        await serve_ok(conn)


async def test_a_consumer_that_does_not_read_stops_the_engine_and_loses_nothing() -> None:
    handler = Flood(7)
    total, payload, stalled = handler.total, handler.payload, handler.stalled

    async with scripted_engine(handler) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        with await client.post(url, {}, "r") as response:
            await within(stalled.wait(), 1.5)
            conn = response._conn
            assert conn._transport is not None
            assert not conn._transport.is_reading()
            # What the router holds is bounded: the high-water mark plus about one read.
            buffered = conn._buffered
            assert HIGH_WATER < buffered <= HIGH_WATER + (1 << 20)
            assert handler.written < total
            await asyncio.sleep(0.05)
            assert conn._buffered == buffered
            received = await response.read()
        assert len(received) == total
        assert received == payload
        # Back-pressure left the connection fit for reuse.
        await post_ok(client, url, "again")

    assert [len(conn.requests) for conn in engine.connections] == [2]


async def test_a_piped_answer_held_by_its_sink_stops_the_engine_and_never_times_out() -> None:
    # The relay pours a stream to its client from the connection's callback (``pipe``); a
    # client that does not read makes the sink hold the engine back, as a consumer that does
    # not read does above, and the wait is its client's: no read timeout, not "awaiting".
    handler = Flood(8)
    total, payload, stalled = handler.total, handler.payload, handler.stalled

    async with scripted_engine(handler) as engine, engine_client(read_timeout=0.3) as client:
        url = engine.url + "/v1/completions"
        with await client.post(url, {}, "r") as response:
            poured: list[bytes] = []

            def sink(data: bytes) -> bool:
                poured.append(data)
                if len(poured) == 1:
                    response.hold()
                return False

            piping = asyncio.ensure_future(response.pipe(sink))
            await within(stalled.wait(), 1.5)
            conn = response._conn
            assert conn._transport is not None and not conn._transport.is_reading()
            assert not response.awaiting, "held by its own client: not the engine's silence"
            assert handler.written < total
            taken = len(poured)
            await asyncio.sleep(0.7)  # more than two read timeouts
            assert not piping.done(), "no read timeout while the sink holds the engine"
            assert len(poured) == taken
            response.resume()
            await within(piping, 10)
        assert b"".join(poured) == payload
        # Every read of a round of the loop comes in one piece: far fewer than 64 KiB reads.
        assert len(poured) < total // (64 << 10)
        await post_ok(client, url, "again")

    assert [len(conn.requests) for conn in engine.connections] == [2]


async def test_a_pipe_gets_every_byte_before_the_error_and_stops_when_its_sink_says() -> None:
    events = [b"data: %d\n\n" % index for index in range(5)]

    async def breaks(conn: Conn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + b"".join(chunk(event) for event in events[:3]))
        conn.writer.transport.abort()

    async def ends(conn: Conn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + b"".join(chunk(event) for event in events))
        await conn.send(LAST_CHUNK)
        await conn.until_gone()

    async with scripted_engine(breaks) as engine, engine_client() as client:
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            poured: list[bytes] = []
            with pytest.raises(UpstreamError) as raised:
                await within(response.pipe(lambda data: poured.append(data) is not None), 5)
        assert b"".join(poured) == b"".join(events[:3])
        assert raised.value.kind == "broken_stream"

    async with scripted_engine(ends) as engine, engine_client() as client:
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            poured = []

            def until_two(data: bytes) -> bool:
                poured.append(data)
                return b"data: 1" in b"".join(poured)

            await within(response.pipe(until_two), 5)
            # The sink said stop: the rest stays with the connection, read as before.
            rest = await within(response.read(), 5)
        assert b"".join(poured) + rest == b"".join(events)


class Paused(asyncio.Transport):
    """A transport that only says whether the connection reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True

    def write(self, data: Any) -> None:
        pass

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return False


def answering() -> tuple[EngineConnection, Paused]:
    """A connection whose chunked 200's head is in, its body to come."""
    conn, transport = EngineConnection(), Paused()
    conn.connection_made(transport)
    conn.send(b"POST / HTTP/1.1\r\n\r\n")
    conn.data_received(CHUNKED_HEAD)
    return conn, transport


async def test_bytes_read_after_the_sink_said_stop_stay_with_the_connection(
    anyio_backend: Any,
) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("an asyncio protocol")
    conn, _ = answering()
    poured: list[bytes] = []
    piping = asyncio.ensure_future(conn.pipe(lambda data: poured.append(data) is None, 5))
    await asyncio.sleep(0)
    conn.data_received(chunk(b"A"))
    # The next read lands after the pour that said stop, before the pipe's task resumes.
    asyncio.get_running_loop().call_soon(conn.data_received, chunk(b"B") + LAST_CHUNK)
    await within(piping, 5)
    # Before, the pipe's loop poured it into no sink: lost.
    assert poured == [b"A"] and await within(conn.next_body(5), 5) == b"B"


async def test_a_pipe_begun_held_does_not_read_the_engine(anyio_backend: Any) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("an asyncio protocol")
    conn, transport = answering()
    conn.hold()  # the client was full with the first events, before the pipe began
    piping = asyncio.ensure_future(conn.pipe(lambda data: False, 5))
    await asyncio.sleep(0)
    assert not transport.reading, "before, the pipe read the engine again at once"
    conn.resume()
    assert transport.reading
    piping.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await piping


async def test_first_bytes_come_with_the_head_and_the_read_timeout_runs_from_each() -> None:
    # The relay asks for a 200's head and first body bytes in one wait. Each gap here is
    # under the read timeout, the whole wait over it: no timeout, and the answer whole.
    async def slow(conn: Conn) -> None:
        await conn.request()
        await asyncio.sleep(0.6)
        await conn.send(CHUNKED_HEAD)
        await asyncio.sleep(0.6)
        await conn.send(chunk(b"data: 1\n\n") + LAST_CHUNK)
        await conn.until_gone()

    async def head_then_gone(conn: Conn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD)
        conn.writer.transport.abort()

    async with scripted_engine(slow) as engine, engine_client(read_timeout=1.0) as client:
        url = engine.url + "/v1/completions"
        started = time.monotonic()
        with await within(client.post(url, {}, "r", first_bytes=True), 5) as response:
            assert (
                time.monotonic() - started >= 1.2
            ), "returned before its first bytes (a read timeout run from the request?)"
            assert response.status == 200
            assert await response.next_chunk() == b"data: 1\n\n"
            assert await response.next_chunk() == b""

    async with scripted_engine(head_then_gone) as engine, engine_client() as client:
        url = engine.url + "/v1/completions"
        # A failure after the head is the stream's, as when the head came back alone.
        with await within(client.post(url, {}, "r", first_bytes=True), 5) as response:
            assert response.status == 200
            with pytest.raises(UpstreamError) as raised:
                await within(response.next_chunk(), 5)
        assert "stream broken" in raised.value.message


async def test_engine_connections_set_tcp_nodelay() -> None:
    async with scripted_engine(serve_ok) as engine, engine_client() as client:
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            transport = response._conn._transport
            assert transport is not None
            sock = transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            await response.read()


async def test_connection_made_sets_tcp_nodelay_itself() -> None:
    # Both loops happen to set TCP_NODELAY on their own: this checks the protocol does too,
    # on a TCP socket where it is off.
    class FakeTransport(asyncio.Transport):
        def __init__(self, sock: socket.socket) -> None:
            super().__init__()
            self.sock = sock

        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return self.sock if name == "socket" else default

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        EngineConnection().connection_made(FakeTransport(sock))
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_an_unframed_body_ends_when_the_engine_closes() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nfirst ", b"second", pause=0.02
        )
        conn.close()

    async with scripted_engine(handler) as engine, engine_client() as client:
        with await client.post(engine.url + "/v1/completions", {}, "r") as response:
            assert await response.read() == b"first second"
        assert idle(client) == []


async def test_an_unframed_body_cut_by_a_reset_is_a_broken_stream() -> None:
    async def handler(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nfirst ")
        await asyncio.sleep(0.05)
        conn.reset()

    async with scripted_engine(handler) as engine, engine_client() as client:
        got, error = await stream_until_it_breaks(client, engine.url + "/v1/completions")
    assert got == b"first "
    assert error.kind == "broken_stream"


# ---------------------------------------------------------------------------- a real engine


async def test_the_simulated_engine_streams_reuses_and_learns_of_an_abort() -> None:
    uvicorn = pytest.importorskip("uvicorn")
    from pd_router.sim.config import EngineSettings, SimConfig
    from pd_router.sim.decode import DecodeEngine

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((HOST, 0))
    port = listener.getsockname()[1]
    settings = EngineSettings(
        role="decode", host=HOST, port=port, engine_id="sim-decode", standalone=True
    )
    sim = DecodeEngine(settings, SimConfig(itl=0.005, default_max_tokens=8))
    config = uvicorn.Config(sim, lifespan="on", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[listener]))
    try:
        await until(lambda: server.started or serving.done(), 2.0)
        assert server.started
        url = f"http://{HOST}:{port}/v1/completions"
        async with engine_client() as client:
            body = {"prompt": "one two three", "max_tokens": 5, "stream": True}
            with await client.post(url, body, "streamed") as response:
                assert response.status == 200
                stream = b"".join([data async for data in chunks(response)])
                first = response._conn
            events = [e for e in stream.split(b"\n\n") if e]
            assert len(events) == 6 and events[-1] == b"data: [DONE]"

            with await client.post(url, {"prompt": "x", "max_tokens": 3}, "plain") as response:
                assert response._conn is first  # uvicorn's keep-alive connection, reused
                assert orjson.loads(await response.read())["usage"]["completion_tokens"] == 3

            body = {"prompt": "x", "max_tokens": 1000, "stream": True}
            with await client.post(url, body, "abandoned") as response:
                await response.next_chunk()
            await until(lambda: sim.counters.aborted == 1)
            assert sim.counters.completed == 2
            assert list(sim.request_ids) == ["streamed", "plain", "abandoned"]
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await within(serving, 3.0)
        listener.close()

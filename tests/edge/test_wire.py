"""The client protocol's ``Wire`` on a real uvicorn server: a started chunked response
written straight to the client's transport, from outside any ``send``, with uvicorn's flow
control telling the writer when the client is full and when it takes writes again."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from pd_router.edge.protocol import (
    WIRE,
    ClientLimits,
    ClientStats,
    Departure,
    Wire,
    protocol,
)

pytestmark = pytest.mark.anyio

PIECE = bytes(range(256)) * 256  # 64 KiB
LIMIT = 512 << 20  # far beyond what the socket buffers of a client that does not read hold


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn serves on asyncio


class App:
    """POST: a chunked answer; its first bytes through ``send``, then pieces through the
    wire until the client is full, the rest once it takes writes again."""

    def __init__(self) -> None:
        self.full = asyncio.Event()
        self.writable = asyncio.Event()
        self.written = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        wire: Wire = scope["extensions"][WIRE]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        if scope["path"] == "/full":
            while wire.write(PIECE):
                self.written += len(PIECE)
                assert self.written < LIMIT, "the client never showed as full"
            self.written += len(PIECE)
            self.full.set()
            wire.when_writable(self.writable.set)
            await self.writable.wait()
        assert wire.write(b"after")
        await send({"type": "http.response.body", "body": b"last", "more_body": False})


@asynccontextmanager
async def serving(app: App) -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    limits = ClientLimits(max_head=1 << 16, header_timeout=10, body_timeout=10, max_connections=8)
    config = uvicorn.Config(
        app, http=protocol(limits, ClientStats()), lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task


def dechunked(raw: bytes) -> bytes:
    """The body of one chunked response, checked to its last chunk."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head
    body = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        length = int(size, 16)
        if length == 0:
            assert rest == b"\r\n"
            return body
        body += rest[:length]
        assert rest[length : length + 2] == b"\r\n"
        rest = rest[length + 2 :]


async def exchange(port: int, path: str, app: App | None = None) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".encode())
    if app is not None:
        await asyncio.wait_for(app.full.wait(), 60)
        assert not app.writable.is_set()
    raw = b""
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        data = await asyncio.wait_for(reader.read(1 << 20), 60)
        assert data, raw[-200:]
        raw += data
    writer.close()
    return raw


async def test_a_wire_writes_chunks_and_says_when_the_client_is_full_and_takes_more() -> None:
    app = App()
    async with serving(app) as port:
        assert dechunked(await exchange(port, "/")) == b"firstafterlast"
        raw = await exchange(port, "/full", app)
        assert app.writable.is_set()
        body = dechunked(raw)
        assert body == b"first" + PIECE * (app.written // len(PIECE)) + b"afterlast"


def test_a_departure_heard_before_anyone_listens_is_told_at_once() -> None:
    """The client left before the request set its callback (a hang-up as it was admitted):
    told when the callback is set, once; never again."""
    departure = Departure()
    departure.left(1.0)
    seen: list[float] = []
    departure.on_leave(seen.append)
    assert seen == [1.0]
    departure.left(2.0)
    assert seen == [1.0]

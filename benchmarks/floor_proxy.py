"""The least a Python P/D proxy does per request: the floor under pd-router's CPU cost.

    python benchmarks/floor_proxy.py --front asyncio PREFILL_URL DECODE_URL[,DECODE_URL] PORT
    python benchmarks/floor_proxy.py --front uvicorn PREFILL_URL DECODE_URL[,DECODE_URL] PORT

Per request: read the client's JSON body, send the prefill engine the body with
``max_tokens=1``, ``stream=false`` and vLLM's ``kv_transfer_params`` request, send a decode
engine (in turn) the body with the answer's ``kv_transfer_params``, and pass its answer's
bytes to the client as they come. Nothing else: no validation, no pool, no timeouts, no
errors handled, no logs, no metrics. Upstream HTTP is asyncio protocols with httptools on
uvloop, kept-alive connections reused; ``--front asyncio`` serves the client the same way
(a protocol of its own), ``--front uvicorn`` is an ASGI app served by uvicorn (httptools,
uvloop), as pd-router is. ``floor_bench.py`` measures both beside pd-router and vllm-router.
Not for any use but measuring: an engine's error or a client gone mid-request breaks it.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httptools
import orjson
import uvicorn
import uvloop

from pd_router.engines.handshake import PREFILL_KV_PARAMS


class Upstream(asyncio.Protocol):
    """One kept-alive connection to an engine, one request at a time."""

    def __init__(self, pool: list[Upstream], host: bytes) -> None:
        self.pool = pool
        self.host = host
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.body: list[bytes] = []
        self.on_chunk: Callable[[bytes], None] | None = None
        self.done: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        # An engine closes a connection kept idle too long (uvicorn's keep-alive timeout).
        if self in self.pool:
            self.pool.remove(self)
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the engine closed the connection"))

    def on_body(self, body: bytes) -> None:
        if self.on_chunk is not None:
            self.on_chunk(body)
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        done, self.done = self.done, None
        body, self.body = b"".join(self.body), []
        self.on_chunk = None
        self.pool.append(self)
        assert done is not None  # nosec B101
        done.set_result(body)

    def post(
        self, path: bytes, body: dict[str, Any], on_chunk: Callable[[bytes], None] | None = None
    ) -> asyncio.Future[bytes]:
        data = orjson.dumps(body)
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n" % (
            path,
            self.host,
        )
        assert self.transport is not None  # nosec B101
        self.transport.write(b"%scontent-length: %d\r\n\r\n%s" % (head, len(data), data))
        self.on_chunk = on_chunk
        self.done = asyncio.get_running_loop().create_future()
        return self.done


class Engines:
    """Idle connections to each engine; the decode engines taken in turn."""

    def __init__(self, prefill: str, decode: list[str]) -> None:
        self.prefill = prefill
        self.decode = decode
        self.idle: dict[str, list[Upstream]] = {url: [] for url in [prefill, *decode]}
        self.turn = 0

    async def connection(self, url: str) -> Upstream:
        idle = self.idle[url]
        while idle:
            connection = idle.pop()
            if connection.transport is not None and not connection.transport.is_closing():
                return connection
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(
            lambda: Upstream(idle, f"{host}:{port}".encode()), host, int(port)
        )
        return connection

    async def prefill_then_decode(
        self, path: bytes, raw: bytes, on_chunk: Callable[[bytes], None]
    ) -> asyncio.Future[bytes]:
        """The prefill's round trip; then the decode request sent, its answer's bytes going
        to ``on_chunk``, and the future of its end."""
        body = orjson.loads(raw)
        prefill = dict(body, max_tokens=1, stream=False, kv_transfer_params=PREFILL_KV_PARAMS)
        answer = orjson.loads(await (await self.connection(self.prefill)).post(path, prefill))
        decode = self.decode[self.turn % len(self.decode)]
        self.turn += 1
        handed = dict(body, kv_transfer_params=answer["kv_transfer_params"])
        return (await self.connection(decode)).post(path, handed, on_chunk)


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Client(asyncio.Protocol):
    """``--front asyncio``: the client's connection, its requests one after another."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        raw, self.body = b"".join(self.body), []
        if self.url == b"/health":
            assert self.transport is not None  # nosec B101
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        asyncio.ensure_future(self.respond(raw))

    async def respond(self, raw: bytes) -> None:
        transport = self.transport
        assert transport is not None  # nosec B101
        head = [HEAD]

        def chunk(data: bytes) -> None:
            transport.write(b"%s%x\r\n%s\r\n" % (head.pop() if head else b"", len(data), data))

        await (await self.engines.prefill_then_decode(self.url, raw, chunk))
        transport.write(b"0\r\n\r\n")


def asgi_app(engines: Engines) -> Callable[..., Awaitable[None]]:
    """``--front uvicorn``: the same as an ASGI app; a chunk is one ``send``."""

    async def app(
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200})
            await send({"type": "http.response.body", "body": b""})
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        path = scope["path"].encode()
        done = await engines.prefill_then_decode(path, b"".join(parts), chunks.put_nowait)
        done.add_done_callback(lambda _: chunks.put_nowait(None))
        head = [(b"content-type", b"text/event-stream")]
        started = False
        while (data := await chunks.get()) is not None:
            if not started:
                await send({"type": "http.response.start", "status": 200, "headers": head})
                started = True
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--front", choices=("asyncio", "uvicorn"), required=True)
    parser.add_argument("prefill")
    parser.add_argument("decode", help="comma-separated")
    parser.add_argument("port", type=int)
    args = parser.parse_args()
    engines = Engines(args.prefill, args.decode.split(","))
    if args.front == "uvicorn":
        uvicorn.run(
            asgi_app(engines),
            host="127.0.0.1",
            port=args.port,
            loop="uvloop",
            http="httptools",
            lifespan="off",
            log_level="warning",
            access_log=False,
        )
        return

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Client(engines), "127.0.0.1", args.port)
        await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()

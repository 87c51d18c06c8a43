"""HTTP to the engines: the router's only engine I/O.

aiohttp, chosen by measurement: 25-42 µs of client CPU per streamed event at 256-1024
concurrent streams against 137-204 µs for httpx 0.28 (see the README's Performance notes).
It runs on asyncio only, which is what uvicorn serves the router on; the pool and the
protocol code above stay backend-neutral.

Closing a response before its end closes its connection, which is how vLLM learns that
the request is to be aborted; a response read to its end goes back to the keep-alive pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from .errors import UpstreamError, upstream_message

KEEPALIVE_SECONDS = 4.0

# Every failure aiohttp reports for a peer that is gone, refuses, or stops talking.
_FAILURES = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


class Response:
    __slots__ = ("status", "_raw", "url")

    def __init__(self, raw: aiohttp.ClientResponse, url: str) -> None:
        self.status = raw.status
        self._raw = raw
        self.url = url

    def close(self) -> None:
        """Drop the connection unless the response was read to its end: the engine aborts.

        Synchronous, so it also runs in a cancelled scope.
        """
        self._raw.close()

    async def read(self) -> bytes:
        try:
            return await self._raw.read()
        except _FAILURES as exc:
            raise _failure(f"{self.url}: connection lost", exc) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """Bytes as the engine sends them, coalesced when several arrived at once."""
        content = self._raw.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    return
                yield data
        except _FAILURES as exc:
            raise _failure(f"{self.url}: stream broken", exc) from None

    async def error(self) -> UpstreamError:
        """The engine's non-200 answer as an error carrying its status and message."""
        raw = await self.read()
        kind = "http_4xx" if 400 <= self.status < 500 else "http_5xx"
        message = f"{self.url}: {upstream_message(self.status, raw)}"
        return UpstreamError(message, status=self.status, kind=kind)


class Upstream:
    def __init__(self, *, connect_timeout: float, read_timeout: float) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout, sock_read=read_timeout
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No cap on connections: the pool's slots are the admission control, and a cap
        # below them would queue streams invisibly inside the client. Idle connections are
        # dropped before the engine's server does (uvicorn, and so vLLM, closes them after
        # 5 s): reusing one the engine is closing fails the request that picked it.
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_SECONDS
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            skip_auto_headers=("User-Agent",),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited")
        return self._session

    @asynccontextmanager
    async def post(self, url: str, body: Any, request_id: str) -> AsyncIterator[Response]:
        """POST ``body`` as JSON; yields once the engine's status and headers are in."""
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        try:
            raw = await self.session.post(url, data=orjson.dumps(body), headers=headers)
        except aiohttp.ClientConnectorError as exc:
            message = f"{url}: unreachable: {_describe(exc)}"
            raise UpstreamError(message, kind="unreachable") from None
        except _FAILURES as exc:
            raise _failure(f"{url}: no answer", exc) from None
        response = Response(raw, url)
        try:
            yield response
        finally:
            response.close()

    async def probe(self, url: str, timeout: float) -> str | None:
        """GET ``url``: None when it answered 200 in time, else what went wrong."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as raw:
                await raw.read()
                return None if raw.status == 200 else f"health check answered {raw.status}"
        except _FAILURES as exc:
            return f"health check failed: {_describe(exc)}"

    async def get_json(self, url: str) -> Any:
        try:
            async with self.session.get(url) as raw:
                raw.raise_for_status()
                return await raw.json(content_type=None, loads=orjson.loads)
        except (*_FAILURES, ValueError) as exc:
            raise UpstreamError(f"{url}: {_describe(exc)}") from None


def _failure(context: str, exc: BaseException) -> UpstreamError:
    kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "broken_stream"
    return UpstreamError(f"{context}: {_describe(exc)}", kind=kind)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__

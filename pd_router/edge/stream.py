"""The client side of one exchange: what has been sent, and how to end it from any state.

An error before the headers went out is a JSON body with its status; after, it is one SSE
error event then ``[DONE]``. Either way the client gets exactly one terminal outcome.

Events go out through the ASGI ``send``, or, once the response has started, through the
router's client protocol's ``Wire`` when it has one (``pour``): synchronously, from any
callback, for the relay to pass an engine's bytes on without waking its task.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
from starlette.types import Message, Send

from pd_router.edge.protocol import Wire
from pd_router.errors import RouterError

SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def error_event(body: dict[str, Any]) -> bytes:
    """The one event that ends a stream that failed after its headers went out."""
    return b"data: " + orjson.dumps(body) + b"\n\ndata: [DONE]\n\n"


def json_headers(length: int, extra: dict[str, str] | None = None) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(length).encode()),
    ]
    headers.extend((k.lower().encode(), v.encode()) for k, v in (extra or {}).items())
    return headers


async def _unattached(message: Message) -> None:
    raise RuntimeError("ClientStream.attach() was not called")


class ClientStream:
    def __init__(self, request_id: str) -> None:
        self._send: Send = _unattached
        self._wire: Wire | None = None
        self._id_header = (b"x-request-id", request_id.encode())
        self.started = False
        self.finished = False
        self.failed = False
        self.bytes_sent = 0
        self.status = 0
        # perf_counter() when the first byte of the answer went out: the router's TTFT.
        self.first_byte_at: float | None = None

    def attach(self, send: Send, wire: Wire | None = None) -> None:
        """``wire``: the client protocol's, if it has one (``edge/protocol.py``)."""
        self._send = send
        self._wire = wire

    async def respond(
        self, status: int, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        """A whole response at once (JSON answers and errors before streaming)."""
        await self._start(status, [*json_headers(len(body), headers), self._id_header])
        await self._body(body, more=False)

    async def start_events(self) -> None:
        await self._start(200, [*SSE_HEADERS, self._id_header])

    async def write(self, data: bytes) -> None:
        await self._body(data, more=True)

    async def end_events(self, last: bytes) -> None:
        await self._body(last, more=False)

    @property
    def pours(self) -> bool:
        """``pour`` may be used now: events started (``start_events``: the head waits for
        the first bytes, ``edge/protocol.py``) and not ended, and a wire to write on."""
        return self._wire is not None and self.started and not self.finished

    def pour(self, data: bytes) -> bool:
        """``write``, synchronously (when ``pours``): whether the client takes more now; if
        not, ``when_writable``'s callback is called once it does."""
        assert self._wire is not None  # nosec B101: ``pours`` says so
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()
        self.bytes_sent += len(data)
        return self._wire.write(data)

    def when_writable(self, callback: Callable[[], None] | None) -> None:
        if self._wire is not None:
            self._wire.when_writable(callback)

    @property
    def answered(self) -> bool:
        """The client has its whole answer (not an error)."""
        return self.finished and not self.failed and self.status == 200

    async def fail(self, error: RouterError) -> None:
        if self.finished:
            return
        self.failed = True
        if not self.started:
            await self.respond(error.status, error.json(), error.headers)
        else:
            await self._body(error_event(error.body()), more=False)

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, data: bytes, *, more: bool) -> None:
        if data and self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()
        self.bytes_sent += len(data)
        self.finished = not more
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

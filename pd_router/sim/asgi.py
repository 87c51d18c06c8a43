"""Raw ASGI plumbing for the sim engines.

The engines are raw ASGI rather than Starlette endpoints because they must notice a client
that leaves: uvicorn never cancels an app when its client disconnects (``send`` just turns
into a no-op), so every slow step runs under :meth:`Exchange.run_until_disconnect`, which
watches ``receive()`` for ``http.disconnect`` and cancels the work.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

import anyio
import orjson

from pd_router.sim.payloads import JSON, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

T = TypeVar("T")

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


class ApiError(Exception):
    """A request the engine refuses, answered with an OpenAI error body (400 unless told)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class SimulatedCrash(Exception):
    """Raised after a response has started so that uvicorn drops the connection mid-body."""


class CrashLogFilter(logging.Filter):
    """Keeps injected crashes out of uvicorn's error log; real bugs still get logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, SimulatedCrash)


def dumps(payload: object) -> bytes:
    return orjson.dumps(payload)


def sse_event(payload: object) -> bytes:
    # Byte-for-byte vLLM's framing: compact JSON, one event per "data:" line.
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class Exchange:
    """One HTTP request and its response."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.started = False
        self.disconnected = False
        # Called once, as the response's last byte is handed to the server.
        self.on_last_byte: Callable[[], None] | None = None

    @property
    def method(self) -> str:
        return str(self.scope["method"])

    @property
    def path(self) -> str:
        return str(self.scope["path"])

    def header(self, name: bytes) -> str | None:
        for key, value in self.scope["headers"]:
            if key.lower() == name:
                return bytes(value).decode("latin-1")
        return None

    async def read_body(self) -> bytes | None:
        """The whole request body, or None if the client left before sending it."""
        chunks: list[bytes] = []
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def read_json_object(self) -> dict[str, Any] | None:
        """The body as a JSON object; None if the client left. Raises ApiError."""
        body = await self.read_body()
        if body is None:
            return None
        try:
            payload = orjson.loads(body) if body else None
        except orjson.JSONDecodeError as exc:
            raise ApiError(f"malformed JSON body: {exc}") from None
        if not isinstance(payload, dict):
            raise ApiError("the request body must be a JSON object")
        return payload

    async def respond(self, status: int, payload: object) -> None:
        body = dumps(payload)
        await self.start(status, _JSON_HEADERS + [(b"content-length", str(len(body)).encode())])
        await self.send_body(body, more=False)

    async def respond_error(self, status: int, message: str, param: str | None = None) -> None:
        await self.respond(status, error_body(status, message, param))

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def start_stream(self) -> None:
        await self.start(200, list(_SSE_HEADERS))

    async def send_body(self, data: bytes, more: bool) -> None:
        if not more and self.on_last_byte is not None:
            self.on_last_byte()
            self.on_last_byte = None
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def respond_truncated(self, payload: JSON) -> None:
        """Announce the whole JSON body but send only half; the caller then crashes."""
        body = dumps(payload)
        await self.start(200, _JSON_HEADERS + [(b"content-length", str(len(body)).encode())])
        await self.send_body(body[: len(body) // 2], more=True)

    async def run_until_disconnect(self, work: Callable[[], Awaitable[T]]) -> T | None:
        """Run ``work`` until it returns, or cancel it and return None if the client leaves.

        Call only after the request body has been read: the watcher consumes ``receive()``.
        """
        result: list[T] = []
        async with anyio.create_task_group() as group:
            group.start_soon(self._watch_disconnect, group.cancel_scope)
            # Nothing may await between work() returning and the append: after a completed
            # response uvicorn reports "disconnect" at once, which must not count as an abort.
            result.append(await work())
            group.cancel_scope.cancel()
        return result[0] if result else None

    async def _watch_disconnect(self, scope: anyio.CancelScope) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                scope.cancel()
                return

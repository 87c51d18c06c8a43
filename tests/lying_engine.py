"""A decode engine that lies when asked to: raw HTTP on 127.0.0.1, in a thread of its own.

A request whose prompt is ``lie:NAME`` gets the raw bytes the test put in ``lies[NAME]``
(a status no engine sends, an HTML page, an endless body...); any other request gets a
correct answer, streamed or not, so that bystanders on the same router are served. It
takes no KV: the router cannot tell, and the prefill engine's lease lets the blocks go.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

HOST = "127.0.0.1"
# Bytes, or a function that writes its own answer (for bodies too large to build).
Lie = bytes | Callable[[asyncio.StreamWriter], Any]

COMPLETION = {
    "id": "cmpl-liar",
    "object": "text_completion",
    "model": "sim-model",
    "choices": [{"index": 0, "text": " fine", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def http(status: int, body: bytes, *headers: str, reason: str = "X") -> bytes:
    head = [f"HTTP/1.1 {status} {reason}", f"content-length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def events(*payloads: bytes, crlf: bool = False) -> bytes:
    end = b"\r\n\r\n" if crlf else b"\n\n"
    return b"".join(b"data: " + payload + end for payload in payloads)


def token(text: str) -> bytes:
    return json.dumps({"object": "text_completion", "choices": [{"text": text}]}).encode()


STREAM = events(token(" one"), token(" two"), b"[DONE]")


def error_event(code: int) -> bytes:
    """vLLM's event for an error raised while it generates (``create_streaming_error_response``)."""
    error = {"message": "boom", "type": "InternalServerError", "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def slowly(count: int, interval: float) -> Lie:
    """A correct stream of ``count`` events, ``interval`` seconds apart: holds a slot."""

    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        for index in range(count):
            writer.write(events(token(f" {index}")))
            await writer.drain()
            await asyncio.sleep(interval)
        writer.write(events(b"[DONE]"))
        await writer.drain()

    return write


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def then(count: int, tail: bytes, hold: bool = False) -> Lie:
    """``count`` correct events, each in a read of its own (the router pours them as they
    come), then ``tail`` as it is; then, with ``hold``, nothing more on a connection left
    open, else the connection closed (as its head says, so that it is not reused)."""

    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD if hold else STREAM_HEAD[:-2] + b"connection: close\r\n\r\n")
        for index in range(count):
            writer.write(chunk(events(token(f" {index}"))))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(tail)
        await writer.drain()
        if hold:
            await asyncio.sleep(3600)

    return write


class Flood:
    """A correct stream that never ends, written as fast as the router takes it: how many
    bytes it got out, and whether the router closed it (``closed``, set once it did)."""

    def __init__(self) -> None:
        self.sent = 0
        self.closed = threading.Event()

    async def __call__(self, writer: asyncio.StreamWriter) -> None:
        piece = chunk(events(*[token(" flood")] * 64))
        try:
            writer.write(STREAM_HEAD)
            while True:
                writer.write(piece)
                await writer.drain()
                self.sent += len(piece)
        except ConnectionError:
            self.closed.set()


def endless(status: int, piece: int = 1 << 20) -> Lie:
    """An answer that says it is 1 TiB long and sends until the router hangs up."""

    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n" % (status, 1 << 40))
        chunk = b"<p>" * (piece // 3)
        while True:
            writer.write(chunk)
            await writer.drain()

    return write


def endless_header(size: int, piece: int = 1 << 20) -> Lie:
    """A status line, then one header line ``size`` bytes long that never ends."""

    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-endless: ")
        chunk = b"x" * piece
        for _ in range(size // piece):
            writer.write(chunk)
            await writer.drain()
        await asyncio.sleep(3600)  # and no more: the router must not wait for the rest

    return write


def endless_trailer(size: int, piece: int = 1 << 20) -> Lie:
    """A chunked 200 whose one chunk is a whole answer, then a trailer field ``size`` bytes
    long after the last chunk, never ended."""

    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(chunk(json.dumps(COMPLETION).encode()) + b"0\r\nx-endless: ")
        for _ in range(size // piece):
            writer.write(b"x" * piece)
            await writer.drain()
        await asyncio.sleep(3600)  # and no more: the router must not wait for the rest

    return write


class LyingEngine:
    def __init__(self) -> None:
        self.lies: dict[str, Lie] = {}
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> LyingEngine:
        self._thread.start()
        assert self._ready.wait(10), "the lying engine did not start"
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Lies still holding their connections end first: a coroutine left pending on a
        # stopped loop is closed by the garbage collector later, into a closed loop.
        asyncio.run_coroutine_threadsafe(self._end_lies(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _end_lies(self) -> None:
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, HOST, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = next(
                    (
                        int(x.split(":")[1])
                        for x in lines
                        if x.lower().startswith("content-length:")
                    ),
                    0,
                )
                body = await reader.readexactly(length)
                if not await self._answer(lines[0], body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, line: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False to close the connection afterwards."""
        if line.startswith("GET /health"):
            writer.write(http(200, b""))
            return True
        request = json.loads(body)
        prompt = request.get("prompt")
        lie = None
        if isinstance(prompt, str) and prompt.startswith("lie:"):
            lie = self.lies[prompt[4:]]
        if lie is None:
            if request.get("stream"):
                writer.write(http(200, STREAM, "content-type: text/event-stream"))
            else:
                answer = json.dumps(COMPLETION).encode()
                writer.write(http(200, answer, "content-type: application/json"))
            await writer.drain()
            return True
        if isinstance(lie, bytes):
            # Then on as if all were well: the router decides whether to reuse the connection.
            writer.write(lie)
            await writer.drain()
            return True
        await lie(writer)
        return False

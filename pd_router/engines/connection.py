"""One HTTP/1.1 keep-alive connection to an engine: an asyncio protocol around httptools.

Why not a general HTTP client: on the streaming path the engine's bytes cost a parse and
little else here. httptools (llhttp, C) parses; the callbacks only append bytes and resolve
one future; the read timeout is one timer per connection, moved lazily. A consumer can also
take the body as it arrives, from the connection's own callback (``pipe``): one call per
read and no wake-up of its task until the answer ends.

States, in order: ``send()`` writes a request; the head arrives (``status``); body chunks
arrive; the message completes. A connection is reusable only after a complete message the
engine did not ask to close. Anything else (an abort, a lost peer, a parse error) closes
it. Errors surface to whoever waits, after every byte that arrived before them.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from typing import cast

import httptools

from pd_router.errors import fresh

# Engine bytes not yet taken by the relay; above this the socket stops being read, so a
# slow client slows the engine down (TCP back-pressure) instead of growing our memory. A
# body poured into a sink (``pipe``) is never buffered here: the sink's ``hold`` stops it.
HIGH_WATER = 256 << 10

# Takes the body bytes of one read; returns True when it wants no more of them.
Sink = Callable[[bytes], bool]
# An answer's status line and headers, at most: as a client's head (``edge/protocol.py``),
# httptools takes time quadratic in a header's size (64 MiB held the loop 2.5 s), and an
# engine's head is a few hundred bytes.
MAX_HEAD = 64 << 10


class ConnectionLost(ConnectionError):
    """The engine closed the connection, or the router did, before the answer ended."""


class ReadTimeout(TimeoutError):
    pass


class TlsRefused(ConnectionLost):
    """A new TLS connection the engine closed before answering its first request: what a
    server requiring a client certificate does when it got none it accepts (uvicorn, and
    so vLLM, closes without a TLS alert the client could read)."""


class ProtocolViolation(ValueError):
    """The engine's bytes are not HTTP/1.1."""

    code: str | None = None


class HeadTooLarge(ProtocolViolation):
    """The engine's status line and headers went on past ``MAX_HEAD`` bytes."""

    code = "response_head_too_large"


# What a lost connection parses with: the parser holds the connection's callbacks and the
# connection its parser, a cycle that would leave every closed connection to the cyclic GC.
_UNPLUGGED = httptools.HttpResponseParser(None)


class EngineConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        # The read timeout: one timer per connection, moved lazily. Each wait only sets
        # ``_deadline``; the timer, when it fires early, re-arms itself for the rest.
        self._deadline = 0.0
        self._timeout = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._body: list[bytes] = []
        # httptools' body callback: the list's own append, no Python frame per chunk (an
        # engine's stream is a chunk per token). What a read added is counted, and told,
        # once the read is parsed (``data_received``).
        self.on_body = self._body.append
        self._buffered = 0
        # Body bytes received over the connection's life (progress, for the stall watch).
        self.received = 0
        self._paused = False
        # ``head(first_bytes=True)`` waits: a 200's head alone does not wake it.
        self._first_bytes = False
        # ``pipe``'s sink while it pours; and whether it holds the engine back (``hold``).
        self._sink: Sink | None = None
        self._pouring: asyncio.Handle | None = None
        self._held = False
        self._keep_alive = False
        self._framed = False  # Content-Length or chunked: the end is not the peer closing
        self._expecting = False  # a request is out and its answer has not ended
        self._head_room = MAX_HEAD  # head bytes the current answer may still send
        self._bare = 0  # bytes since the last body bytes (``data_received``)
        self.status = 0
        self.head_done = False
        self.complete = False
        self.error: BaseException | None = None
        self._tls = False
        # Some answer's head arrived on this connection: the engine took it.
        self._answered = False
        # Set by the pool while the connection is idle in it: called if the peer closes.
        self.idle_since = 0.0
        self.on_lost: Callable[[EngineConnection], None] | None = None

    # ------------------------------------------------------------------ asyncio protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        self._tls = transport.get_extra_info("ssl_object") is not None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Small SSE events must not wait for the peer's delayed ACK (Nagle).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self._expecting:
            self._lose(ProtocolViolation("the engine sent bytes nobody asked for"))
            return
        body = self._body
        pieces = len(body)
        after_head = self.head_done
        try:
            if not after_head:
                # Only the head's allowance reaches the parser; what follows the head in
                # the same bytes is fed once the parser has seen the head end.
                room = self._head_room
                self._head_room -= len(data)
                if len(data) > room:
                    self._parser.feed_data(data[:room])
                    if not self.head_done:
                        message = f"status line and headers larger than {MAX_HEAD} bytes"
                        self._lose(HeadTooLarge(message))
                        return
                    data = data[room:]
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lose(ProtocolViolation(f"invalid HTTP from the engine: {exc}"))
        if len(body) > pieces:
            self._bare = 0
            self._took(body, pieces)
        elif after_head:
            # Bytes after the head that are no body: a chunk's framing, or the trailer
            # fields after the last chunk, which httptools builds by concatenation (time
            # quadratic in their size, as a head's): bounded as the head is.
            self._bare += len(data)
            if self._bare > MAX_HEAD and self.error is None:
                message = f"more than {MAX_HEAD} bytes after the head that are no body"
                self._lose(HeadTooLarge(message))

    def _took(self, body: list[bytes], pieces: int) -> None:
        """The body pieces from ``pieces`` on came with the last read."""
        size = len(body[-1]) if len(body) == pieces + 1 else sum(map(len, body[pieces:]))
        self.received += size
        if self._sink is not None:
            if self._pouring is None:
                # Poured once the loop has done this round's reads (the loop reads a
                # socket until it is empty): what they brought goes on in one piece.
                self._pouring = self._loop.call_soon(self._pour_soon)
            return
        self._buffered += size
        if self._buffered > HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._parser = _UNPLUGGED
        self._stop_timer()
        if exc is None and self.head_done and not self.complete and not self._framed:
            self.complete = True  # an unframed body ends when the peer closes (not resets)
        if self.error is None and not self.complete:
            if isinstance(exc, ssl.SSLError):
                self.error = exc  # the engine refused the router's TLS: said as such
            elif self._tls and not self._answered and not self.head_done:
                self.error = TlsRefused(
                    "the engine closed a new TLS connection without answering: it requires "
                    "a client certificate the router did not give, or does not accept it"
                )
            else:
                detail = f": {exc}" if exc is not None else ""
                self.error = ConnectionLost(f"connection closed by the engine{detail}")
        self._keep_alive = False
        self._wake()
        if self.on_lost is not None:
            self.on_lost(self)

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if not self._expecting:
            # A second answer in the same bytes as the one asked for; raising here makes
            # feed_data fail, so it is not appended to the first answer's body.
            raise ProtocolViolation("the engine sent bytes nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        # The length first: most headers are neither.
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_done = self._answered = True
        if self._first_bytes and self.status == 200:
            # Not woken for the head alone; the read timeout runs from it all the same.
            self._deadline = self._loop.time() + self._timeout
        else:
            self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._expecting = False
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    # ------------------------------------------------------------------ the consumer's side

    @property
    def reusable(self) -> bool:
        return (
            self.complete
            and self._keep_alive
            and not self._body
            and self._transport is not None
            and not self._transport.is_closing()
        )

    @property
    def awaiting(self) -> bool:
        """A reader waits for the engine (nothing it could take is buffered, and its sink
        does not hold the engine back)."""
        return self._waiter is not None and not self._held

    def send(self, request: bytes) -> None:
        """Write one request; the previous answer, if any, was read to its end."""
        if self._transport is None:
            raise ConnectionLost("connection closed by the engine")
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.head_done = self.complete = self._framed = self._keep_alive = False
        self._expecting = True
        self._head_room = MAX_HEAD
        self._bare = 0
        self._transport.write(request)

    async def head(self, timeout: float, first_bytes: bool = False) -> int:
        """The answer's status code, once its head is in; with ``first_bytes``, a 200's
        once its first body bytes are in too (or it ended, or failed after its head: that
        is for ``next_body`` to raise, as if the head had been returned alone). Waiting for
        both at once wakes the waiter once instead of twice."""
        self._first_bytes = first_bytes
        try:
            while not self.head_done or (
                first_bytes
                and self.status == 200
                and not self._body
                and not self.complete
                and self.error is None
            ):
                await self._wait(timeout)
        finally:
            self._first_bytes = False
        return self.status

    async def next_body(self, timeout: float) -> bytes:
        """Every body byte that arrived since the last call; ``b""`` once the answer ended."""
        while not self._body:
            if self.complete:
                return b""
            await self._wait(timeout)
        body = self._body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        self._read_again()
        return data

    async def pipe(self, sink: Sink, timeout: float) -> None:
        """Pour the body into ``sink`` as it arrives, from the connection's callbacks, until
        ``sink`` returns True or the answer ends; raises as ``next_body`` does. What one
        round of the event loop's reads brought goes in one call. The read timeout runs
        from the last byte, and not while ``sink`` holds the engine back (``hold``)."""
        self._sink = sink
        try:
            if not self._held:  # (held already: the sink's client was full before it began)
                self._read_again()
            while True:
                # Every byte that arrived before the end or an error goes first; none once
                # the sink said stop (what came since stays for ``next_body``).
                if self._body and self._sink is not None:
                    self._pour()
                if self._sink is None or self.complete:
                    return
                await self._wait(timeout)
        finally:
            self._sink = None
            if self._pouring is not None:
                self._pouring.cancel()
                self._pouring = None
            self.resume()

    def hold(self) -> None:
        """Stop reading the engine (TCP back-pressure) until ``resume``: the sink cannot
        pass more on now. Its wait is then not the engine's silence."""
        self._held = True
        if not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def resume(self) -> None:
        """Read the engine again after ``hold``."""
        if not self._held:
            return
        self._held = False
        self._deadline = self._loop.time() + self._timeout
        self._read_again()

    def close(self) -> None:
        """Close now: an engine mid-answer sees the peer go and aborts the request."""
        if self.error is None and not self.complete:
            self.error = ConnectionLost("connection closed by the router")
        self._keep_alive = False
        if self._transport is not None:
            self._transport.close()

    async def _wait(self, timeout: float) -> None:
        if self.error is not None:
            # A new exception each time, never one a future carries: the kept one, raised,
            # would hold the frames of its raisers and they this connection (a cycle).
            raise fresh(self.error)
        waiter = self._waiter = self._loop.create_future()
        self._timeout = timeout
        self._deadline = deadline = self._loop.time() + timeout
        timer = self._timer
        if timer is None or deadline < timer.when():
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(deadline, self._check_deadline)
        try:
            await waiter
        finally:
            self._waiter = None

    def _check_deadline(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms a timer again
        now = self._loop.time()
        if self._held:
            self._deadline = now + self._timeout  # the sink's client is slow, not the engine
        if now < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)
            return
        self.error = ReadTimeout(f"no byte from the engine for {self._timeout:g} s")
        waiter.set_result(None)

    def _stop_timer(self) -> None:
        # A pending timer keeps the connection referenced by the loop until it fires.
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _read_again(self) -> None:
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def _pour_soon(self) -> None:
        self._pouring = None
        if self._sink is not None and self._body:
            self._pour()

    def _pour(self) -> None:
        body = self._body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        # A byte came: the read timeout runs from now (the timer moves lazily).
        self._deadline = self._loop.time() + self._timeout
        sink = self._sink
        if sink is not None and sink(data):
            self._sink = None
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _lose(self, error: BaseException) -> None:
        self.error = error
        self._keep_alive = False
        if self._transport is not None:
            self._transport.abort()
        self._wake()

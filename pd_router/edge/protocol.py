"""uvicorn's HTTP/1.1 protocol (httptools), with the limits a client connection lives by.

uvicorn bounds none of these: a client could hold a connection (a file descriptor, and at
shutdown the whole process) for ever by sending nothing, a head or a body a byte at a time,
or by opening connections until ``accept`` fails for every other client too. Here:

* a head (request line and headers) larger than ``max_head`` bytes gets 431 before the
  parser sees the excess (parsing one under uvicorn is quadratic in its size: 64 MiB held
  the event loop for 5.8 s, every other client with it);
* a head must be complete ``header_timeout`` seconds after its first byte, the first head
  of a connection ``header_timeout`` seconds after the accept, or it gets 408; a new
  connection that sent nothing by then is closed without an answer, like an idle one;
* a body must keep coming: each ``body_timeout`` seconds of it must bring at least
  ``MIN_BODY_RATE`` bytes a second, or the rest of it, or it gets 408 (before its response
  began; after, the connection is just closed) and the app's ``receive()`` sees
  ``http.disconnect``, so the request ends and its resources are released;
* an answer must keep going out: a client whose transport stays full (it reads nothing,
  or less than the flow control's 48 KiB between its high and low water marks) for
  ``send_timeout`` seconds has its connection aborted, so its request ends as the client's
  leaving and frees its decode slot and engine (nginx's ``send_timeout``);
* beyond ``max_connections`` open connections, ``CONTROL_CONNECTIONS`` more may carry only
  the operator's requests (``/admin/*``, ``/health``, ``/metrics``; any other gets 503
  ``too_many_connections`` and the connection is closed); beyond those a new one gets the
  503 before anything of it is read; the connections already open are untouched;
* on shutdown a request still coming in gets 503 ``shutting_down`` at once, instead of
  holding the process until its client finishes it; responses in progress go on (the
  app's ``--shutdown-timeout`` bounds them), idle connections close (uvicorn).

Idle keep-alive connections are uvicorn's ``timeout_keep_alive`` (``IDLE_TIMEOUT``).

A request's scope carries a ``Departure`` (``scope["extensions"][DEPARTURE]``): told
synchronously when the client leaves before its response is complete, so the app needs no
task reading ``receive()`` for the ``http.disconnect`` to learn it.

A request's scope also carries a ``Wire`` (``scope["extensions"][WIRE]``): the body of a
started chunked response written straight to the client's transport, from any callback,
with the bytes uvicorn's ``send`` would write, and a signal when the client's transport is
full and when it takes writes again (uvicorn's flow control).

A response's status line and headers go out in one write with its first body bytes
(``HeadWithBody``): one syscall, and one TCP segment for the client to wake up for, fewer
per request; a head with no body right behind it goes out when the event loop's current
round ends.

Every such answer is JSON (``errors.py``) with ``connection: close``; then the connection
is half-closed and what the client still sends is read and dropped for up to ``LINGER``
seconds: closing a socket with unread input makes the kernel send a reset, which can
destroy the answer before the client read it. An answer is never written into a response
already begun on the connection (a pipelined request); the connection is closed instead.
"""

from __future__ import annotations

import asyncio
import resource
from asyncio import AbstractEventLoop, Handle, TimerHandle, Transport
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pd_router.errors import (
    BadRequest,
    HeadTooLarge,
    RequestTimeout,
    RouterError,
    ShuttingDown,
    TooManyConnections,
)

# Far above what any OpenAI client sends (a few hundred bytes), far below what hurts.
MAX_HEAD_BYTES = 64 << 10
# A client sends its head in one packet as soon as it is connected; 10 s covers the worst
# network round trips many times over.
HEADER_TIMEOUT = 10.0
# A body's pace is judged over windows this long: long enough for a congested link's
# stalls, short enough that a stalled client lets go of its connection soon.
BODY_TIMEOUT = 30.0
# 1 KiB/s: a request body crosses any network a client really uses far faster; a trickle
# below it (slowloris sends 1 byte/s) would hold a connection for as long as it likes.
MIN_BODY_RATE = 1024
# A client has this long to take what its transport holds (nginx's send_timeout).
SEND_TIMEOUT = 60.0
# Idle keep-alive connections are held longer than clients keep them pooled (httpx and so
# the openai SDK: 5 s, uvicorn's own default too): otherwise a client reuses a connection
# the router is just closing, and its request fails. 75 s is nginx's default, also well
# above the 60 s idle timeout of the common cloud load balancers in front.
IDLE_TIMEOUT = 75.0
# A client that reads what it was sent does so within a round trip; one that does not gets
# no more of a file descriptor, or of a shutdown, than this.
LINGER = 2.0
# File descriptors the process needs besides client and engine connections: the listening
# socket, the event loop's, logs, a health probe per engine, engine connections pooled idle.
FD_RESERVE = 64

# Connections over ``--max-connections`` that may carry only the operator's requests
# (``/admin/*``, ``/health``, ``/metrics``): whatever the data plane holds, an operator can
# still see the fleet and remove a bad node, and a load balancer can still probe. The
# file descriptors come out of ``FD_RESERVE``.
CONTROL_CONNECTIONS = 16

REASONS = (
    "head_too_large",
    "header_timeout",
    "body_timeout",
    "send_timeout",
    "too_many_connections",
    "shutdown",
)

Phase = Literal["idle", "head", "body", "closing"]

# The scope extensions under which a request's ``Departure`` and ``Wire`` are.
DEPARTURE = "pd_router.departure"
WIRE = "pd_router.wire"


def default_max_connections() -> int:
    """The open-file limit less a reserve, halved: each client connection can carry a request
    that holds an engine connection too. At the cap a new client gets a 503 it can act on;
    at the fd limit its ``accept`` would fail, and a request already admitted could not
    reach an engine."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(1, (soft - FD_RESERVE) // 2)


@dataclass(frozen=True)
class ClientLimits:
    max_head: int
    header_timeout: float  # 0: none
    body_timeout: float  # 0: none
    max_connections: int
    send_timeout: float = SEND_TIMEOUT  # 0: none


class ClientStats(Collector):
    """Client connections open, and those a limit closed, for ``/metrics``."""

    def __init__(self) -> None:
        self.open = 0
        self.closed = dict.fromkeys(REASONS, 0)

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "pd_router_client_connections", "Client connections open.", value=self.open
        )
        closed = CounterMetricFamily(
            "pd_router_client_connections_closed",
            "Client connections the router closed on a limit, by reason.",
            labels=["reason"],
        )
        for reason, count in self.closed.items():
            closed.add_metric([reason], count)
        yield closed


class ClientProtocol(HttpToolsProtocol):
    limits: ClientLimits
    stats: ClientStats
    _flow: Flow

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # idle: between messages (or none yet); closing: answered, lingering.
        self._phase: Phase = "idle"
        # Head bytes of the current message so far; counted in the idle and head phases.
        self._head = 0
        # The connection's one deadline: its head's, its body window's, or its linger's.
        self._timer: TimerHandle | None = None
        # Body bytes in the current window.
        self._got = 0
        # The requests of this connection whose response is not complete, oldest first:
        # uvicorn's ``cycle`` is the newest, and a request pipelined behind the one being
        # answered takes that place.
        self._cycles: list[Any] = []

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = self._flow = Flow(transport, self.limits.send_timeout, self._stuck)
        self.stats.open += 1
        cap = self.limits.max_connections
        if self.stats.open > cap + CONTROL_CONNECTIONS:
            error = TooManyConnections(f"the router holds its limit of {cap} client connections")
            self._close_with("too_many_connections", error)
            return
        if self.stats.open > cap:
            self.app = _control_only(self.app, cap, self.stats)
        # Sending nothing holds a file descriptor as surely as sending slowly.
        self._watch(self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.stats.open -= 1
        self._unwatch()
        self._flow.unwatch()
        super().connection_lost(exc)
        # uvicorn tells only its ``cycle``, the newest request: one being answered with
        # another pipelined behind it would stream on into the closed connection, its slot
        # and engine held to the end. Queued ones are never to be answered.
        now = self.loop.time()
        for cycle in self._cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
                _departure(cycle.scope).left(now)

    def data_received(self, data: bytes) -> None:
        self._receive(data)
        # A message still coming in once this read is parsed is timed from now; most come
        # whole in one read (head and body), and need no timer at all.
        if self._timer is None and self._phase in ("head", "body"):
            if not self.transport.is_closing():
                if self._phase == "head":
                    self._watch(self.limits.header_timeout)
                else:
                    self._watch(self.limits.body_timeout, count=False)

    def _receive(self, data: bytes) -> None:
        while data and self._phase != "closing" and not self.transport.is_closing():
            if self._phase == "body":
                super().data_received(data)
                return
            room = self.limits.max_head - self._head
            if room <= 0:
                error = HeadTooLarge(
                    f"request line and headers are larger than {self.limits.max_head} bytes"
                )
                self._close_with("head_too_large", error)
                return
            # Data that holds the end of a head and body bytes after it is split there, so
            # a body is never counted as head.
            part, data = data[:room], data[room:]
            self._head += len(part)
            super().data_received(part)

    def on_message_begin(self) -> None:
        # A connection's first head is timed from the accept, the others from this read
        # (``data_received``).
        self._phase = "head"
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        if self.parser.should_upgrade() and not self._should_upgrade():
            # An upgrade the router does not speak (h2c, ``curl --http2``): the parser hands
            # whatever follows the head to the new protocol, so the body would be lost and a
            # valid request read as empty, the connection unusable after it.
            error = BadRequest(
                "this router speaks HTTP/1.1 only: send the request without 'Upgrade' "
                "(curl: --http1.1, not --http2)"
            )
            self._close_with(None, error)
            return
        self._phase = "body"
        # The body's window starts with it; its timer, if the body does not end in this
        # read, at the read's end (``data_received``).
        self._unwatch()
        self._got = 0
        previous = self.cycle
        # ASGI types an extension as a dict; these are the router's, read by its relay.
        departure = Departure()
        extensions: dict[str, Any] = {DEPARTURE: departure}
        self.scope["extensions"] = extensions
        super().on_headers_complete()
        if self.cycle is not previous:  # not an upgrade: a request to answer
            self._cycles = [cycle for cycle in self._cycles if not cycle.response_complete]
            self._cycles.append(self.cycle)
            held = HeadWithBody(self.transport, self.loop)
            self.cycle.transport = held  # type: ignore[assignment]
            extensions[WIRE] = Wire(held, self._flow, departure)

    def on_body(self, body: bytes) -> None:
        if self._phase == "closing":
            return
        self._got += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._phase == "closing":
            return  # refused at its head: no request of it runs
        self._phase = "idle"
        self._head = 0
        self._unwatch()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own answer to bytes that are not HTTP is plain text; the router's
        # errors are all OpenAI-shaped JSON. Behind a response still being written (bytes
        # sent while a stream runs) none: it would land inside that response's body.
        self._flush_head()
        if self._may_answer():
            self.transport.write(_answer(BadRequest(msg)))
        self.transport.close()

    def shutdown(self) -> None:
        if self._phase == "closing":
            return  # it closes by itself within LINGER
        if self._phase in ("head", "body") and self._may_answer():
            self._close_with("shutdown", ShuttingDown("router shutting down"))
        else:
            super().shutdown()

    def _watch(self, seconds: float, count: bool = True) -> None:
        """``count``: a new window of body bytes (else the bytes of this read stay in it)."""
        self._unwatch()
        if count:
            self._got = 0
        if seconds > 0:
            self._timer = self.loop.call_later(seconds, self._expired, seconds)

    def _unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, seconds: float) -> None:
        self._timer = None
        if self.flow.read_paused or (
            self._phase == "body" and self._got >= seconds * MIN_BODY_RATE
        ):
            # Paused, the router is not reading (a request ahead on this connection is still
            # being answered): the wait is not the client's.
            self._watch(seconds)
        elif self._phase == "idle":
            # Nothing sent: an answer could cross a request the client is just sending.
            self.stats.closed["header_timeout"] += 1
            self.transport.close()
        elif self._phase == "head":
            error = RequestTimeout(f"request line and headers not complete within {seconds:g} s")
            self._close_with("header_timeout", error)
        else:
            error = RequestTimeout(
                f"request body slower than {MIN_BODY_RATE} bytes/s: "
                f"{self._got} bytes in {seconds:g} s"
            )
            self._close_with("body_timeout", error)

    def _stuck(self) -> None:
        """The client took nothing of its answer for ``send_timeout`` seconds: aborted (a
        close would wait for the buffer to drain), its requests told it left."""
        self.stats.closed["send_timeout"] += 1
        self.transport.abort()

    def _may_answer(self) -> bool:
        """No response has begun on this connection that an answer would cut into."""
        if self._phase == "body":
            return not (self.cycle.response_started or self.pipeline)
        return self.cycle is None or self.cycle.response_complete

    def _flush_head(self) -> None:
        """Out with a head held for its body: what the protocol writes itself comes after."""
        if self.cycle is not None and isinstance(self.cycle.transport, HeadWithBody):
            self.cycle.transport.flush()

    def _close_with(self, reason: str | None, error: RouterError) -> None:
        """``reason``: the limit that closed the connection, counted (None: no limit)."""
        if reason is not None:
            self.stats.closed[reason] += 1
        self._flush_head()
        if self._may_answer():
            self.transport.write(_answer(error))
        self._phase = "closing"
        self._unset_keepalive_if_required()
        if self.cycle is not None and not self.cycle.response_complete:
            # The app's receive() says http.disconnect now, not after the linger.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            _departure(self.cycle.scope).left(self.loop.time())
        if self.transport.can_write_eof():
            self.transport.write_eof()
        # Over TLS there is no half-close: the answer is sent, what follows read and dropped,
        # and the connection closed after the linger all the same.
        self.flow.resume_reading()
        self._unwatch()
        self._timer = self.loop.call_later(LINGER, self.transport.close)


class Departure:
    """The client of one request left before its response was complete: the one callback
    set with ``on_leave`` is called once with the event loop's time it left (``loop.time()``;
    the callback runs outside any task, where anyio cannot tell the time), at once if it
    already had."""

    __slots__ = ("_callback", "at")

    def __init__(self) -> None:
        self._callback: Callable[[float], None] | None = None
        self.at: float | None = None  # when the client left

    def on_leave(self, callback: Callable[[float], None] | None) -> None:
        """``callback`` is told; None: nobody is any more (the request ended)."""
        self._callback = callback
        if self.at is not None and callback is not None:
            self.left(self.at)

    def left(self, at: float) -> None:
        if self.at is None:
            self.at = at
        callback, self._callback = self._callback, None
        if callback is not None:
            callback(self.at)


class Flow(FlowControl):
    """uvicorn's flow control, which also tells one waiter when the client's transport
    takes writes again (``Wire.when_writable``), and calls ``stuck`` when it has not for
    ``timeout`` seconds (0: never)."""

    def __init__(self, transport: Transport, timeout: float, stuck: Callable[[], None]) -> None:
        super().__init__(transport)
        self.on_writable: Callable[[], None] | None = None
        self._timeout = timeout
        self._stuck = stuck
        self._timer: TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._timeout > 0 and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._timeout, self._stuck)

    def resume_writing(self) -> None:
        self.unwatch()
        super().resume_writing()
        callback, self.on_writable = self.on_writable, None
        if callback is not None:
            callback()

    def unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Wire:
    """The body of one chunked response, written straight to the client's transport.

    ``write`` writes what uvicorn's ``send`` writes for an ``http.response.body`` message
    with more to come (one chunk), without a coroutine, a message or a task: a caller can
    relay from another connection's callback. Only between the response's start and its
    end, both sent through ``send`` (which keeps uvicorn's own account of the response).
    No reference to the request's cycle or scope: it lives in the scope."""

    __slots__ = ("_transport", "_flow", "_departure")

    def __init__(self, transport: HeadWithBody, flow: Flow, departure: Departure) -> None:
        self._transport = transport
        self._flow = flow
        self._departure = departure

    def write(self, data: bytes) -> bool:
        """Whether the client's transport takes more now: False once its buffer is over
        its high-water mark (uvicorn's ``send`` would wait for it to drain)."""
        transport = self._transport
        if self._departure.at is not None or transport.is_closing():
            return True  # the client left (or was sent away): its request is told
        if not data:
            return True  # an empty chunk would end the response (uvicorn's send skips one)
        transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        return not self._flow.write_paused

    def when_writable(self, callback: Callable[[], None] | None) -> None:
        """``callback`` is called once the client's transport takes writes again (or the
        connection is lost); None: nobody waits any more."""
        self._flow.on_writable = callback


def _departure(scope: Any) -> Departure:
    departure: Departure = scope["extensions"][DEPARTURE]
    return departure


class HeadWithBody:
    """The client transport as one response's cycle writes to it: the first write (the
    status line and headers) is held until the next one, the first body bytes, and both go
    out in one ``writelines``; or, if no body follows in this round of the event loop, alone
    at its end. Everything else goes straight to the transport."""

    __slots__ = ("_transport", "_loop", "_held", "_flush", "_first")

    def __init__(self, transport: Transport, loop: AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush: Handle | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held = data
            self._flush = self._loop.call_soon(self.flush)
            return
        held = self._held
        if held is None:
            self._transport.write(data)
            return
        self._drop_held()
        self._transport.writelines((held, data))

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._drop_held()
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._drop_held()
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def _drop_held(self) -> None:
        self._held = None
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None


def _control_only(app: ASGIApp, cap: int, stats: ClientStats) -> ASGIApp:
    """``app`` for the operator's requests only: a connection over the cap."""

    async def control(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if path.startswith("/admin/") or path in ("/health", "/metrics"):
            await app(scope, receive, send)
            return
        stats.closed["too_many_connections"] += 1
        error = TooManyConnections(
            f"the router holds its limit of {cap} client connections; beyond it only "
            "/admin/*, /health and /metrics are served"
        )
        body = error.json()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *((k.lower().encode(), v.encode()) for k, v in error.headers.items()),
        ]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return control


def _answer(error: RouterError) -> bytes:
    body = error.json()
    headers = {
        "content-type": "application/json",
        "content-length": str(len(body)),
        "connection": "close",
        **error.headers,
    }
    head = f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (head + "\r\n").encode("latin-1") + body


def protocol(limits: ClientLimits, stats: ClientStats) -> type[ClientProtocol]:
    """The protocol class for uvicorn's ``http=``, with these limits and this tally."""
    return type("ClientProtocol", (ClientProtocol,), {"limits": limits, "stats": stats})

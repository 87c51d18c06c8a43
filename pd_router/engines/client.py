"""HTTP to the engines: the router's only engine I/O.

One pool of keep-alive connections per engine origin, no cap (the pool's slots are the
admission control; a cap below them would queue streams invisibly here). Each request is
written in one ``write`` with the headers the engines need and no others. It runs on
asyncio, which is what uvicorn serves the router on; the pool and the protocol code above
stay backend-neutral.

Closing a response before its end closes its connection, which is how vLLM learns that the
request is to be aborted; a response read to its end goes back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import ssl
import time
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import orjson

from pd_router.engines.connection import (
    ConnectionLost,
    EngineConnection,
    ProtocolViolation,
    ReadTimeout,
    Sink,
    TlsRefused,
)
from pd_router.errors import Evidence, LoopDetected, UpstreamError, engine_message
from pd_router.fleet.nodes import Failure

# Idle connections are dropped before the engine's server does (uvicorn, and so vLLM,
# closes them after 5 s): reusing one the engine is closing would fail the request that
# picked it, and a request is never sent twice (an engine that read it and then died sends
# no byte either, so "no answer" does not prove it was not taken).
KEEPALIVE_SECONDS = 4.0

# A non-streamed answer larger than this is refused (502): the router holds it whole.
# 32 MiB is hundreds of thousands of tokens of text, with log-probabilities too.
MAX_RESPONSE_BYTES = 32 << 20
# Of an error answer, the router reads this much: enough for any JSON error message.
ERROR_BODY_BYTES = 4 << 10

log = logging.getLogger("pd_router")

_LOST = (ConnectionLost, ProtocolViolation, ReadTimeout, OSError)
_LOCAL_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# A probe that got no answer in time: the one failure the router's own lag can explain.
PROBE_TIMEOUT = "probe timeout"
# An engine's answers that refuse the router's own credentials (--engine-api-key).
REFUSED = (401, 403)


Origin = tuple[str, int, bool]  # host, port, TLS


class Target(NamedTuple):
    origin: Origin
    host_header: bytes
    path: bytes


@lru_cache(maxsize=1024)
def target(url: str) -> Target:
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if tls else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target((host, port, tls), parts.netloc.encode("ascii"), path.encode("ascii"))


class Response:
    __slots__ = ("status", "url", "_conn", "_origin", "_upstream", "_read_timeout", "_released")

    def __init__(
        self, upstream: Upstream, conn: EngineConnection, origin: Origin, status: int, url: str
    ) -> None:
        self.status = status
        self.url = url
        self._conn = conn
        self._origin = origin
        self._upstream = upstream
        self._read_timeout = upstream.read_timeout
        self._released = False

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def received(self) -> int:
        """Bytes received on this connection so far: the stall watch's sign of progress."""
        return self._conn.received

    @property
    def awaiting(self) -> bool:
        """Someone waits for the engine's next bytes right now."""
        return self._conn.awaiting

    def close(self) -> None:
        """Pool the connection if the answer was read to its end, else close it (the engine
        aborts). Synchronous, so it also runs in a cancelled scope; only the first call
        counts, as the connection may serve another request once pooled."""
        if not self._released:
            self._released = True
            self._upstream.release(self._conn, self._origin)

    async def read(self) -> bytes:
        """The whole answer; more than the router's ``max_response_bytes`` is an error."""
        limit = self._upstream.max_response_bytes
        data, whole = await self._read_at_most(limit)
        if not whole:
            message = f"{self.url}: answer larger than {limit} bytes (--max-response-bytes)"
            raise UpstreamError(message, code="response_too_large", kind="too_large")
        return data

    async def _read_at_most(self, limit: int) -> tuple[bytes, bool]:
        """Up to ``limit`` bytes of the answer, and whether that was all of it (if not, the
        connection is closed when the response is, and the engine stops sending)."""
        parts: list[bytes] = []
        size = 0
        try:
            while data := await self._conn.next_body(self._read_timeout):
                size += len(data)
                if size > limit:
                    return b"".join(parts), False
                parts.append(data)
        except _LOST as exc:
            raise _failure(self.url, "connection lost", exc) from None
        return b"".join(parts), True

    async def finish(self, seconds: float) -> None:
        """Read what is left of an answer whose last event the client has (the end of a
        stream's chunked body, after ``[DONE]``) so that the connection serves again. One
        that did not end within ``seconds`` in all (an engine that holds its body open, or
        sends on), or broke, is not read to its end: closed with the response."""
        conn = self._conn
        deadline = time.monotonic() + seconds
        with contextlib.suppress(*_LOST):
            while await conn.next_body(max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    return

    async def next_chunk(self) -> bytes:
        """The bytes that arrived since the last call (several chunks coalesced), waiting
        for some; ``b""`` once the answer ended. A plain coroutine, not an async generator:
        a generator left before its end would be finalized through the event loop."""
        try:
            return await self._conn.next_body(self._read_timeout)
        except _LOST as exc:
            raise _failure(self.url, "stream broken", exc) from None

    async def pipe(self, sink: Sink) -> None:
        """The rest of the answer, poured into ``sink`` from the connection's callback as it
        arrives (``EngineConnection.pipe``): no wake-up of the caller per read. Returns once
        ``sink`` returned True or the answer ended; errors as ``next_chunk``'s."""
        try:
            await self._conn.pipe(sink, self._read_timeout)
        except _LOST as exc:
            raise _failure(self.url, "stream broken", exc) from None

    def hold(self) -> None:
        """Stop reading the engine until ``resume`` (the sink's client is full)."""
        self._conn.hold()

    def resume(self) -> None:
        if not self._released:  # else the connection may serve another request now
            self._conn.resume()

    async def error(self) -> UpstreamError:
        """The engine's non-200 answer as an error carrying its status and message.

        4xx and 5xx pass on; any other status is not an engine's answer to a generation
        request (a 204, a redirect, a 101, a 999): 502, and its body is not read."""
        if not 400 <= self.status < 600:
            self.close()
            message = f"{self.url}: answered HTTP {self.status}, not an answer an engine gives"
            return UpstreamError(message, kind="protocol")
        raw, _ = await self._read_at_most(ERROR_BODY_BYTES)
        kind = "http_4xx" if self.status < 500 else "http_5xx"
        code = None
        if self.status == LoopDetected.status:
            # What a router answers when it sees its own mark come back.
            kind, code = "loop", LoopDetected.code
        message = f"{self.url}: {_message(self.url, self.status, raw)}"
        if self.status in REFUSED:
            # Told apart from the client's own 401 (invalid_api_key): the router's key is
            # the one refused, and no client can fix that.
            message += " (the engine refused the router's credentials: see --engine-api-key)"
            code = "engine_unauthorized"
        return UpstreamError(message, status=self.status, code=code, kind=kind)


def streamed_error(url: str, payload: bytes) -> UpstreamError:
    """An error event in an engine's stream (vLLM's ``{"error": {...}}`` for an error raised
    while it generated) as the error it would have answered before its stream began: its
    ``code`` as the status (500 if it has none an engine answers with)."""
    try:
        document = orjson.loads(payload)
    except orjson.JSONDecodeError:
        document = None
    error = document.get("error") if isinstance(document, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    status = code if type(code) is int and 400 <= code < 600 else 500
    message = engine_message(payload) or f"HTTP {status}"
    kind = "http_4xx" if status < 500 else "http_5xx"
    return UpstreamError(f"{url}: {message}", status=status, kind=kind)


def _message(url: str, status: int, raw: bytes) -> str:
    message = engine_message(raw)
    if message is not None:
        return message
    if raw:
        log.warning("%s answered %d with a non-JSON body: %r", url, status, raw[:400])
    return f"HTTP {status}"


def no_pass_phrase() -> bytes:
    """``load_cert_chain``'s ``password`` for an encrypted private key: refused, where
    OpenSSL would otherwise ask for its pass phrase on the terminal, and wait."""
    raise ValueError("the private key is encrypted: give it unencrypted (no pass phrase)")


def engine_tls(
    ca: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """The TLS context for ``https://`` engines: the system's CAs, or ``ca`` (a PEM file of
    the private CA the engines' certificates come from); ``cert`` and ``key``: the router's
    client certificate, for engines that require one. ``ValueError`` names the file that
    cannot be used."""
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--engine-ca {ca}: {_describe(exc)}") from None
    if cert is not None:
        try:
            context.load_cert_chain(cert, key, password=no_pass_phrase)
        except (OSError, ssl.SSLError, ValueError) as exc:
            where = cert if key is None else f"{cert} / --engine-key {key}"
            reason = str(exc) if isinstance(exc, ValueError) else _describe(exc)
            raise ValueError(f"--engine-cert {where}: {reason}") from None
    elif key is not None:
        raise ValueError("--engine-key needs --engine-cert (the certificate it goes with)")
    return context


def auth_header(api_key: str | None) -> bytes:
    """The header every engine request carries with ``--engine-api-key``; ``ValueError``
    for a key that cannot be a header value (the message does not repeat it)."""
    if api_key is None:
        return b""
    if not api_key or not api_key.isascii() or not api_key.isprintable() or " " in api_key:
        raise ValueError("--engine-api-key must be printable ASCII with no spaces")
    return b"authorization: Bearer " + api_key.encode("ascii") + b"\r\n"


class Upstream:
    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        api_key: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_response_bytes = max_response_bytes
        # Per origin, idle connections, most recently used last (a dict is an ordered set),
        # and what drops one from there when its peer closes it.
        self._idle: dict[Origin, dict[EngineConnection, None]] = {}
        self._forget: dict[Origin, Callable[[EngineConnection], None]] = {}
        # Closes the connections idle for too long: one timer, armed while any is idle, and
        # not one per connection armed and cancelled with every request.
        self._sweep: asyncio.TimerHandle | None = None
        self._tls = tls
        # Only the router's credentials go to an engine: requests are written here from
        # scratch, and no header of a client's is ever copied into one.
        self._auth = auth_header(api_key)
        # Health URLs refusing the router's credentials now: warned about once, not per probe.
        self._refusing: set[str] = set()
        # The router's mark (``edge/hops.py``; set by ``relay.Router``), sent with every probe
        # and model read too, so that a router that is its own node answers them 508.
        self.mark = b""

    async def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for idle in self._idle.values():
            for conn in list(idle):
                conn.close()
        self._idle.clear()

    async def post(
        self,
        url: str,
        body: Any,
        request_id: str,
        via: bytes = b"",
        headers: bytes = b"",
        *,
        first_bytes: bool = False,
    ) -> Response:
        """POST ``body`` as JSON; returns once the engine's status and headers are in, and
        with ``first_bytes`` a 200's first body bytes too (``EngineConnection.head``).
        ``via``: the routers the request passed through, this one included (``edge/hops.py``);
        ``headers``: more header lines (each ending in CRLF), the trace context's.

        The caller closes the response (``with``, or ``close()``) when done with it.
        """
        head = b"x-request-id: " + request_id.encode() + b"\r\n" + _via(via) + headers
        return await self._request(url, b"POST", orjson.dumps(body), head, first_bytes)

    async def probe(self, url: str, timeout: float) -> Failure | None:
        """GET ``url``: None when it answered 200 in time, else what went wrong."""
        try:
            async with asyncio.timeout(timeout):
                with await self._request(url, b"GET", headers=_via(self.mark)) as response:
                    await response.read()
        except TimeoutError:
            message = f"health check: no answer within {timeout:g} s"
            return Failure(PROBE_TIMEOUT, message, Evidence.SOFT)
        except UpstreamError as error:
            message = f"health check failed: {error.message}"
            if error.kind == "tls":
                return Failure("probe tls", message, Evidence.SOFT)
            if error.kind == "unreachable":
                return Failure("probe refused", message, Evidence.HARD)
            if error.kind in ("broken_stream", "protocol"):
                return Failure("probe broken", message, Evidence.HARD)
            kind = PROBE_TIMEOUT if error.undelivered else "probe error"
            return Failure(kind, message, Evidence.SOFT)
        if response.status == 200:
            self._refusing.discard(url)
            return None
        if response.status in REFUSED:
            self._refused(url, f"{url}: answered HTTP {response.status}")
            return None
        if response.status == LoopDetected.status:
            message = "health check answered 508: the node is this router, not an engine"
            return Failure("loop", message, Evidence.FATAL)
        return Failure("probe status", f"health check answered {response.status}", Evidence.SOFT)

    def _refused(self, url: str, message: str) -> None:
        """A probe or a model read refused for the router's credentials (401 or 403: vLLM
        asks none for /health, a proxy in front may; it does for /v1/models) was answered
        by a server that is up: the engine's health is not in question, ``--engine-api-key``
        is. A probe so refused counts as answered (so the requests fail with that engine's
        own clear 401 rather than "no live node"). Said once per URL, until it answers 200
        again."""
        if url not in self._refusing:
            self._refusing.add(url)
            log.warning(
                "%s: the engine refuses the router's credentials (--engine-api-key); not "
                "counted against its health: %s",
                url,
                message,
            )

    async def get_json(self, url: str, via: bytes = b"") -> Any:
        """GET ``url``'s JSON; ``via`` as for ``post`` (by default, this router's mark)."""
        with await self._request(url, b"GET", headers=_via(via or self.mark)) as response:
            if response.status in REFUSED:
                # vLLM asks for the key on /v1/models, not /health: this says it first.
                self._refused(url, f"{url}: answered HTTP {response.status}")
            if response.status != 200:
                raise await response.error()
            self._refusing.discard(url)
            raw = await response.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"{url}: answer is not JSON") from None

    async def _request(
        self,
        url: str,
        method: bytes,
        body: bytes = b"",
        headers: bytes = b"",
        first_bytes: bool = False,
    ) -> Response:
        where = target(url)
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\n%s%s" % (
            method,
            where.path,
            where.host_header,
            self._auth,
            headers,
        )
        if body:
            head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
        request = head + b"\r\n" + body
        conn = self._pooled(where.origin) or await self._connect(url, where.origin)
        try:
            conn.send(request)
            status = await conn.head(self.read_timeout, first_bytes)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, _LOST):
                raise _failure(url, "no answer", exc) from None
            raise
        return Response(self, conn, where.origin, status, url)

    def release(self, conn: EngineConnection, origin: Origin) -> None:
        if not conn.reusable:
            conn.close()
            return
        idle = self._idle.get(origin)
        if idle is None:
            idle = self._idle[origin] = {}
            self._forget[origin] = partial(_forget, idle)
        conn.idle_since = time.monotonic()
        conn.on_lost = self._forget[origin]
        idle[conn] = None
        if self._sweep is None:
            # Closed when too old even if no request comes to find it so (which ``_pooled``
            # also checks, for a loop that ran the timer late).
            self._sweep = asyncio.get_running_loop().call_later(KEEPALIVE_SECONDS, self._swept)

    def _swept(self) -> None:
        self._sweep = None
        now = time.monotonic()
        too_old = now - KEEPALIVE_SECONDS
        oldest = now
        for origin, idle in list(self._idle.items()):
            for conn in list(idle):  # least recently used first
                if conn.idle_since >= too_old:
                    oldest = min(oldest, conn.idle_since)
                    break
                del idle[conn]
                conn.on_lost = None
                conn.close()
            if not idle:
                # Engines come and go (a new address per pod): none is kept for good.
                del self._idle[origin], self._forget[origin]
        if self._idle:
            # A little after the next one is due: a timer may run a hair early.
            wait = oldest + KEEPALIVE_SECONDS - now + 0.001
            self._sweep = asyncio.get_running_loop().call_later(wait, self._swept)

    def _pooled(self, origin: Origin) -> EngineConnection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        too_old = time.monotonic() - KEEPALIVE_SECONDS
        while idle:
            conn, _ = idle.popitem()
            conn.on_lost = None
            if conn.idle_since >= too_old and conn.reusable:
                return conn
            conn.close()
        return None

    async def _connect(self, url: str, origin: Origin) -> EngineConnection:
        host, port, tls = origin
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    EngineConnection, host, port, ssl=self._tls_context() if tls else None
                )
        except TimeoutError:
            message = f"{url}: unreachable: connect timed out after {self.connect_timeout:g} s"
            raise UpstreamError(message, kind="connect_timeout") from None
        except ssl.SSLError as exc:
            raise tls_failure(url, exc) from None
        except OSError as exc:
            if exc.errno in _LOCAL_ERRNOS:
                # The router's own shortage (file descriptors, buffers): nothing about the
                # engine, and another engine would fare no better.
                message = f"{url}: the router cannot open a connection: {_describe(exc)}"
                raise UpstreamError(message, status=503, kind="local") from None
            raise UpstreamError(
                f"{url}: unreachable: {_describe(exc)}", kind="unreachable"
            ) from None
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = engine_tls()
        return self._tls


def _forget(idle: dict[EngineConnection, None], lost: EngineConnection) -> None:
    idle.pop(lost, None)


def _via(marks: bytes) -> bytes:
    return b"x-pd-router-via: " + marks + b"\r\n" if marks else b""


def tls_failure(url: str, exc: ssl.SSLError | TlsRefused) -> UpstreamError:
    """A TLS handshake that failed, one way or the other: the engine's certificate not
    trusted (``--engine-ca``), or the router's refused or missing (``--engine-cert``)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        reason = f"the engine's certificate is not trusted: {exc.verify_message}"
    else:
        reason = getattr(exc, "reason", None) or _describe(exc)
    message = f"{url}: TLS handshake failed: {reason} (see --engine-ca, --engine-cert)"
    return UpstreamError(message, kind="tls")


def _failure(url: str, what: str, exc: BaseException) -> UpstreamError:
    if isinstance(exc, ssl.SSLError | TlsRefused):
        # After the handshake: TLS 1.3 refuses a client certificate only then.
        return tls_failure(url, exc)
    if isinstance(exc, TimeoutError):
        # The request's own outcome (504); a verdict on a prefill engine only (the relay):
        # a long answer is not a failure. The connection was not lost: the router gave up.
        message = f"{url}: {_describe(exc)}"
        return UpstreamError(message, status=504, code="timeout", kind="timeout")
    message = f"{url}: {what}: {_describe(exc)}"
    if isinstance(exc, ProtocolViolation):
        return UpstreamError(message, kind="protocol", code=exc.code)
    return UpstreamError(message, kind="broken_stream")


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__

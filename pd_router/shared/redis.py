"""A Redis client on anyio, so that it runs under asyncio and trio: commands, Lua scripts
(``Script``) and pub/sub. The protocol is ``shared/resp.py``'s; this module only moves its bytes.

Commands go one at a time per connection (no pipelining across callers): a caller takes
an idle connection, or opens one (at most ``max_connections`` in use and idle together:
callers beyond wait for one), writes its command in one ``send``, reads its reply and puts
the connection back. A new connection sends ``AUTH`` and ``SELECT`` first, in one write.
On asyncio (the router's loop) a pooled connection is an ``asyncio.Protocol``: a command
is one write to the transport and its reply wakes one future, where anyio's stream took a
task switch after each write and two ``epoll_ctl`` calls per read (about 20 us of CPU a
call on uvloop). A call that finds such a connection idle bounds its wait with a timer on
the loop, not an anyio cancel scope (another 10-15 us of CPU a call). Subscriptions, and
everything on trio, use anyio's streams: a subscription reads only as fast as its reader,
so a slow one cannot grow our memory.

Failures:

* The server's error reply raises ``RedisError`` with the server's message.
* Every I/O failure raises ``RedisUnavailable``, whose message names host:port and never
  the password: no connection, a connection lost, bytes that are not RESP, or no reply
  within ``timeout`` seconds (which bounds the whole call: waiting for a connection,
  connecting, writing, reading). The connection is closed, never reused.
* A command that failed with ``RedisUnavailable`` may or may not have run: what was lost
  may be its reply. Nothing is sent twice here (a slot-taking script run twice is worse
  than one failed call); the caller decides. The one exception is safe: a pooled
  connection the server closed while it was idle (a Redis restart) is noticed before use
  and replaced, as nothing was sent on it.

Cancellation, trio-style: ``call`` is a checkpoint. A call cancelled at any point raises
the cancellation unchanged (never ``RedisUnavailable``) and closes the connection it held,
at once and without waiting: its command may have been written, and its reply would then
arrive later and be read as the answer to the next command on that connection. So a
cancelled call takes no connection back to the pool, its command may or may not have run,
and the client stays usable. ``Subscription.next_message`` may be cancelled and called
again: the bytes it had read wait in the parser.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import select
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any, cast
from urllib.parse import quote, unquote, urlsplit

import anyio
from anyio.abc import ByteStream, SocketAttribute

from pd_router.fleet.nodes import whole
from pd_router.shared import resp

DEFAULT_PORT = 6379
MAX_CONNECTIONS = 16
# Seconds between tries of a command that must reach Redis while Redis is away: its
# users keep what they must send and try again, never give up.
RETRY = 0.5

Arg = bytes | str | int | float


class Outage:
    """A channel's listener that lost its subscription says so once, and once when it has
    it again: it tries every ``RETRY`` seconds while Redis is away, and a line a try was
    two lines a second per listener for as long as Redis stayed down."""

    def __init__(self, log: logging.Logger, channel: str) -> None:
        self.log = log
        self.channel = channel
        self.lost_at: float | None = None

    def lost(self, error: Exception) -> None:
        if self.lost_at is None:
            self.lost_at = anyio.current_time()
            self.log.info("%s: %s; subscribing again", self.channel, error)

    def subscribed(self) -> None:
        if self.lost_at is not None:
            down = anyio.current_time() - self.lost_at
            self.log.info("%s: subscribed again, %.1f s after it was lost", self.channel, down)
            self.lost_at = None


_READABLE = select.POLLIN
# Elsewhere than on Linux, a close through TLS is seen when the next call reads it.
_CLOSED = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)

_IO_ERRORS = (OSError, anyio.BrokenResourceError, anyio.EndOfStream, resp.ProtocolError)


class RedisUnavailable(Exception):
    """No answer from Redis: could not connect, the connection was lost, or timed out."""


class RedisError(Exception):
    """Redis answered with an error (a failed Lua script, a wrong type, a refused AUTH)."""

    @property
    def code(self) -> str:
        """The error's first word: ``"NOSCRIPT"``, ``"WRONGTYPE"``, ``"ERR"``..."""
        return str(self).split(" ", 1)[0]

    @property
    def what(self) -> str:
        """The error less where a script met it (Redis 7 ends a script's error with ``script:
        SHA, on @user_script:LINE.``): one error whichever script met it."""
        return _SCRIPT_PLACE.sub("", str(self))


_SCRIPT_PLACE = re.compile(r"\s*script: [0-9a-f]+, on @user_script:\d+\.?$")


@dataclass(frozen=True)
class Settings:
    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def safe_url(self) -> str:
        """The URL with the password as ``***``: for logs and messages."""
        scheme = "rediss" if self.tls else "redis"
        user = ""
        if self.password is not None:
            user = f"{quote(self.username or '', safe='')}:***@"
        return f"{scheme}://{user}{self.address}/{self.db}"


def parse_url(url: str) -> Settings:
    """``redis://[[user]:password@]host[:port][/db]``, or ``rediss://`` for TLS.

    Anything else is a ``ValueError`` that says what is wrong and never shows the password.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss"):
        shown = f"{scheme}://" if scheme and "://" in url else "no scheme"
        raise ValueError(
            f"a Redis URL starts with redis:// or rediss:// ({shown} given): "
            "redis://[user:password@]host[:port][/db]"
        )
    if parts.query or parts.fragment:
        # Not shown: some clients take the password from a query parameter.
        raise ValueError("a Redis URL takes no ?query or #fragment")
    if "@" in parts.path:
        # A / in the password ended the host part there: the host part and the path hold
        # pieces of the password, and neither is shown.
        raise ValueError("a / in a Redis URL's password must be written %2F")
    host_port = parts.netloc.rpartition("@")[2]
    if not parts.hostname:
        raise ValueError(f"a Redis URL needs a host ({host_port!r} given)")
    try:
        port = DEFAULT_PORT if parts.port is None else parts.port
    except ValueError:
        port = 0
    if not port:
        raise ValueError(f"a Redis port is a number from 1 to 65535 ({host_port!r})")
    path = parts.path.removeprefix("/")
    db = whole(path) if path else 0
    if db is None:
        raise ValueError(f"a Redis URL's path is a database number (/0, /1...), not /{path}")
    password = unquote(parts.password) if parts.password else None
    username = unquote(parts.username) if parts.username else None
    if username is not None and password is None:
        raise ValueError("a username in a Redis URL needs a password: user:password@host")
    return Settings(
        host=parts.hostname,
        port=port,
        db=db,
        username=username,
        password=password,
        tls=scheme == "rediss",
    )


class _NoReply(Exception):
    """A ``_LoopConnection`` call's time ran out."""


class _Replies:
    """What both pooled connections share: a request is a send, then the parser's next
    whole reply, read as ``_more`` brings bytes."""

    __slots__ = ()
    parser: resp.Parser

    async def send(self, data: bytes) -> None:
        raise NotImplementedError

    async def _more(self) -> None:
        raise NotImplementedError

    async def request(self, command: bytes) -> resp.Reply:
        await self.send(command)
        return await self.reply()

    async def reply(self) -> resp.Reply:
        parser = self.parser
        while True:
            reply = parser.next_reply()
            if reply is not resp.NEED_DATA:
                return reply
            await self._more()


class _Connection(_Replies):
    __slots__ = ("stream", "parser", "_poll", "_tls")

    def __init__(self, stream: ByteStream, tls: bool) -> None:
        self.stream = stream
        self.parser = resp.Parser()
        # B610 is Django's QuerySet.extra(); this is anyio's typed attribute lookup.
        self._poll = _poll(stream.extra(SocketAttribute.raw_socket))  # nosec B610
        self._tls = tls

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def _more(self) -> None:
        self.parser.feed(await self.stream.receive())

    def stale(self) -> bool:
        """The server closed this idle connection, or sent it bytes nobody asked for."""
        return _gone(self._poll, self._tls)

    async def close(self) -> None:
        # Shielded, and forceful (no TLS goodbye): this runs while a call is being
        # cancelled, and must neither wait nor be interrupted.
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self.stream)


class _LoopConnection(_Replies, asyncio.Protocol):
    """A pooled connection on asyncio, as ``_Connection`` is on anyio's streams: the same
    methods, the same errors (``_IO_ERRORS``)."""

    def __init__(self, tls: bool) -> None:
        self.parser = resp.Parser()
        self._tls = tls
        self._poll: select.poll | None = None
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._error: OSError | None = None  # why the connection was lost, if the OS said
        self._expired = False  # the call's time ran out (``request_within``)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._poll = _poll(transport.get_extra_info("socket"))

    def data_received(self, data: bytes) -> None:
        # Bytes that come while nobody waits are kept: ``stale`` sees them.
        self.parser.feed(data)
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself, and connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if isinstance(exc, OSError):
            self._error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def send(self, data: bytes) -> None:
        if self._closed or self._transport is None:
            raise self._lost()
        self._transport.write(data)

    async def _more(self) -> None:
        if self._closed:
            raise self._lost()
        if self._expired:  # checked here: the timer may have fired while nobody waited
            raise _NoReply
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def request_within(self, command: bytes, seconds: float) -> resp.Reply:
        """``request``, given up after ``seconds`` (``_NoReply``): the connection is then
        out of step, for its caller to close."""
        # A timer of an earlier call may have run out just as its reply came in: that call
        # had its reply, and this one's time is its own.
        self._expired = False
        timer = asyncio.get_running_loop().call_later(seconds, self._expire)
        try:
            return await self.request(command)
        finally:
            timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        self._wake()

    def _lost(self) -> OSError | anyio.EndOfStream:
        return self._error or anyio.EndOfStream()

    def stale(self) -> bool:
        """The server closed this idle connection, or sent it bytes nobody asked for: seen
        by the loop already, or still waiting in the socket (the loop did not run since)."""
        if self._closed or self.parser.pending:
            return True
        # Closing, its connection_lost not run yet (uvloop with TLS closes the socket first:
        # a poll of it then says nothing).
        if self._transport is None or self._transport.is_closing():
            return True
        return self._poll is not None and _gone(self._poll, self._tls)

    async def close(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.abort()  # no waiting, no TLS goodbye: as ``_Connection.close``


class Redis:
    """A small pool of connections to one Redis server, opened as calls need them."""

    def __init__(
        self,
        settings: Settings,
        *,
        timeout: float,
        max_connections: int = MAX_CONNECTIONS,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.settings = settings
        self.timeout = timeout
        if settings.tls and ssl_context is None:
            # Made once: anyio would load the CA store again for every connection.
            ssl_context = ssl.create_default_context()
        self._ssl_context = ssl_context if settings.tls else None
        self._idle: list[_Connection | _LoopConnection] = []  # most recently used last
        self._slots = anyio.Semaphore(max_connections, fast_acquire=True)
        self._closed = False
        self._hello: list[tuple[str, bytes]] = []
        if settings.password is not None:
            auth = [settings.username] if settings.username is not None else []
            self._hello.append(("AUTH", resp.encode("AUTH", *auth, settings.password)))
        if settings.db:
            self._hello.append(("SELECT", resp.encode("SELECT", settings.db)))

    async def __aenter__(self) -> Redis:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def call(self, *args: Arg) -> Any:
        """Send one command (``call("GET", key)``) and return its reply (``shared/resp.py``'s
        types); an error reply raises ``RedisError``, an I/O failure ``RedisUnavailable``."""
        command = resp.encode(*args)
        conn = self._idle_protocol()
        if conn is not None:
            reply = await self._use(conn, command, self.timeout)
        else:
            with anyio.move_on_after(self.timeout) as scope:
                reply = await self._call(command)
            if scope.cancelled_caught:
                raise self._no_reply()
        if isinstance(reply, resp.ReplyError):
            raise RedisError(reply.message)
        return reply

    @asynccontextmanager
    async def subscribe(self, *channels: str | bytes) -> AsyncIterator[Subscription]:
        """A connection of its own, subscribed to ``channels`` until the block ends."""
        if not channels:
            raise ValueError("subscribe to at least one channel")
        with anyio.move_on_after(self.timeout) as scope:
            conn = await self._connect(pooled=False)
            try:
                await conn.send(resp.encode("SUBSCRIBE", *channels))
                for _ in channels:
                    confirmation = await conn.reply()
                    if isinstance(confirmation, resp.ReplyError):
                        raise RedisError(confirmation.message)
            except BaseException as exc:
                await conn.close()
                if isinstance(exc, _IO_ERRORS):
                    raise self._unavailable("subscribe failed", exc) from None
                raise
        if scope.cancelled_caught:
            raise self._unavailable(f"no answer to SUBSCRIBE within {self.timeout:g} s")
        try:
            yield Subscription(self.settings.address, conn)
        finally:
            await conn.close()

    async def aclose(self) -> None:
        """Close the idle connections; calls in progress close theirs when they end."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()

    async def _call(self, command: bytes) -> resp.Reply:
        try:
            self._slots.acquire_nowait()  # no checkpoint: the send and receive are ones
        except anyio.WouldBlock:
            await self._slots.acquire()
        try:
            if self._closed:
                raise self._unavailable("the client is closed")
            while self._idle:
                conn = self._idle.pop()
                if not conn.stale():
                    break
                await conn.close()
            else:
                conn = await self._connect()
        except BaseException:
            self._slots.release()
            raise
        return await self._use(conn, command)

    def _idle_protocol(self) -> _LoopConnection | None:
        """The idle connection used last, its slot taken, if it is an asyncio one and
        usable: the call on it is timed by the loop (``request_within``), not by a cancel
        scope. Else None, and the call takes the general way (``_call``)."""
        if not self._idle or self._closed:
            return None
        conn = self._idle[-1]
        if not isinstance(conn, _LoopConnection) or conn.stale():
            return None
        try:
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            return None
        self._idle.pop()
        return conn

    async def _use(
        self, conn: _Connection | _LoopConnection, command: bytes, within: float | None = None
    ) -> resp.Reply:
        """``command``'s reply on ``conn``, whose slot the caller took (released here). The
        connection goes back to the pool, or is closed if anything went wrong. ``within``:
        seconds it is given (an asyncio connection: ``_idle_protocol``); else the caller's
        cancel scope bounds it."""
        try:
            try:
                if within is not None and isinstance(conn, _LoopConnection):
                    reply = await conn.request_within(command, within)
                else:
                    reply = await conn.request(command)
            except BaseException as exc:
                await conn.close()
                if isinstance(exc, _NoReply):
                    raise self._no_reply() from None
                if isinstance(exc, _IO_ERRORS):
                    raise self._unavailable("connection lost", exc) from None
                raise
            if conn.parser.pending or self._closed:
                await conn.close()  # bytes beyond the reply: the stream is out of step
            else:
                self._idle.append(conn)
            return reply
        finally:
            self._slots.release()

    async def _connect(self, pooled: bool = True) -> _Connection | _LoopConnection:
        settings = self.settings
        try:
            loop = asyncio.get_running_loop() if pooled else None
        except RuntimeError:  # not asyncio: trio
            loop = None
        conn: _Connection | _LoopConnection
        try:
            if loop is not None:
                tls = self._ssl_context
                _, conn = await loop.create_connection(
                    partial(_LoopConnection, settings.tls),
                    settings.host,
                    settings.port,
                    ssl=tls,
                    server_hostname=settings.host if tls is not None else None,
                )
            else:
                conn = _Connection(await self._open_stream(), settings.tls)
        except _IO_ERRORS as exc:
            raise self._unavailable("cannot connect", exc) from None
        if not self._hello:
            return conn
        try:
            await conn.send(b"".join(command for _, command in self._hello))
            for name, _ in self._hello:
                reply = await conn.reply()
                if isinstance(reply, resp.ReplyError):
                    # The server's message first, so that ``code`` is the server's too.
                    where = f"{name} on connecting to redis {settings.address}"
                    raise RedisError(f"{reply.message} ({where})")
        except BaseException as exc:
            await conn.close()
            if isinstance(exc, _IO_ERRORS):
                raise self._unavailable("connection lost while opening", exc) from None
            raise
        return conn

    async def _open_stream(self) -> ByteStream:
        settings = self.settings
        if self._ssl_context is None:
            return await anyio.connect_tcp(settings.host, settings.port)
        return await anyio.connect_tcp(
            settings.host,
            settings.port,
            ssl_context=self._ssl_context,
            # Redis does not wait for TLS close_notify, nor need we.
            tls_standard_compatible=False,
        )

    def _unavailable(self, what: str, exc: BaseException | None = None) -> RedisUnavailable:
        return _unavailable(self.settings.address, what, exc)

    def _no_reply(self) -> RedisUnavailable:
        return self._unavailable(f"no reply within {self.timeout:g} s")


class Subscription:
    """Messages published to the channels subscribed to, in order."""

    def __init__(self, address: str, conn: _Connection | _LoopConnection) -> None:
        self._address = address
        self._conn = conn

    async def next_message(self) -> tuple[bytes, bytes]:
        """The next ``(channel, data)``, however long it takes (bound the wait yourself);
        ``RedisUnavailable`` once the connection is lost: subscribe again."""
        try:
            reply = await self._conn.reply()
        except _IO_ERRORS as exc:
            raise _unavailable(self._address, "subscription lost", exc) from None
        match reply:
            case [b"message", bytes() as channel, bytes() as data]:
                return channel, data
            case resp.ReplyError(message=message):
                raise RedisError(message)
        raise _unavailable(self._address, f"not a pub/sub message: {reply!r:.80}")


Fits = Callable[[Any], bool]


def listed(*lengths: int) -> Fits:
    """A reply that is a list of one of ``lengths`` elements."""
    return lambda reply: isinstance(reply, list) and len(reply) in lengths


def flag(reply: Any) -> bool:
    """A reply that is the integer 0 or 1 (Lua's ``return 0``, ``return 1``)."""
    return type(reply) is int and reply in (0, 1)


class Script:
    """A Lua script run by its SHA1 (``EVALSHA``), sent whole only when Redis lacks it.
    ``fits``: whether a reply is one the script gives (``listed``, ``flag``; none given:
    any reply). A script that answers several requests at once is run with ``asked``,
    their number: its reply's element ``each`` (None: the reply itself) must be a list of
    as many answers."""

    __slots__ = ("source", "sha", "fits", "each")

    def __init__(self, source: str, fits: Fits | None = None, each: int | None = None) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        self.fits = fits
        self.each = each

    async def run(
        self, redis: Redis, keys: Sequence[Arg], args: Sequence[Arg], asked: int | None = None
    ) -> Any:
        try:
            reply = await redis.call("EVALSHA", self.sha, len(keys), *keys, *args)
        except RedisError as error:
            # Redis's script cache is empty after a restart, a failover or SCRIPT FLUSH.
            # NOSCRIPT means nothing ran, so sending the script whole is safe.
            if error.code != "NOSCRIPT":
                raise
            reply = await redis.call("EVAL", self.source, len(keys), *keys, *args)
        if not self._fits(reply, asked):
            # Not this script's reply (a proxy's, or a server's that is not Redis): as
            # good as none, and what ran is not known, as after a lost reply. A request
            # it left unanswered would wait for its answer forever.
            # Its content is not repeated: a client reads this, and never a store's text.
            address = redis.settings.address
            raise RedisUnavailable(f"redis {address}: a reply that is not the script's")
        return reply

    def _fits(self, reply: Any, asked: int | None) -> bool:
        if self.fits is not None and not self.fits(reply):
            return False
        if asked is None:
            return True
        answers = reply if self.each is None else reply[self.each]
        return isinstance(answers, list) and len(answers) == asked


def _poll(sock: Any) -> select.poll:
    """A poll of ``sock`` (its fd), for ``_gone``."""
    poll = select.poll()
    poll.register(sock, _READABLE | _CLOSED)
    return poll


def _gone(poll: select.poll, tls: bool) -> bool:
    """Bytes or a close wait in the socket. Neither backend reads a socket while nobody
    receives, nor while the loop does not run, so a close waits there to be seen. Through
    TLS, bytes alone may be the server's session tickets: only the close itself
    (POLLRDHUP, Linux) says the connection is gone."""
    events = poll.poll(0)
    return bool(events) and (not tls or bool(events[0][1] & _CLOSED))


def _unavailable(address: str, what: str, exc: BaseException | None = None) -> RedisUnavailable:
    detail = f": {_describe(exc)}" if exc is not None else ""
    return RedisUnavailable(f"redis {address}: {what}{detail}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, anyio.EndOfStream):
        return "the server closed the connection"
    # anyio wraps the OS's reason: ConnectionFailed and BrokenResourceError carry it as
    # their cause (a group of them when several addresses were tried).
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        cause = cause.exceptions[0]
    if cause is not None:
        exc = cause
    return str(exc) or type(exc).__name__

"""Redis's wire protocol (RESP2), with no I/O: commands to bytes, bytes to replies.

``encode`` turns one command into the bytes to write. A ``Parser`` is fed the bytes that
arrive, in pieces of any size, and hands out each reply once all of it is in:

=============  ====================================================================
RESP2          Python
=============  ====================================================================
simple string  ``str`` (status words: ``"OK"``, ``"PONG"``)
error          a ``ReplyError``, returned like any reply: the caller decides (an
               error inside an array is one element among others)
integer        ``int``
bulk string    ``bytes``; the null bulk string is ``None``
array          ``list`` of replies, nested to any depth; the null array is ``None``
=============  ====================================================================

Bytes that are not RESP2 raise ``ProtocolError``, and so does a reply larger than
``max_reply`` bytes (512 MiB by default, Redis's own bound on one string): a peer that
sends without end must not grow our memory without bound. After a ``ProtocolError`` the
byte stream is out of step, so the parser, and the connection it reads, are done.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Final, Literal, TypeAlias

MAX_REPLY_BYTES = 512 << 20
# A type line (a simple string, an error, an integer, a length) is short: one that has
# not ended after this many bytes is not RESP.
MAX_LINE_BYTES = 64 << 10

_CRLF = b"\r\n"
_SIMPLE, _ERROR, _INTEGER, _BULK, _ARRAY = b"+-:$*"


class ProtocolError(ValueError):
    """The peer's bytes are not RESP2, or a reply is larger than the parser accepts."""


@dataclass(frozen=True, slots=True)
class ReplyError:
    """An error reply. ``message`` is the server's, its first word the error's kind."""

    message: str

    @property
    def code(self) -> str:
        """``"NOSCRIPT"``, ``"WRONGPASS"``, ``"ERR"``...: the word Redis starts with."""
        return self.message.split(" ", 1)[0]


Reply: TypeAlias = str | bytes | int | ReplyError | list["Reply"] | None


class _NeedData(Enum):
    NEED_DATA = "NEED_DATA"


# What ``Parser.next_reply`` returns while the next reply is still incomplete (``None``
# cannot say it: it is a reply).
NEED_DATA: Final = _NeedData.NEED_DATA


def encode(*args: bytes | str | int | float) -> bytes:
    """One command (``encode("SET", "k", 1)``), as the array of bulk strings Redis reads.

    ``str`` goes as UTF-8, numbers as their decimal text. ``bool`` is refused: Redis has
    no booleans and ``True`` would silently go as ``1``.
    """
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int) and not isinstance(arg, bool):
            data = b"%d" % arg
        elif isinstance(arg, float):
            data = repr(arg).encode()
        else:
            raise TypeError(f"a Redis argument is bytes, str, int or float, not {type(arg)}")
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


class Parser:
    """Bytes in (``feed``), complete replies out (``next_reply``), in order."""

    def __init__(self, max_reply: int = MAX_REPLY_BYTES) -> None:
        self.max_reply = max_reply
        self._buf = bytearray()
        self._pos = 0  # the next byte to parse
        # Where the reply being parsed began in ``_buf``, and how many of its bytes were
        # already dropped from the front of ``_buf``: together, its size so far.
        self._begin = 0
        self._dropped = 0
        self._bulk = -1  # the length of the bulk string whose payload is awaited
        # The arrays being filled, outermost first, each with the count it announced.
        self._arrays: list[tuple[list[Reply], int]] = []

    @property
    def pending(self) -> bool:
        """Bytes arrived that are not part of a reply handed out yet."""
        return self._pos < len(self._buf) or bool(self._arrays) or self._bulk >= 0

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_reply(self) -> Reply | Literal[_NeedData.NEED_DATA]:
        """The next complete reply, or ``NEED_DATA`` until all of it has been fed."""
        buf = self._buf
        while True:
            value: Reply
            if self._bulk >= 0:
                end = self._pos + self._bulk
                if len(buf) < end + 2:
                    return self._need_data()
                if buf[end : end + 2] != _CRLF:
                    raise ProtocolError("a bulk string is longer than its announced length")
                value = bytes(buf[self._pos : end])
                self._pos = end + 2
                self._bulk = -1
            else:
                eol = buf.find(_CRLF, self._pos)
                if eol < 0:
                    if len(buf) - self._pos > MAX_LINE_BYTES:
                        raise ProtocolError(f"a line longer than {MAX_LINE_BYTES} bytes")
                    return self._need_data()
                start = self._pos
                kind = buf[start]  # on an empty line, the CR: not a type
                line = buf[start + 1 : eol]
                self._pos = eol + 2
                if kind == _BULK:
                    size = _length(line)
                    if size >= 0:
                        if self._size() + size + 2 > self.max_reply:
                            raise ProtocolError(f"a reply larger than {self.max_reply} bytes")
                        self._bulk = size
                        continue
                    value = None
                elif kind == _ARRAY:
                    count = _length(line)
                    if count > 0:
                        self._arrays.append(([], count))
                        continue
                    value = [] if count == 0 else None
                elif kind == _SIMPLE:
                    value = line.decode(errors="replace")
                elif kind == _INTEGER:
                    value = _integer(line)
                elif kind == _ERROR:
                    value = ReplyError(line.decode(errors="replace"))
                else:
                    raise ProtocolError(f"not a RESP2 reply: {bytes(buf[start:eol][:40])!r}")
            # A complete value: it completes the arrays it fills, innermost first.
            arrays = self._arrays
            while arrays:
                items, count = arrays[-1]
                items.append(value)
                if len(items) < count:
                    break
                arrays.pop()
                value = items
            else:
                self._reply_done()
                return value

    def _size(self) -> int:
        return self._dropped + self._pos - self._begin

    def _need_data(self) -> Literal[_NeedData.NEED_DATA]:
        if self._dropped + len(self._buf) - self._begin > self.max_reply:
            raise ProtocolError(f"a reply larger than {self.max_reply} bytes")
        # Drop what is parsed, so that a large reply arriving in pieces is held once.
        if self._pos:
            self._dropped += self._pos - self._begin
            del self._buf[: self._pos]
            self._pos = self._begin = 0
        return NEED_DATA

    def _reply_done(self) -> None:
        self._dropped = 0
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._begin = self._pos


def _length(line: bytearray) -> int:
    size = _integer(line)
    if size < -1:
        raise ProtocolError(f"a negative length: {size}")
    return size


def _integer(line: bytearray) -> int:
    # int() also takes spaces, underscores and a plus sign: RESP integers have none.
    if not line or not (line.isdigit() or (line[0] == 45 and line[1:].isdigit())):
        raise ProtocolError(f"not an integer: {bytes(line[:40])!r}")
    return int(line)

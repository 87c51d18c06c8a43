"""uvicorn's HTTP/1.1 protocol (httptools) with a limit on a request's head.

httptools takes request heads of any size, and parsing one under uvicorn is quadratic in
its size (measured: 16 MiB 0.5 s, 64 MiB 5.8 s, 200 MiB 71 s of a stalled event loop,
every other client with it). Here a head (request line and headers) larger than ``max_head``
bytes gets 431 and the connection is closed, before the parser sees the excess.

Bytes are counted from a message's first byte to the end of its headers; data that holds
the end of one head and body bytes after it is split there, so a body is never counted.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import HeadTooLarge

# Far above what any OpenAI client sends (a few hundred bytes), far below what hurts.
MAX_HEAD_BYTES = 64 << 10


class HeadLimitedProtocol(HttpToolsProtocol):
    max_head = MAX_HEAD_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Head bytes of the current message so far; None once its headers are complete.
        self._head: int | None = 0

    def on_headers_complete(self) -> None:
        self._head = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head = 0  # what comes next on this connection is another head
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        while data:
            if self._head is None:
                super().data_received(data)
                return
            room = self.max_head - self._head
            if room <= 0:
                self._refuse()
                return
            part, data = data[:room], data[room:]
            self._head += len(part)
            super().data_received(part)
            if self.transport.is_closing():
                return

    def _refuse(self) -> None:
        error = HeadTooLarge(f"request line and headers are larger than {self.max_head} bytes")
        body = error.json()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


def limited(max_head: int) -> type[HeadLimitedProtocol]:
    """The protocol class for uvicorn's ``http=``, with its own limit."""
    return type("HeadLimitedProtocol", (HeadLimitedProtocol,), {"max_head": max_head})

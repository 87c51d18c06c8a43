"""Server-sent events passed through from the decode engine, with no I/O.

Bytes are forwarded as received, cut only at event boundaries so that a client never sees
half an event from us and we can end the stream cleanly if the engine dies. Only the one
event that carries prompt usage is parsed and rewritten; every other byte goes through
untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
_BOUNDARY = b"\n\n"
_CRLF_BOUNDARY = b"\r\n\r\n"
# Each is the whole last event: inside an event's JSON a line break is always escaped.
# A field's value may start with a space or not (SSE drops one): vLLM and SGLang write
# ``data: [DONE]``, and ``data:[DONE]`` is the same event.
_DONE_MARK = b"[DONE]"
_DONE_EVENTS = (DONE, b"data: [DONE]\r\n\r\n", b"data:[DONE]\n\n", b"data:[DONE]\r\n\r\n")
_USAGE_MARK = b'"prompt_tokens"'
# vLLM's event for an error raised while it generated: ``data: {"error": {...}}``.
_ERROR_MARKS = (b'data: {"error"', b'data:{"error"')
# An engine that never ends an event must not grow our memory without bound.
MAX_EVENT_BYTES = 1 << 20

UsageFix = Callable[[dict[str, Any]], None]


def patch_usage(payload: bytes, fix: UsageFix) -> bytes:
    """``payload`` (a JSON document) with ``fix`` applied to its usage, if it has one."""
    try:
        document = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload
    return with_usage_fixed(payload, document, fix)


def with_usage_fixed(payload: bytes, document: Any, fix: UsageFix) -> bytes:
    """``payload``, parsed as ``document``: unchanged unless it has a usage to fix."""
    usage = document.get("usage") if isinstance(document, dict) else None
    if not isinstance(usage, dict):
        return payload
    fix(usage)
    try:
        return orjson.dumps(document)
    except orjson.JSONEncodeError:
        # Nested deeper than orjson writes (254 levels; it reads 1,024): a lying engine's
        # answer, or its usage from the prefill engine's. Passed on as it came, its usage
        # not fixed, rather than failing the request the engine answered.
        return payload


class EventRelay:
    """Feeds on upstream bytes, returns what to send downstream now.

    Events end with a blank line, its line breaks LF or CRLF (both are SSE; vLLM writes LF).
    Nothing after ``[DONE]`` goes out: the client stops reading there.
    """

    def __init__(self, fix: UsageFix) -> None:
        self._fix = fix
        self._pending = b""
        self.done = False
        # The first error event the engine sent (its JSON), and whether it came before any
        # other event (then no answer has begun: the client can get a real error status).
        self.error: bytes | None = None
        self.error_first = False
        self._fed = False

    def feed(self, data: bytes) -> bytes:
        buffered = self._pending + data if self._pending else data
        cut = _end_of_last_event(buffered)
        if cut == 0:
            if len(buffered) > MAX_EVENT_BYTES:
                raise ValueError(f"an upstream event exceeded {MAX_EVENT_BYTES} bytes")
            self._pending = buffered
            return b""
        ready, self._pending = buffered[:cut], buffered[cut:]
        if ready.find(_DONE_MARK) >= 0:
            ends = [at + len(done) for done in _DONE_EVENTS if (at := ready.find(done)) >= 0]
            if ends:
                self.done = True
                ready = ready[: min(ends)]
        if ready.find(_USAGE_MARK) >= 0:
            ready = self._patch(ready)
        if self.error is None:
            for mark in _ERROR_MARKS:
                at = ready.find(mark)
                if at >= 0:
                    # An event's JSON is one line: it ends at the first line break.
                    start = at + len(mark) - len(b'{"error"')
                    self.error = ready[start : ready.find(b"\n", at)].rstrip(b"\r")
                    self.error_first = at == 0 and not self._fed
                    break
        self._fed = True
        return ready

    def _patch(self, ready: bytes) -> bytes:
        boundary = _CRLF_BOUNDARY if ready.find(_CRLF_BOUNDARY) >= 0 else _BOUNDARY
        events = ready.split(boundary)
        for index, event in enumerate(events):
            if event.startswith(b"data:") and event.find(_USAGE_MARK) >= 0:
                start = 6 if event.startswith(b"data: ") else 5
                events[index] = event[:start] + patch_usage(event[start:], self._fix)
        return boundary.join(events)


def _end_of_last_event(data: bytes) -> int:
    """Where the last complete event in ``data`` ends; 0 when none has."""
    lf = data.rfind(_BOUNDARY)
    crlf = data.rfind(_CRLF_BOUNDARY)
    return max(
        lf + len(_BOUNDARY) if lf >= 0 else 0, crlf + len(_CRLF_BOUNDARY) if crlf >= 0 else 0
    )

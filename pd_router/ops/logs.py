"""Logging: text or JSON lines, and the one line written per finished request."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

access = logging.getLogger("pd_router.access")


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a request line's fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        document.update(getattr(record, "fields", {}))
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return escaped(orjson.dumps(document).decode())


class TextFormatter(logging.Formatter):
    """One line per message: text a message quotes from outside (an engine's error message)
    can neither start another line nor reorder what a terminal shows. A traceback, added
    after the message, keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escaped(super().formatMessage(record))


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str, fmt: str) -> None:
    global _direct
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    _direct = handler
    root.setLevel(level.upper())
    # Fields no format here uses, each costing a lookup per record (the logging HOWTO's
    # "Optimization" section); the caller's frame walk alone is a third of a request line.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def request_finished(fields: dict[str, Any]) -> None:
    if access.isEnabledFor(logging.INFO):
        # One %-format of a template made once per set of keys: formatting each field on its
        # own was most of the line's cost.
        keys = tuple(fields)
        template = _templates.get(keys)
        if template is None:
            template = _templates[keys] = " ".join(f"{key}=%s" for key in keys)
        text = template % tuple(fields.values())
        if text.count(" ") != len(keys) - 1 or not text.isprintable():
            # Some value has a space or a character that is not printable: each is quoted
            # where it needs to be. Else none would be, and the text stands as it is.
            text = template % tuple(map(_shown, fields.values()))
        if not _written_directly(text, fields):
            access.info("request %s", text, extra={"fields": fields})


# The request line's template per tuple of keys: a handful ever (tracing adds a key).
_templates: dict[tuple[str, ...], str] = {}

# The handler ``configure`` installed. While it is the only one a request line reaches and
# nothing filters it (``workers.tag_logs`` does, a test's log capture adds a handler), the
# line is written to its stream here, as its formatter would write it: logging's record,
# its handler's and its formatter's calls were most of the line's cost.
_direct: logging.StreamHandler[Any] | None = None
# The local time of a second, as the text format starts a line with it.
_second = -1
_asctime = ""


def _written_directly(text: str, fields: dict[str, Any]) -> bool:
    handler = _direct
    root = logging.root
    if handler is None or handler.filters or handler.level > logging.INFO or access.filters:
        return False
    logger: logging.Logger | None = access
    while logger is not None and logger is not root:
        if logger.handlers or not logger.propagate:
            return False
        logger = logger.parent
    if root.handlers != [handler]:
        return False
    created = time.time()
    if isinstance(handler.formatter, JsonFormatter):
        line = _json_line(created, text, fields)
    elif type(handler.formatter) is TextFormatter:
        line = escaped(f"{_local_time(created)} INFO pd_router.access: request {text}")
    else:
        return False
    handler.acquire()
    try:
        handler.stream.write(line + handler.terminator)
        handler.flush()
    except Exception:  # as ``StreamHandler.emit``: the handler says it, the request goes on
        handler.handleError(access.makeRecord(access.name, logging.INFO, "", 0, line, (), None))
    finally:
        handler.release()
    return True


def _local_time(created: float) -> str:
    """``created`` as ``logging.Formatter.formatTime`` writes it by default."""
    global _second, _asctime
    second = int(created)
    if second != _second:
        _asctime = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        _second = second
    return "%s,%03d" % (_asctime, (created - second) * 1000)


def _json_line(created: float, text: str, fields: dict[str, Any]) -> str:
    document: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
        + f".{int((created - int(created)) * 1000):03d}Z",
        "level": "info",
        "logger": access.name,
        "message": f"request {text}",
    }
    document.update(fields)
    return escaped(orjson.dumps(document).decode())


def _shown(value: object) -> object:
    """A client's string (a model name) quoted when it has spaces or characters that are not
    printable, so that it cannot pass for other fields or another line, nor reorder what a
    terminal shows (bidi controls)."""
    if isinstance(value, str) and (not value.isprintable() or " " in value):
        return escaped(orjson.dumps(value).decode())
    return value


def escaped(text: str) -> str:
    """JSON text with every character that is not printable as a ``\\u`` escape: JSON
    escapes only C0 controls, and leaves DEL, C1 controls, bidi overrides (U+202A-U+202E,
    U+2066-U+2069), line separators and zero-width characters raw. Outside strings JSON
    has none of them, so the text means what it did."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(ord(c)) for c in text)


def _escape(point: int) -> str:
    if point < 0x10000:
        return f"\\u{point:04x}"
    point -= 0x10000  # a UTF-16 surrogate pair, as JSON spells what lies beyond the BMP
    return f"\\u{0xD800 + (point >> 10):04x}\\u{0xDC00 + (point & 0x3FF):04x}"

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
        return orjson.dumps(document).decode()


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Fields no format here uses, each costing a lookup per record (the logging HOWTO's
    # "Optimization" section); the caller's frame walk alone is a third of a request line.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def request_finished(fields: dict[str, Any]) -> None:
    if access.isEnabledFor(logging.INFO):
        text = " ".join(f"{key}={_shown(value)}" for key, value in fields.items())
        access.info("request %s", text, extra={"fields": fields})


def _shown(value: object) -> object:
    """A client's string (a model name) quoted when it has spaces or control characters,
    so that it cannot pass for other fields or another line."""
    if isinstance(value, str) and (not value.isprintable() or " " in value):
        return orjson.dumps(value).decode()
    return value

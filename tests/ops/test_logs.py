"""The request line as written: straight to the handler's stream while the router's own
logging set-up is all there is, through ``logging`` otherwise; the same text either way."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from pd_router.ops import logs

FIELDS = {
    "request_id": "r1",
    "key": None,
    "model": "m\u202eevil\nline",
    "outcome": "ok",
    "status": 200,
    "ttft_s": 0.0023,
}
TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    out = io.StringIO()
    yield out
    root.handlers[:], level = saved
    root.setLevel(level)
    logs._direct = None


def lines(fmt: str, out: io.StringIO) -> tuple[str, str]:
    """The line written directly, then the one ``logging`` wrote (a filter on the handler
    sends the line through it)."""
    logs.configure("info", fmt)
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(out)
    logs.request_finished(FIELDS)
    handler.addFilter(lambda record: True)
    logs.request_finished(FIELDS)
    direct, through_logging = out.getvalue().splitlines()
    return direct, through_logging


def test_the_text_line_is_the_formatters_line(stream: io.StringIO) -> None:
    direct, through_logging = lines("text", stream)
    assert TIME.match(direct) and TIME.match(through_logging)
    assert TIME.sub("", direct) == TIME.sub("", through_logging)
    assert TIME.sub("", direct).startswith("INFO pd_router.access: request request_id=r1 ")
    assert "\\u202e" in direct


def test_the_json_line_is_the_formatters_line(stream: io.StringIO) -> None:
    direct, through_logging = lines("json", stream)
    written, expected = json.loads(direct), json.loads(through_logging)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", written.pop("time"))
    expected.pop("time")
    assert written == expected
    assert written["logger"] == "pd_router.access" and written["model"] == FIELDS["model"]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("where", ["root", "pd_router.access"])
def test_a_handler_added_elsewhere_gets_the_line_too(stream: io.StringIO, where: str) -> None:
    logs.configure("info", "text")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    other = Collect()
    logger = logging.getLogger(None if where == "root" else where)
    logger.addHandler(other)
    try:
        logs.request_finished(FIELDS)
    finally:
        logger.removeHandler(other)
    (line,) = stream.getvalue().splitlines()
    assert other.messages == [line.split(" INFO pd_router.access: ", 1)[1]]

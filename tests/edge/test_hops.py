"""Loop marks and the router's own address (``edge/hops.py``). No I/O."""

from __future__ import annotations

import pytest

from pd_router.edge.hops import MAX_HOPS, new_mark, own_address, passed
from pd_router.errors import LoopDetected

A, B, C = (new_mark().encode() for _ in range(3))


def test_marks_accumulate_and_a_router_refuses_its_own() -> None:
    assert passed(None, A) == A
    at_b = passed(passed(None, A), B)
    assert at_b == A + b"," + B
    with pytest.raises(LoopDetected) as loop:
        passed(at_b, A)  # A -> B -> A
    assert loop.value.status == 508 and loop.value.code == "loop_detected"
    assert passed(at_b, C) == b",".join([A, B, C])


def test_the_header_stays_bounded_whatever_comes_in() -> None:
    junk = b", ".join([b"not-a-mark", b"x" * 10_000, b""])
    assert passed(junk, A) == A, "only routers' marks are passed on"
    many = b",".join(new_mark().encode() for _ in range(MAX_HOPS))
    with pytest.raises(LoopDetected, match=f"passed through {MAX_HOPS} routers"):
        passed(many, A)
    assert len(passed(many.rsplit(b",", 1)[0], A)) == MAX_HOPS * 17 - 1


@pytest.mark.parametrize(
    ("url", "host", "own"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1", True),
        ("http://localhost:8000", "127.0.0.1", True),
        ("http://127.0.0.1:8001", "127.0.0.1", False),
        ("http://127.0.0.2:8000", "127.0.0.1", False),  # another socket
        ("http://[::1]:8000", "0.0.0.0", True),  # nosec B104
        ("http://127.0.0.9:8000", "::", True),
        ("http://router-7:8000", "0.0.0.0", True),  # nosec B104: the machine's name
        ("http://10.0.0.1:8000", "0.0.0.0", False),  # nosec B104: can't be known here
        ("http://10.0.0.1:8000", "10.0.0.1", True),
        ("http://127.0.0.1:8000", "10.0.0.1", False),
        ("http://[::1]:8000", "::1", True),
        ("http://127.0.0.1", "127.0.0.1", False),
        ("http://127.0.0.1:8000", "localhost", True),
        ("http://localhost:8000", "localhost", True),
        # Other spellings of the listening address (before, each was taken as another).
        ("http://[::ffff:127.0.0.1]:8000", "127.0.0.1", True),
        ("http://127.1:8000", "127.0.0.1", True),
        ("http://0.0.0.0:8000", "127.0.0.1", True),  # nosec B104: Linux connects to loopback
        ("http://[::]:8000", "::1", True),
        ("http://[::ffff:10.0.0.1]:8000", "10.0.0.1", True),
        ("http://0.0.0.0:8000", "10.0.0.1", False),  # nosec B104
    ],
)
def test_the_routers_own_address(url: str, host: str, own: bool) -> None:
    assert own_address(url, host, 8000, "Router-7") is own

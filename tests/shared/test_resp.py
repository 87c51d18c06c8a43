"""RESP2 encoding and parsing, with no server: bytes in, replies out."""

from __future__ import annotations

import pytest

from pd_router.shared.resp import NEED_DATA, Parser, ProtocolError, Reply, ReplyError, encode


def replies(parser: Parser) -> list[Reply]:
    out = []
    while (reply := parser.next_reply()) is not NEED_DATA:
        out.append(reply)
    return out


def parse(data: bytes, **kwargs: int) -> list[Reply]:
    parser = Parser(**kwargs)
    parser.feed(data)
    return replies(parser)


def test_a_command_is_an_array_of_bulk_strings() -> None:
    assert encode("SET", b"k\r\n", 12, -3, 0.5) == (
        b"*5\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n12\r\n$2\r\n-3\r\n$3\r\n0.5\r\n"
    )
    assert encode("ECHO", "é", b"") == b"*3\r\n$4\r\nECHO\r\n$2\r\n\xc3\xa9\r\n$0\r\n\r\n"


@pytest.mark.parametrize("arg", [True, None, [1], bytearray(b"x")])
def test_arguments_other_than_bytes_str_and_numbers_are_refused(arg: object) -> None:
    with pytest.raises(TypeError, match="bytes, str, int or float"):
        encode("SET", "k", arg)  # type: ignore[arg-type]


def test_each_reply_type() -> None:
    data = (
        b"+OK\r\n"
        b"-WRONGTYPE Operation against a key\r\n"
        b":42\r\n:-7\r\n"
        b"$5\r\nhe\r\no\r\n$0\r\n\r\n$-1\r\n"
        b"*0\r\n*-1\r\n"
        b"*3\r\n:1\r\n*2\r\n$1\r\nx\r\n*-1\r\n-ERR inner\r\n"
    )
    assert parse(data) == [
        "OK",
        ReplyError("WRONGTYPE Operation against a key"),
        42,
        -7,
        b"he\r\no",
        b"",
        None,
        [],
        None,
        [1, [b"x", None], ReplyError("ERR inner")],
    ]


def test_an_error_reply_has_the_servers_message_and_its_code() -> None:
    [error] = parse(b"-NOSCRIPT No matching script. Please use EVAL.\r\n")
    assert isinstance(error, ReplyError)
    assert error.code == "NOSCRIPT"
    assert error.message == "NOSCRIPT No matching script. Please use EVAL."


def test_bytes_fed_one_at_a_time_give_the_same_replies() -> None:
    data = b"*2\r\n$3\r\nabc\r\n*2\r\n:5\r\n+PONG\r\n$-1\r\n-ERR x\r\n"
    whole = parse(data)
    parser = Parser()
    pieces: list[Reply] = []
    for i in range(len(data)):
        parser.feed(data[i : i + 1])
        pieces += replies(parser)
    assert pieces == whole == [[b"abc", [5, "PONG"]], None, ReplyError("ERR x")]
    assert not parser.pending


def test_an_incomplete_reply_is_pending() -> None:
    parser = Parser()
    parser.feed(b"*2\r\n$3\r\nab")
    assert parser.next_reply() is NEED_DATA
    assert parser.pending
    parser.feed(b"c\r\n:1\r\n+extra")
    assert parser.next_reply() == [b"abc", 1]
    assert parser.pending  # "+extra" waits for its CRLF


def test_a_large_bulk_in_small_pieces() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, with CR and LF bytes inside
    data = b"$%d\r\n" % len(payload) + payload + b"\r\n"
    parser = Parser()
    for i in range(0, len(data), 1000):
        parser.feed(data[i : i + 1000])
        got = parser.next_reply()
    assert got == payload


@pytest.mark.parametrize(
    "data, message",
    [
        (b"?what\r\n", "not a RESP2 reply"),
        (b"\r\n", "not a RESP2 reply"),
        (b":12a\r\n", "not an integer"),
        (b": 12\r\n", "not an integer"),
        (b":1_0\r\n", "not an integer"),
        (b":\r\n", "not an integer"),
        (b"$-2\r\n", "negative length"),
        (b"*-5\r\n", "negative length"),
        (b"$2\r\nabc\r\n", "longer than its announced length"),
        (b"+" + b"x" * (64 << 10) + b"x", "a line longer than"),
    ],
)
def test_bytes_that_are_not_resp2_are_a_protocol_error(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse(data)


def test_a_bulk_announced_larger_than_the_limit_is_refused_before_it_arrives() -> None:
    with pytest.raises(ProtocolError, match="a reply larger than 1000 bytes"):
        parse(b"$1000\r\n", max_reply=1000)
    assert parse(b"$10\r\n0123456789\r\n", max_reply=1000) == [b"0123456789"]


def test_a_reply_of_many_small_parts_is_bounded_too() -> None:
    parser = Parser(max_reply=1000)
    parser.feed(b"*1000\r\n")
    with pytest.raises(ProtocolError, match="a reply larger than 1000 bytes"):
        for _ in range(1000):
            parser.feed(b":1\r\n")
            assert parser.next_reply() is NEED_DATA


def test_the_limit_is_per_reply() -> None:
    reply = b"$90\r\n" + b"x" * 90 + b"\r\n"
    assert parse(reply * 50, max_reply=100) == [b"x" * 90] * 50

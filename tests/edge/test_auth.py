"""The key file's format and the check of a request's key (``edge/auth.py``): no I/O."""

from __future__ import annotations

import hashlib

import pytest

from pd_router.edge.auth import KeyFileError, parse
from pd_router.errors import Unauthorized

ALICE = "sk-alice-123"
BOB = "sk-bob-456#not-a-comment"


def test_plain_and_digest_keys_names_limits_and_comments() -> None:
    digest = hashlib.sha256(b"sk-carol").hexdigest().upper()
    keys = parse(
        f"# clients\n\n  alice {ALICE}   # a comment\n"
        f"bob\t{BOB} max_in_flight=3\ncarol sha256:{digest}\n"
    )
    assert sorted(key.name for key in keys.by_digest.values()) == ["alice", "bob", "carol"]
    alice = keys.check([f"Bearer {ALICE}".encode()])
    assert (alice.name, alice.max_in_flight) == ("alice", None)
    assert keys.check([f"bearer  {BOB} ".encode()]).max_in_flight == 3
    assert keys.check([b"Bearer sk-carol"]).name == "carol"
    # Only digests are kept.
    assert all(len(key.digest) == 32 for key in keys.by_digest.values())


@pytest.mark.parametrize(
    "headers",
    [[], [b""], [b"Bearer"], [b"Bearer "], [b"Basic " + ALICE.encode()], [b"Bearer sk-alice-12"],
     [b"Bearer " + hashlib.sha256(ALICE.encode()).hexdigest().encode()], [ALICE.encode()],
     # Two headers, the right key in either: which counts would depend on who reads them.
     [f"Bearer {ALICE}".encode(), b"Bearer wrong"], [b"Bearer wrong", f"Bearer {ALICE}".encode()],
     [f"Bearer {ALICE}".encode()] * 2,
     # Another scheme that merely begins like it.
     [b"Bearerx " + ALICE.encode()], [b"Bearer: " + ALICE.encode()]],
)  # fmt: skip
def test_anything_but_one_listed_bearer_key_is_401(headers: list[bytes]) -> None:
    keys = parse(f"alice {ALICE}\n")
    with pytest.raises(Unauthorized) as refused:
        keys.check(headers)
    error = refused.value
    assert (error.status, error.code, error.type) == (
        401,
        "invalid_api_key",
        "invalid_request_error",
    )
    assert ALICE not in error.message


@pytest.mark.parametrize(
    "text, message",
    [
        ("alice\n", "line 1: expected NAME KEY"),
        (f"\n\nal ice {ALICE}\n", "line 3: unknown or repeated option"),
        (f"al/ice {ALICE}\n", "line 1: the name must be"),
        # A name goes in every log line and metric label: bounded.
        (f"{'a' * 65} {ALICE}\n", "line 1: the name must be"),
        (f"alice {ALICE}\nalice sk-other\n", "line 2: the name 'alice' is given twice"),
        (f"alice {ALICE}\nbob {ALICE}\n", "line 2: key 'bob' is the same key"),
        ("alice sha256:abc\n", "line 1: sha256: must be followed by 64 hex digits"),
        (f"alice {ALICE} max_in_flight=0\n", "line 1: max_in_flight must be"),
        (f"alice {ALICE} max_in_flight=x\n", "line 1: max_in_flight must be"),
        # Digits int() would not take, or would read in another script: refused alike.
        (f"alice {ALICE} max_in_flight=\u00b2\n", "line 1: max_in_flight must be"),
        (f"alice {ALICE} max_in_flight=\u0663\n", "line 1: max_in_flight must be"),
        # Past int()'s 4,300 digits, or past any fleet: the line named, not a traceback.
        (f"alice {ALICE} max_in_flight={'9' * 5000}\n", "line 1: max_in_flight must be"),
        (f"alice {ALICE} max_in_flight=1000000000\n", "line 1: max_in_flight must be"),
        # The name left out: the key would be the name (logged, on /metrics) and the
        # option a key anyone could guess.
        (f"{ALICE} max_in_flight=8\n", "line 1: an option where the key belongs"),
        (f"alice {ALICE} burst=3\n", "line 1: unknown or repeated option"),
        (f"alice {ALICE} max_in_flight=1 max_in_flight=2\n", "line 1: unknown or repeated"),
        ("alice sk-\u00e9t\u00e9\n", "line 1: a key must be printable ASCII"),
    ],
)
def test_a_line_that_cannot_be_used_refuses_the_file_naming_the_line_not_the_key(
    text: str, message: str
) -> None:
    with pytest.raises(KeyFileError) as refused:
        parse(text)
    assert str(refused.value).startswith(message)
    assert ALICE not in str(refused.value)


def test_an_empty_file_refuses_everyone() -> None:
    keys = parse("# nobody yet\n")
    assert len(keys) == 0
    with pytest.raises(Unauthorized):
        keys.check([f"Bearer {ALICE}".encode()])


def test_an_empty_key_is_refused_even_if_the_file_lists_its_digest() -> None:
    """``sha256:`` of nothing: no header can carry an empty key to match it."""
    keys = parse(f"nobody sha256:{hashlib.sha256(b'').hexdigest()}\n")
    for header in (b"Bearer", b"Bearer ", b"Bearer   "):
        with pytest.raises(Unauthorized):
            keys.check([header])

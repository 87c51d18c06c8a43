"""Client keys (``--api-keys-file``): the file's format and the check of one request's key.

No I/O: ``edge/keyfile.py`` reads and watches the file, the app asks ``Keys.check``.

The file holds one key a line, ``NAME KEY [max_in_flight=N]``, fields separated by
whitespace; ``KEY`` may be ``sha256:<hex>``, the SHA-256 of the key in hex, so that the
file need not hold the key itself. ``#`` at the start of a line or after whitespace starts
a comment (a ``#`` inside a key is part of it). A file with a line that cannot be used is
refused whole, with the line's number and never its key.

Only digests are kept: a plain key is hashed as the file is read. A request's key is
hashed and looked up by its digest, so the time the check takes depends on the digest of
what the client sent, never on how much of some real key it matched: that is what a
constant-time comparison is for, at the cost of one hash and one dictionary lookup
whatever the number of keys (a loop of ``hmac.compare_digest`` over every key would grow
with them). Learning anything about a digest from timing does not help find a key that
hashes to it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pd_router.errors import Unauthorized

# Names go in log lines and metric labels: the characters of a request id, bounded.
_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,64}")
_HEX_DIGEST = re.compile(r"[0-9A-Fa-f]{64}")
_LIMIT = "max_in_flight="
# More requests than any fleet holds at once; nine digits at most, whatever is written.
MAX_IN_FLIGHT = 999_999_999
_FORMAT = "expected NAME KEY [max_in_flight=N]"


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the line, never a key."""


@dataclass(frozen=True)
class Key:
    """A client key as the router knows it: its name and digest, and its limit if any."""

    name: str
    digest: bytes
    max_in_flight: int | None = None


class Keys:
    """The keys of one version of the file."""

    __slots__ = ("by_digest",)

    def __init__(self, keys: list[Key]) -> None:
        self.by_digest = {key.digest: key for key in keys}

    def __len__(self) -> int:
        return len(self.by_digest)

    def check(self, authorization: Sequence[bytes]) -> Key:
        """The key a request's ``Authorization`` header values carry, or ``Unauthorized``."""
        key = self.by_digest.get(hashlib.sha256(bearer(authorization)).digest())
        if key is None:
            raise Unauthorized("invalid API key")
        return key


def bearer(authorization: Sequence[bytes]) -> bytes:
    """The token of a request's one ``Authorization: Bearer <token>`` header (the scheme in
    any case, spaces around the token as clients vary them), given its values; else
    ``Unauthorized``. Two are refused: which one counts would depend on who reads them (a
    gateway in front may add its own)."""
    if not authorization:
        raise Unauthorized(
            "no API key: send it as 'Authorization: Bearer <key>' (the openai SDK's api_key does)"
        )
    if len(authorization) > 1:
        raise Unauthorized("more than one Authorization header")
    scheme, _, token = authorization[0].strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        raise Unauthorized("the Authorization header must be 'Bearer <key>'")
    return token


def parse(text: str) -> Keys:
    """The keys of a file's text; ``KeyFileError`` for the first line that cannot be used."""
    keys: list[Key] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        fields = _fields(line)
        if not fields:
            continue
        where = f"line {number}"
        if len(fields) < 2:
            raise KeyFileError(f"{where}: {_FORMAT}")
        name, secret, *options = fields
        if secret.startswith(_LIMIT):
            # "KEY max_in_flight=N": the name left out would make the key the name (in
            # every log line and on /metrics) and the option a key anyone could guess.
            raise KeyFileError(f"{where}: an option where the key belongs ({_FORMAT})")
        if not _NAME.fullmatch(name):
            raise KeyFileError(
                f"{where}: the name must be 1 to 64 letters, digits or ._:@- (it goes in "
                "logs and metric labels)"
            )
        if name in names:
            raise KeyFileError(f"{where}: the name {name!r} is given twice")
        digest = _digest(secret, where)
        if digest in digests:
            raise KeyFileError(f"{where}: key {name!r} is the same key as an earlier line's")
        limit = None
        for option in options:
            if not option.startswith(_LIMIT) or limit is not None:
                raise KeyFileError(f"{where}: unknown or repeated option ({_FORMAT})")
            value = option[len(_LIMIT) :]
            # ASCII digits only: str.isdigit() takes superscripts (int() does not) and
            # other scripts' digits (int() reads them); a few, so that int() never refuses
            # them (over 4,300 digits it raises).
            if not (value.isascii() and value.isdigit() and len(value) <= 9) or int(value) < 1:
                raise KeyFileError(
                    f"{where}: max_in_flight must be a whole number from 1 to {MAX_IN_FLIGHT:,}"
                )
            limit = int(value)
        names.add(name)
        digests.add(digest)
        keys.append(Key(name, digest, limit))
    return Keys(keys)


def _fields(line: str) -> list[str]:
    fields = []
    for field in line.split():
        if field.startswith("#"):
            break
        fields.append(field)
    return fields


def _digest(secret: str, where: str) -> bytes:
    if secret.startswith("sha256:"):
        hexdigest = secret[len("sha256:") :]
        if not _HEX_DIGEST.fullmatch(hexdigest):
            raise KeyFileError(f"{where}: sha256: must be followed by 64 hex digits")
        return bytes.fromhex(hexdigest)
    if not secret.isascii() or not secret.isprintable():
        raise KeyFileError(f"{where}: a key must be printable ASCII")
    return hashlib.sha256(secret.encode()).digest()

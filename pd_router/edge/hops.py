"""Loops: a request never passes through the same router twice. No I/O.

Every router has a *mark*, made at start-up and shared by its ``--workers``. What it sends
to an engine (requests, probes, model reads) carries the marks of the routers the request
went through, its own last, in ``x-pd-router-via``: a router that is its own engine, or
two routers that name each other, see their own mark come back, and refuse the request
at once (508 ``loop_detected``, before any slot is taken). The marks accumulate, so that
a longer cycle (A -> B -> C -> A) is caught too, and are bounded: a request that already
passed ``MAX_HOPS`` routers is refused the same way, so the header stays short whatever a
client or a cycle puts in it.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import socket
from urllib.parse import urlsplit

from pd_router.errors import LoopDetected

HEADER = b"x-pd-router-via"
# Routers a request may have passed through before this one. P/D routers are not stacked
# in practice: a few tiers at most.
MAX_HOPS = 8
# A mark as a router makes it (``new_mark``); anything else in the header is not a
# router's mark and is not passed on.
_MARK = re.compile(rb"[0-9a-f]{16}")


def new_mark() -> str:
    return secrets.token_hex(8)


def passed(via: bytes | None, mark: bytes) -> bytes:
    """What this router sends on for a request that came with ``via`` (its
    ``x-pd-router-via``, None without one): the marks so far and its own. Raises
    ``LoopDetected`` when ``mark`` is among them, or too many routers are."""
    if not via:
        return mark
    marks = [m for m in (part.strip() for part in via.split(b",")) if _MARK.fullmatch(m)]
    if mark in marks:
        raise LoopDetected(
            f"loop detected: this request already passed through this router "
            f"({mark.decode()}); an engine URL of its fleet leads back to it (a router is "
            "its own node, or routers name each other)"
        )
    if len(marks) >= MAX_HOPS:
        raise LoopDetected(f"loop detected: this request already passed through {MAX_HOPS} routers")
    return b",".join([*marks, mark])


# Every address a wildcard listening socket answers on that the router can name without
# asking anyone (its interfaces' addresses it cannot list without I/O: the 508 catches those).
_WILDCARDS = ("", "0.0.0.0", "::")  # nosec B104: names compared, nothing bound


def own_address(url: str, host: str, port: int, hostname: str = "") -> bool:
    """Whether the engine URL ``url`` (canonical, ``fleet/nodes.py``) is this router itself,
    listening on ``host``:``port`` on a machine named ``hostname``: the same port, and the
    listening address itself, ``localhost`` for a loopback one, or for a wildcard one
    (``0.0.0.0``, ``::``) any loopback address, ``localhost``, a wildcard or the machine's
    name."""
    parts = urlsplit(url)
    try:
        if parts.port != port and not (parts.port is None and port == _DEFAULT[parts.scheme]):
            return False
    except (ValueError, KeyError):
        return False
    target = (parts.hostname or "").lower()
    listening = host.strip("[]").lower()
    if listening == "localhost":
        listening = "127.0.0.1"  # what the socket was bound to (``serve.listen``: IPv4)
    at, on = _ip(target), _ip(listening)
    if target == listening or (at is not None and at == on):
        return True
    if listening in _WILDCARDS:
        return (
            (at is not None and at.is_loopback)
            or target in ("localhost", *_WILDCARDS)
            or (bool(hostname) and target == hostname.lower())
        )
    return on is not None and on.is_loopback and target == "localhost"


_DEFAULT = {"http": 80, "https": 443}


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as the address a connection to it reaches (None for a name): an IPv4-mapped
    IPv6 address as its IPv4 one, a short IPv4 form (``127.1``) as the socket layer reads
    it, and the unspecified address as this machine's loopback (Linux connects there)."""
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    return ip

"""SGLang's P/D dialect (bootstrap): what the prefill and decode engines are sent. No I/O.

Both engines get one request at once: the client's body plus the prefill engine's host,
its bootstrap port and a *room*, a random number naming this request's KV transfer. The
decode engine asks the prefill engine's bootstrap server for the room, and the KV goes
from one to the other; the prefill engine answers once it has gone. As SGLang's own
routers do (``sglang/srt/disaggregation/mini_lb.py``, sgl-router's ``pd_router.rs``):
the same fields, a list of each for a request of several sequences.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pd_router.errors import BadRequest
from pd_router.fleet.nodes import BOOTSTRAP_PORT

# SGLang's ``--disaggregation-bootstrap-port`` default.
DEFAULT_PORT = 8998
# Rooms are 63-bit, as SGLang draws them (``random.randint(0, 2**63 - 1)``): a collision
# between two requests in flight anywhere in the fleet is out of the question.
ROOM_BITS = 63
FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# The most sequences one request may ask for: each gets a room of its own, and both
# engines get three lists of that length. Nothing else bounds a chat's ``n``: 10^6 of
# them held the router's event loop ~2 s and sent each engine 26 MB, 10^8 would take its
# memory; a batch of prompts is bounded by the body's size only (``[""]`` x 3 million in
# 10 MB). OpenAI's API takes an ``n`` of at most 128.
MAX_SEQUENCES = 1024


def host_of(url: str) -> str:
    """The host of an engine's (normalised) URL as SGLang's decode engines dial it: an IPv6
    address in brackets (``maybe_wrap_ipv6_address``)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def port(labels: Mapping[str, str], default: int) -> int:
    """A prefill node's bootstrap port: its ``bootstrap_port`` label's (checked as a port
    wherever labels are given), else the router's ``--bootstrap-port``."""
    label = labels.get(BOOTSTRAP_PORT)
    return default if label is None else int(label)


def sequences(body: dict[str, Any], chat: bool) -> int | None:
    """How many sequences the request asks for when it is a batch (a list of prompts, or a
    chat's ``n`` over 1), else None: a batch gets one room per sequence. A validated body;
    over ``MAX_SEQUENCES`` is the client's error."""
    count = None
    if chat:
        n = body.get("n")
        if isinstance(n, int) and n > 1:
            count = n
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            count = len(prompt)
    if count is not None and count > MAX_SEQUENCES:
        param, what = ("n", "'n'") if chat else ("prompt", "a batch of prompts")
        raise BadRequest(
            f"{what} may ask for at most {MAX_SEQUENCES} sequences with SGLang's engines "
            f"(each gets a bootstrap room of its own), got {count}",
            param=param,
        )
    return count


def request(body: dict[str, Any], host: str, port: int, batch: int | None = None) -> dict[str, Any]:
    """The request both engines get: ``body`` with the bootstrap fields (a client's own are
    replaced: no client points an engine at a host of its choosing)."""
    out = {key: value for key, value in body.items() if key not in FIELDS}
    if batch is None:
        out.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room())
    else:
        out.update(
            bootstrap_host=[host] * batch,
            bootstrap_port=[port] * batch,
            bootstrap_room=[room() for _ in range(batch)],
        )
    return out


def room() -> int:
    return secrets.randbits(ROOM_BITS)

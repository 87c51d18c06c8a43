"""Which models each node serves, and whether the fleet serves a request's. No I/O.

A node's models come from its engine's ``/v1/models`` (read by ``engines/watch.py`` as
the node starts and every ``REFRESH`` seconds after); the model objects are kept too, and
the router's own ``GET /v1/models`` answers from them (``listing``), never asking an
engine. Until they are known a node is taken to serve any model, so an engine that does
not list its models still gets requests, and whatever it answers goes back to the client.
A request's ``model`` must be served by some prefill node and some decode node (dead or
draining ones count: they are members of the fleet, and their requests are told 503, not
404); otherwise it is answered 404 ``model_not_found`` naming the models that are served.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from pd_router.errors import ModelNotFound
from pd_router.fleet.nodes import Node

# Seconds between two reads of a node's models once known; a node whose models are not
# known yet is asked again after ``RETRY``.
REFRESH = 30.0
RETRY = 5.0
# Seconds one read may take: it runs in the background, so a slow engine delays nobody.
TIMEOUT = 5.0
# Models kept of one engine's list, and characters of one id: an engine is trusted to say
# what it serves, not to fill the router's memory.
MAX_MODELS = 256
MAX_ID = 512
# Bytes of one model object (as JSON) kept whole; vLLM's are about 500. A larger one is
# kept as its id and the OpenAI fields that are small (``small_card``).
MAX_CARD = 2048
# Served models named in one 404, at most.
NAMED = 20


Card = dict[str, Any]


def parse(answer: object) -> dict[str, Card]:
    """The models of a ``/v1/models`` answer (``{"data": [{"id": ...}, ...]}``): each id's
    object, in the engine's order. An id must be printable (it is logged)."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError("not an OpenAI model list (no 'data' array)")
    cards: dict[str, Card] = {}
    for item in data[:MAX_MODELS]:
        name = item.get("id") if isinstance(item, dict) else None
        if isinstance(name, str) and 0 < len(name) <= MAX_ID and name.isprintable():
            cards.setdefault(name, item if _fits(item) else small_card(item))
    if not cards:
        # Taken at its word, the node would get nothing; not knowing lets its engine answer.
        raise ValueError("lists no model")
    return cards


def _fits(card: Card) -> bool:
    try:
        return len(orjson.dumps(card)) <= MAX_CARD
    except TypeError:  # nested deeper than orjson writes (254 levels; it reads 1024)
        return False


def small_card(card: Card) -> Card:
    """What is kept of a model object over ``MAX_CARD``: its id, and OpenAI's other fields
    when they are what OpenAI says they are (short)."""
    kept: Card = {"id": card["id"], "object": "model"}
    created, owner = card.get("created"), card.get("owned_by")
    if isinstance(created, int) and not isinstance(created, bool):
        kept["created"] = created
    if isinstance(owner, str) and len(owner) <= MAX_ID:
        kept["owned_by"] = owner
    return kept


def listing(prefill: Sequence[Node], decode: Sequence[Node]) -> list[Card] | None:
    """What ``GET /v1/models`` lists for these nodes: each model of the lists read, once (the
    first node's object), that a request may ask for (``check``: a model one role alone
    serves would be listed, then answered 404); None when no node's list has been read."""
    seen: dict[str, Card] = {}
    known = False
    for node in (*prefill, *decode):
        if node.cards is not None:
            known = True
            for name, card in node.cards.items():
                seen.setdefault(name, card)
    sides = offer(prefill, decode)
    return [card for name, card in seen.items() if serves(name, sides)] if known else None


def offered(nodes: Iterable[Node]) -> frozenset[str] | None:
    """The models some of ``nodes`` serve; None when a node's are not known (any model)."""
    union: set[str] = set()
    for node in nodes:
        if node.models is None:
            return None
        union |= node.models
    return frozenset(union)


# What each role with nodes serves (None: any model): the fleet keeps it (``Fleet.offer``),
# made again whenever nodes or their models change, so a request does not rebuild it.
Offer = tuple[frozenset[str] | None, ...]


def offer(prefill: Sequence[Node], decode: Sequence[Node]) -> Offer:
    """A role with no node at all is left out: its requests are told that no node is live
    (503), which is the truth."""
    return tuple(offered(nodes) for nodes in (prefill, decode) if nodes)


def serves(model: str, sides: Offer) -> bool:
    """Every role of ``sides`` may serve ``model``."""
    return all(side is None or model in side for side in sides)


def check(model: str, sides: Offer) -> None:
    """Raise ``ModelNotFound`` unless every role of ``sides`` may serve ``model``."""
    if serves(model, sides):
        return
    known = [side for side in sides if side is not None]
    served = sorted(frozenset.intersection(*known))
    if not served:
        listing = "no model is served by both a prefill and a decode node"
    else:
        more = f" and {len(served) - NAMED} more" if len(served) > NAMED else ""
        listing = "served: " + ", ".join(served[:NAMED]) + more
    raise ModelNotFound(f"The model {model[:MAX_ID]!r} is not served here ({listing})")

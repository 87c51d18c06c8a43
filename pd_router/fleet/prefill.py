"""Which prefill node prefills a request. No I/O.

A prefill engine keeps the KV of the prompts it computed (vLLM's prefix caching) and
computes only what it has not seen: a chat turn repeats the whole conversation so far, so
the node that prefilled the last turn does the next one for the cost of the new tokens.
Round robin over N nodes finds that node one time in N.

``prefix`` (the default) sends each request to the node its *prefix key* hashes to, by
rendezvous (highest-random-weight) hashing over the usable nodes. The key depends on the
request only, and the ranking on the key and the node URLs only: routers that never talk
to each other send a conversation's turns to the same node, and adding or removing a node
moves only the keys it wins or held (about 1/N of them). The cost is O(nodes) per request,
whatever the number of conversations: the routers keep no table of prefixes to search.

Load bounds it, as in consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
2018; HAProxy's ``hash-balance-factor``): a node that already carries more than
``LOAD_FACTOR`` x the mean outstanding prefills + 1 is passed over for the next node in the
key's ranking. One hot prefix thus spills to the same second node from every router
instead of piling up, and the node carrying the least always qualifies (least <= mean).
Outstanding prefills are the requests bound to the node (``Node.bound``, which the fleet
keeps from the prefill request's start to its end on every path).

``least_loaded`` picks the node with the fewest outstanding prefills (ties in turn);
``round_robin`` takes the nodes in turn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import orjson

from pd_router.fleet.nodes import Node, State, usable, usable_for

# Leading characters of a prompt (and of each message) that make its key. A conversation's
# every turn starts with its first turn, so turns share the key whenever that first turn is
# at least this long; 1024 characters are ~250 tokens, less than any prompt worth caching.
# Two prompts sharing these characters share as many cacheable tokens, so when unrelated
# conversations collide on a key, sending them to one node still pays (and the load bound
# spreads them when they are many).
KEY_CHARS = 1024
# A token id counts as ~4 characters of text.
KEY_IDS = KEY_CHARS // 4
# The load a node may carry over the mean before its keys spill (the c of bounded loads):
# 1.25 keeps the busiest node within 25% (+1) of the mean and most keys at home.
LOAD_FACTOR = 1.25
# Prefix keys whose last node this router remembers (for ``hit`` in logs and metrics):
# ~100 bytes each, so ~1.6 MB at most.
RECENT_KEYS = 16384

_MASK = (1 << 64) - 1


def prefix_key(body: Mapping[str, Any]) -> int:
    """A 64-bit key for the part of the prompt a conversation's every turn repeats.

    Chat: the model, then the messages up to and including the first user message (the
    system prompt and tools are shared by many conversations; the first user message tells
    them apart, and later turns only append), each message's content cut at ``KEY_CHARS``.
    Completions: the model and the prompt's first ``KEY_CHARS`` characters (or ``KEY_IDS``
    token ids; the first prompt of a batch). The router has no tokenizer: characters of the
    body as sent are what every router sees alike, and a hash over them cannot depend on
    anything a replica knows that another does not.
    """
    digest = hashlib.blake2b(str(body.get("model")).encode(), digest_size=8)
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                break
            role = message.get("role")
            digest.update(b"\x00" + str(role).encode() + b"\x00")
            digest.update(_leading(message.get("content")))
            if role == "user":
                break
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        digest.update(_leading(prompt))
    return int.from_bytes(digest.digest(), "little")


def _leading(content: object) -> bytes:
    if isinstance(content, str):
        return content[:KEY_CHARS].encode("utf-8", "surrogatepass")
    if isinstance(content, list) and all(isinstance(item, int) for item in content[:KEY_IDS]):
        return orjson.dumps(content[:KEY_IDS])
    # Content parts (text, images): as the client wrote them, cut like a string.
    return orjson.dumps(content)[: KEY_CHARS * 4]


def _mix(value: int) -> int:
    """splitmix64's finaliser: a key and a node's salt become a uniform 64-bit score."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


def node_salt(url: str) -> int:
    """A node's identity in the ranking: its URL, the one name every replica gives it."""
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "little")


class RecentPrefixes:
    """The node each recent prefix key was last prefilled on, by this router: a hit is a
    key sent where it went last time (its prefix is likely still cached there)."""

    def __init__(self, capacity: int = RECENT_KEYS) -> None:
        self.capacity = capacity
        # A dict is an insertion-ordered map: re-inserting on use makes it an LRU.
        self._last: dict[int, int] = {}

    def record(self, key: int, node: Node) -> bool:
        """Remember ``node`` for ``key``; True if the key's last node was ``node``."""
        last = self._last.pop(key, None)
        self._last[key] = node.id
        if len(self._last) > self.capacity:
            del self._last[next(iter(self._last))]
        return last == node.id


class PrefillPolicy:
    """Picks among the usable prefill nodes that serve the request's model (``usable`` over
    the nodes serving it, as the decode pool does), never ``avoid``."""

    name: ClassVar[str]

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = list(nodes)
        self.usable = usable(self.nodes)
        self._accepts: dict[str, tuple[State, ...]] = {}
        self.recent = RecentPrefixes()

    def refresh(self) -> None:
        """A node's state or models changed, or a node came or went."""
        self.usable = usable(self.nodes)
        self._accepts.clear()

    def pick(self, key: int, avoid: Node | None = None, model: str | None = None) -> Node | None:
        accept = self.usable if model is None else usable_for(self.nodes, model, self._accepts)
        live = [
            node
            for node in self.nodes
            if node.state in accept and node is not avoid and node.serves(model)
        ]
        return self._choose(key, live) if live else None

    def _choose(self, key: int, live: list[Node]) -> Node:
        raise NotImplementedError


class RoundRobin(PrefillPolicy):
    name = "round_robin"

    def __init__(self, nodes: Sequence[Node]) -> None:
        super().__init__(nodes)
        self._next = 0

    def _choose(self, key: int, live: list[Node]) -> Node:
        node = live[self._next % len(live)]
        self._next += 1
        return node


class LeastLoaded(RoundRobin):
    """The fewest outstanding prefills; ties in turn, so an idle fleet is used evenly."""

    name = "least_loaded"

    def _choose(self, key: int, live: list[Node]) -> Node:
        start = self._next % len(live)
        self._next += 1
        return min(live[start:] + live[:start], key=_load)


class Prefix(PrefillPolicy):
    """Rendezvous hashing of the prefix key, with bounded load (see the module docstring)."""

    name = "prefix"

    def __init__(self, nodes: Sequence[Node]) -> None:
        super().__init__(nodes)
        self._salts = {node.url: node_salt(node.url) for node in self.nodes}

    def refresh(self) -> None:
        super().refresh()
        self._salts = {node.url: node_salt(node.url) for node in self.nodes}

    def _choose(self, key: int, live: list[Node]) -> Node:
        salts = self._salts
        scores = [_mix(key ^ salts[node.url]) for node in live]
        limit = LOAD_FACTOR * sum(map(_load, live)) / len(live) + 1
        ranking = sorted(range(len(live)), key=scores.__getitem__, reverse=True)
        return next(live[index] for index in ranking if _load(live[index]) <= limit)


def _load(node: Node) -> int:
    return len(node.bound)


POLICIES: dict[str, type[PrefillPolicy]] = {
    policy.name: policy for policy in (Prefix, LeastLoaded, RoundRobin)
}
DEFAULT_POLICY = Prefix.name

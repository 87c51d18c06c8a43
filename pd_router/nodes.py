"""Engine nodes: how they are named on the command line, and which prefill node goes next."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(eq=False)
class Node:
    """One engine. ``id`` is stable for the life of the process: nothing renumbers it."""

    id: int
    url: str
    slots: int
    # Owned by the pool: how many of ``slots`` are reserved right now.
    in_use: int = field(default=0)

    @property
    def free(self) -> int:
        return self.slots - self.in_use


def parse_node(spec: str, default_slots: int) -> tuple[str, int]:
    """``URL`` or ``URL,slots=N`` -> (normalised URL, slots).

    A comma is shell-safe and cannot appear in a host:port URL, so it separates options
    without quoting.
    """
    url, _, options = spec.partition(",")
    slots = default_slots
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        if key.strip() != "slots":
            raise ValueError(f"{spec!r}: unknown node option {key!r} (known: slots)")
        try:
            slots = int(value)
        except ValueError:
            raise ValueError(f"{spec!r}: slots must be a whole number, got {value!r}") from None
    if slots < 1:
        raise ValueError(f"{spec!r}: slots must be at least 1")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{spec!r}: expected an http(s)://host:port URL")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}", slots


def make_nodes(specs: Sequence[str], default_slots: int) -> list[Node]:
    nodes = []
    for index, spec in enumerate(specs):
        url, slots = parse_node(spec, default_slots)
        nodes.append(Node(id=index, url=url, slots=slots))
    return nodes


class RoundRobin:
    """Prefill nodes in turn: prefill is short and stateless between requests."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        if not nodes:
            raise ValueError("at least one node is needed")
        self.nodes = list(nodes)
        self._next = 0

    def pick(self) -> Node:
        node = self.nodes[self._next % len(self.nodes)]
        self._next += 1
        return node

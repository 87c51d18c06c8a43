"""Engine nodes: identity, state and health bookkeeping, and how they are named on the CLI.

No I/O here: the prober and the relay report what they saw, and a node's state follows
from it by the rules below.

* ``serving``: picked for new requests. ``draining``: keeps its in-flight requests, gets no
  new ones. ``dead``: picked by nothing; its requests have been failed, except the one that
  found it dead, which handles its own error.
* A node dies after ``unhealthy_after`` consecutive failures (probes or real requests), or
  at once when a real request finds it refusing connections. It is readmitted after
  ``healthy_after`` consecutive successful probes.
* Only the engine's own failures count: a 4xx answer, a client hang-up or a request the
  router cancelled says nothing about the node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal
from urllib.parse import urlsplit

Role = Literal["prefill", "decode"]


class State(str, Enum):
    SERVING = "serving"
    DRAINING = "draining"
    DEAD = "dead"


@dataclass(frozen=True)
class HealthPolicy:
    unhealthy_after: int = 3
    healthy_after: int = 2


@dataclass(eq=False)
class Node:
    """One engine. ``id`` is stable for the life of the process: nothing renumbers it."""

    id: int
    url: str
    slots: int
    role: Role = "decode"
    # Owned by the pool: how many of ``slots`` are reserved right now.
    in_use: int = 0
    state: State = State.SERVING
    failures: int = 0
    successes: int = 0
    last_error: str | None = None
    # Request ids bound to this node right now (the fleet keeps this in step).
    bound: set[str] = field(default_factory=set)
    # The operator's own tags (zone, GPU type...): shown, never used to route.
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return self.slots - self.in_use

    @property
    def serving(self) -> bool:
        return self.state is State.SERVING

    def failed(self, error: str, policy: HealthPolicy, *, fatal: bool = False) -> bool:
        """Count a failure; True when this made the node dead."""
        self.failures += 1
        self.successes = 0
        self.last_error = error
        if self.state is State.DEAD or (not fatal and self.failures < policy.unhealthy_after):
            return False
        self.state = State.DEAD
        return True

    def succeeded(self, policy: HealthPolicy) -> bool:
        """Count a success; True when this readmitted a dead node."""
        self.failures = 0
        self.successes += 1
        if self.state is not State.DEAD or self.successes < policy.healthy_after:
            return False
        self.state = State.SERVING
        return True


@dataclass(frozen=True)
class NodeSpec:
    """A node as configured, before it has an id: URL (normalised), slots, labels."""

    url: str
    # None: the role's default (``--decode-slots``), which may come from another source.
    slots: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


# Shown as ``key=value,...`` (status table, logs): a key cannot hold "=", "," or spaces.
_LABEL_KEY = re.compile(r"[A-Za-z0-9_./-]+")


def check_labels(labels: object) -> dict[str, str]:
    """A node's labels, as given in a config file or to the admin API: strings to strings."""
    if not isinstance(labels, Mapping):
        raise ValueError("labels must be a table of names to strings")
    checked = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key):
            raise ValueError(f"label name {key!r}: use letters, digits and _ . / - only")
        if not isinstance(value, str):
            raise ValueError(f"label {key!r} must be a string, got {value!r}")
        checked[key] = value
    return checked


def parse_spec(spec: str) -> NodeSpec:
    """``URL`` or ``URL,slots=N`` -> NodeSpec.

    A comma is shell-safe and cannot appear in a host:port URL, so it separates options
    without quoting.
    """
    url, _, options = spec.partition(",")
    slots = None
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
    return NodeSpec(normalise_url(url, spec), slots)


def normalise_url(url: str, spec: str | None = None) -> str:
    """``http(s)://host:port[/path]`` without a trailing slash; anything else is refused."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        shown = url if spec is None else spec
        raise ValueError(f"{shown!r}: expected an http(s)://host:port URL")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def parse_node(spec: str, default_slots: int) -> tuple[str, int]:
    """``URL`` or ``URL,slots=N`` -> (normalised URL, slots)."""
    node = parse_spec(spec)
    slots = default_slots if node.slots is None else node.slots
    if slots < 1:
        raise ValueError(f"{spec!r}: slots must be at least 1")
    return node.url, slots


def make_nodes(
    specs: Sequence[str | NodeSpec], default_slots: int, role: Role = "decode", first_id: int = 0
) -> list[Node]:
    """Nodes numbered from ``first_id``; strings are parsed as on the command line."""
    nodes = []
    for index, spec in enumerate(specs):
        node = parse_spec(spec) if isinstance(spec, str) else spec
        slots = default_slots if node.slots is None else node.slots
        if slots < 1:
            raise ValueError(f"{node.url!r}: slots must be at least 1")
        nodes.append(
            Node(
                id=first_id + index, url=node.url, slots=slots, role=role, labels=dict(node.labels)
            )
        )
    return nodes


class RoundRobin:
    """Prefill nodes in turn, over those serving: prefill is short and keeps no state."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = list(nodes)
        self._next = 0

    def pick(self, avoid: Node | None = None) -> Node | None:
        live = [node for node in self.nodes if node.serving and node is not avoid]
        if not live:
            return None
        node = live[self._next % len(live)]
        self._next += 1
        return node

"""Who changes the fleet, and where the fleet lives: this process, or every router's Redis.

The admin API adds, drains and removes nodes through a ``Membership``, chosen at start-up:
``LocalMembership`` changes this process's ``Fleet`` and nothing else (no ``--state``,
today's behaviour); ``shared_fleet.SharedFleet`` writes the change to Redis, and every
router applies it. What a router does with the shared fleet's records is decided here, with
no I/O (``apply``): the records are the truth for membership and admin states, the shared
verdicts (dead, unhealthy, back) for health; a stall and the failure streaks stay each
router's own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import orjson

from pd_router.fleet.nodes import Node, Role, State, normalise_url
from pd_router.fleet.registry import GONE, Fleet

# How a discovered node's source starts.
DNS_SOURCE = "dns:"

Admin = Literal["serving", "draining", "removed"]
ADMIN_STATES: tuple[Admin, ...] = ("serving", "draining", "removed")

Background = list[tuple[str, Callable[[], Awaitable[None]]]]


class Conflict(ValueError):
    """An operator's change another router's came before (``--state``): 409 ``conflict``."""


class Membership(Protocol):
    async def add(self, url: str, role: Role, slots: int, labels: dict[str, str]) -> Node:
        """The node of that role and (canonical) URL with these slots and labels: a new one,
        joining (serving at once when nothing probes), or the one the fleet has, under its
        id, drained no more."""

    async def drain(self, node: Node) -> None: ...

    async def remove(self, node: Node, force: bool) -> None:
        """Raises ``ValueError`` (why not) when the node still serves or has requests."""

    async def in_flight(self) -> dict[str, dict[int, int]] | None:
        """Requests in flight per router, per node id; None: there is only this router."""

    def may_probe(self) -> bool:
        """This router probes the engines now (with ``--state``, one router does)."""

    def background(self) -> Background:
        """Work that lives as long as the app (named, for its supervisor)."""

    # What DNS discovery changes (``discovery/loop.py``)

    async def discovered(
        self, url: str, role: Role, slots: int, labels: dict[str, str], source: str
    ) -> Node | None:
        """The node for an address a name lists, joining if new (with ``--state``, the
        fleet's node for that role and URL, whoever found it; None if it was removed
        meanwhile)."""

    async def gone(self, node: Node) -> None:
        """The node's address is no longer listed: drain it (not an operator's drain)."""

    async def back(self, node: Node) -> bool:
        """Its address is listed again: undo ``gone``'s drain; False if it was not that."""

    async def retire(self, node: Node, force: bool) -> None:
        """Remove a gone node that is idle here, or ``force``: past the drain bound.
        Raises ``ValueError`` when it must wait (another router still has requests on it)."""


class LocalMembership:
    """The fleet of this process only. ``probes``: this router probes its nodes, so a new
    one joins (serves from its first good probe) whatever its source."""

    def __init__(self, fleet: Fleet, probes: bool = True) -> None:
        self.fleet = fleet
        self.probes = probes

    async def add(self, url: str, role: Role, slots: int, labels: dict[str, str]) -> Node:
        node = self.fleet.find(role, url)
        if node is None:
            return self.fleet.add(url, role, slots, labels=labels, joining=self.probes)
        self.fleet.add_again(node, slots, labels)
        return node

    async def drain(self, node: Node) -> None:
        self.fleet.drain(node)

    async def remove(self, node: Node, force: bool) -> None:
        self.fleet.remove(node, force=force)

    async def in_flight(self) -> dict[str, dict[int, int]] | None:
        return None

    def may_probe(self) -> bool:
        return True

    def background(self) -> Background:
        return []

    async def discovered(
        self, url: str, role: Role, slots: int, labels: dict[str, str], source: str
    ) -> Node:
        # A node its name let go of (taken back while its address was gone), listed again:
        # the name's again, as it is.
        known = self.fleet.find(role, url)
        if known is not None:
            return known
        return self.fleet.add(url, role, slots, labels=labels, source=source, joining=self.probes)

    async def gone(self, node: Node) -> None:
        self.fleet.drain(node, GONE)

    async def back(self, node: Node) -> bool:
        return self.fleet.rejoin(node, GONE, joining=self.probes)

    async def retire(self, node: Node, force: bool) -> None:
        self.fleet.remove(node, force=True)  # idle, or past the bound: nothing to wait for


@dataclass(frozen=True)
class Record:
    """A node as the shared fleet keeps it (``{pdr}:nodes`` and ``{pdr}:admin``)."""

    id: int
    role: Role
    url: str
    slots: int
    labels: Mapping[str, str] = field(default_factory=dict)
    admin: Admin = "serving"
    # Removed with ``?force=true``: what still runs on it is failed, on every router.
    forced: bool = False
    # As ``Node.source``: the same on every router, so that each one's discovery of that
    # name takes the node as its own.
    source: str = "static"
    # Draining because a router's lookup stopped listing it (not an operator's drain): its
    # return to DNS undoes it.
    gone: bool = False
    # Times it was added again after its removal (``{pdr}:incarnation``, apart from the body).
    incarnation: int = 0

    @property
    def admin_value(self) -> str:
        """What ``{pdr}:admin`` holds for it."""
        if self.forced:
            return "removed forced"
        return "draining gone" if self.gone else self.admin

    def body(self) -> bytes:
        """What ``{pdr}:nodes`` holds for it (the id is the field, the admin state apart)."""
        document = {"role": self.role, "url": self.url, "slots": self.slots}
        return orjson.dumps({**document, "labels": dict(self.labels), "source": self.source})

    @classmethod
    def parse(cls, node_id: int, body: bytes, admin: bytes | None, incarnation: int = 0) -> Record:
        document: dict[str, Any] = orjson.loads(body)
        role = document["role"]
        state, _, how = (admin or b"serving").decode().partition(" ")
        if role not in ("prefill", "decode") or state not in ADMIN_STATES:
            raise ValueError(f"node {node_id}: role {role!r}, admin state {state!r}")
        labels = {str(k): str(v) for k, v in (document.get("labels") or {}).items()}
        # Canonical, as every router writes it now (an older one may not have).
        slots, url = int(document["slots"]), normalise_url(str(document["url"]))
        source = str(document.get("source", "static"))
        forced, gone = how == "forced", how == "gone"
        return cls(node_id, role, url, slots, labels, state, forced, source, gone, incarnation)

    @classmethod
    def of(cls, node: Node) -> Record:
        return cls(node.id, node.role, node.url, node.slots, dict(node.labels), source=node.source)


@dataclass(frozen=True)
class Verdict:
    """A router's finding on a node's health (``{pdr}:health``): dead, unhealthy, or back."""

    state: State
    reason: str | None
    message: str
    router: str

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "state": self.state.value,
                "reason": self.reason,
                "message": self.message,
                "by": self.router,
            }
        )

    @classmethod
    def parse(cls, body: bytes) -> Verdict:
        document: dict[str, Any] = orjson.loads(body)
        state = State(document["state"])
        if state not in (State.DEAD, State.UNHEALTHY, State.SERVING):
            raise ValueError(f"not a verdict: {state.value}")
        reason = document.get("reason")
        return cls(
            state,
            None if reason is None else str(reason),
            str(document.get("message", "")),
            str(document.get("by", "")),
        )

    @classmethod
    def of(cls, node: Node, router: str) -> Verdict:
        return cls(node.state, node.reason, node.last_error or "", router)


def apply(
    fleet: Fleet,
    records: Mapping[int, Record],
    verdicts: Mapping[int, Verdict],
    own: Container[Node] = (),
    probes: bool = True,
    before: Mapping[int, Record] | None = None,
) -> None:
    """Make ``fleet`` what the shared records say; ``own``: nodes whose verdict found here
    has not reached Redis yet (the local one is the newer); ``probes``: this router probes
    (a node new to it joins, unless it comes from a router's flags); ``before``: the
    records ``fleet`` was made to match last time.

    Nodes are matched by role and URL, and take the record's id: Redis's ids are the truth,
    and one that changed (a fleet put back after Redis lost it, while a new router took its
    ids) changes here too."""
    by_key = {(node.role, node.url): node for node in fleet.nodes}
    known = {(r.role, r.url): r.incarnation for r in (before or {}).values()}
    seen: set[tuple[Role, str]] = set()
    for record in sorted(records.values(), key=lambda record: record.id):
        key = (record.role, record.url)
        if key in seen:
            # Two spellings of one engine written by routers older than the canonical URL
            # (``nodes.normalise_url``): the older id is the node.
            continue
        seen.add(key)
        node = by_key.get(key)
        if record.admin == "removed":
            if node is not None and (record.forced or not node.bound):
                fleet.remove(node, force=True)  # a forced removal fails each request once
            elif node is not None:
                # The removal was checked against every router's requests, as counted up to
                # a second ago; one that started here since finishes first, and a later
                # reload removes the node.
                fleet.drain(node)
            continue
        if node is not None and record.incarnation > known.get(key, record.incarnation):
            # Removed and added again since this router last looked (it read the fleet after
            # both): it starts afresh, as on the routers that saw the removal; one with
            # requests here stays, as it would have stayed drained through the removal.
            if not node.bound:
                fleet.remove(node, force=True)
                node = None
        if node is None:
            node = fleet.add(
                record.url,
                record.role,
                record.slots,
                labels=dict(record.labels),
                source=record.source,
                # As in one process: an added or discovered engine serves after a good
                # probe, here or, told by its verdict, on another router.
                joining=probes and record.source != "static",
                node_id=record.id,
            )
        else:
            node.id = record.id
            fleet.resize(node, record.slots)
            node.labels, node.source = dict(record.labels), record.source
        verdict = verdicts.get(record.id)
        if verdict is not None and node not in own:
            fleet.told(node, verdict.state, verdict.reason, _found_by(verdict))
        if record.admin == "draining":
            fleet.drain(node, GONE if record.gone else "drained")
        elif node.state is State.DRAINING and not fleet.rejoin(node, GONE, joining=probes):
            fleet.undrain(node)


def _found_by(verdict: Verdict) -> str:
    return f"{verdict.message} (found by router {verdict.router})"

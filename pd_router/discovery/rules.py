"""Engines that come and go, found through DNS: what an answer changes in the fleet. No I/O.

A *group* is one ``--prefill-dns`` / ``--decode-dns`` name. Every ``--discovery-interval``
seconds the loop (``discovery/loop.py``) resolves each name (``discovery/resolver.py``) and
hands the answer to its group, which says what follows:

* an address the group does not have becomes a node (the group's slots and labels) that
  joins: it takes requests after its first good probe;
* a node whose address the answer no longer lists is drained (in-flight requests finish,
  no new ones) and removed once it holds nothing, or after ``drain_timeout`` seconds, when
  its remaining requests get the usual terminal error of a removed node;
* an address back before its node was removed gets that node back, under the same id, after
  a good probe; one back after the removal is a new node with a new id.

A failed lookup or an answer with no address changes nothing: DNS trouble never empties the
fleet. Only a real answer that lists fewer addresses removes nodes.

A node's identity is its address (``http://IP:PORT``), never the name or an id: with
``--state`` every router's changes go through the shared fleet, which keys nodes by role
and address, so that routers discovering the same name agree on each node and its id.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pd_router.fleet.membership import DNS_SOURCE
from pd_router.fleet.nodes import (
    PORT_LABELS,
    Role,
    check_labels,
    checked_slots,
    normalise_url,
    parse_port,
    parse_slots,
    whole,
)

Outcome = Literal["ok", "empty", "failed"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "empty", "failed")
Change = Literal["added", "drained", "rejoined", "removed"]
CHANGES: tuple[Change, ...] = ("added", "drained", "rejoined", "removed")

# RFC 1123 host names, plus the underscores of SRV names (_http._tcp.svc).
_NAME = re.compile(r"(?=.{1,253}\.?$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.?)+")


@dataclass(frozen=True)
class DnsSpec:
    """One name to discover nodes of one role by, as configured."""

    role: Role
    name: str
    # None for an SRV name: each record gives its own port.
    port: int | None
    # None: the role's default (``--decode-slots``), which may come from another source.
    slots: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def srv(self) -> bool:
        return self.name.startswith("_")

    @property
    def source(self) -> str:
        """How the nodes it brings show their origin (``/admin/nodes``, metrics, status)."""
        name = DNS_SOURCE + self.name
        return name if self.port is None else f"{name}:{self.port}"


def parse_dns_spec(text: str, role: Role) -> DnsSpec:
    """``NAME:PORT[,slots=N][,KEY=VALUE...]``, or ``_SRV.NAME[,...]`` with no port: the
    records give it. Any option but ``slots`` is a label."""
    target, _, options = text.strip().partition(",")
    slots = None
    labels = {}
    for option in filter(None, options.split(",")):
        key, equals, value = option.partition("=")
        key = key.strip()
        if not equals or not key:
            raise ValueError(
                f"{text!r}: expected KEY=VALUE options (slots=N, zone=a), got {option!r}"
            )
        if key == "slots":
            slots = parse_slots(value, text)
        elif key in PORT_LABELS:
            # Where its engines publish KV events, or serve SGLang's bootstrap: that port on
            # each address (the HTTP port's way: one port for every address the name lists).
            labels[key] = str(parse_port(value, text, key))
        elif difflib.get_close_matches(key.lower(), ["slots"], cutoff=0.75):
            raise ValueError(f"{text!r}: unknown option {key!r} (did you mean slots?)")
        else:
            labels[key] = value
    try:
        checked = check_labels(labels)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    return DnsSpec(role, *_target(target, text), slots, checked)


def dns_spec(
    role: Role,
    name: str,
    port: int | None,
    slots: int | None = None,
    labels: Mapping[str, str] | None = None,
) -> DnsSpec:
    """A spec from its parts (a config file's table), checked as ``parse_dns_spec`` does."""
    text = name if port is None else f"{name}:{port}"
    target = _target(text, text)
    if slots is not None:
        checked_slots(slots, text)
    return DnsSpec(role, *target, slots, check_labels(labels or {}))


def _target(target: str, text: str) -> tuple[str, int | None]:
    name, colon, port_text = target.rpartition(":")
    if not colon:
        name, port_text = target, ""
    if not _NAME.fullmatch(name) or "://" in target:
        raise ValueError(f"{text!r}: expected a DNS name and port: NAME:PORT (vllm-decode:8200)")
    if name.startswith("_"):
        if colon:
            raise ValueError(
                f"{text!r}: an SRV name (starting with _) takes its port from the records"
            )
        return name, None
    if not colon:
        raise ValueError(f"{text!r}: the port is missing: NAME:PORT (an SRV name starts with _)")
    # ASCII digits only, as every other port given (``whole``).
    port = whole(port_text) or 0
    if not 1 <= port <= 65535:
        raise ValueError(f"{text!r}: the port must be a whole number from 1 to 65535")
    return name, port


IPV4, IPV6 = "IPv4", "IPv6"


def family(node_url: str) -> str:
    """The address family of a discovered node's URL (``url``)."""
    return IPV6 if "[" in node_url else IPV4


def url(address: str, port: int) -> str:
    """A node's URL, and so its identity, from an IP address: canonical as every other
    source's (``fleet/nodes.py``), so that an address also given by URL is one node."""
    return normalise_url(
        f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"
    )


@dataclass(frozen=True)
class Answer:
    """What one lookup of a name gave: node URLs, or why there are none."""

    addresses: frozenset[str] = frozenset()
    # Set when some query did not answer (timeout, SERVFAIL...): the addresses are not known.
    failure: str | None = None
    # Address families (``IPV4``, ``IPV6``) whose queries did not answer while the other's
    # did: the addresses of those are not known, and are kept as they are; ``partial``
    # says why.
    unknown: frozenset[str] = frozenset()
    partial: str | None = None

    @property
    def outcome(self) -> Outcome:
        if self.failure is not None:
            return "failed"
        return "ok" if self.addresses else "empty"


@dataclass
class Member:
    """A node a group brought into the fleet."""

    node_id: int
    # Monotonic seconds since the answers stopped listing it; None while they list it.
    gone_since: float | None = None


@dataclass(frozen=True)
class Plan:
    """What an answer changes: URLs to add as joining nodes, node ids to drain or rejoin."""

    add: tuple[str, ...] = ()
    drain: tuple[int, ...] = ()
    rejoin: tuple[int, ...] = ()


class Group:
    """The nodes one name brought, by address, and what its lookups did (for metrics)."""

    def __init__(self, spec: DnsSpec) -> None:
        self.spec = spec
        self.members: dict[str, Member] = {}
        self.lookups: dict[Outcome, int] = dict.fromkeys(OUTCOMES, 0)
        self.changes: dict[Change, int] = dict.fromkeys(CHANGES, 0)
        # The last lookup's outcome, so that a lasting failure is logged once; likewise the
        # address families that did not answer.
        self.last: Outcome | None = None
        self.last_unknown: frozenset[str] = frozenset()
        self.listed = 0
        # The addresses its last real answer listed: a node another name of the role stops
        # listing passes to this one while this one lists it (``hand_over``).
        self.addresses: frozenset[str] = frozenset()

    def update(self, answer: Answer, taken: Collection[str], alive: Collection[int]) -> Plan:
        """Take ``answer`` in. ``taken``: URLs of nodes in the fleet that are not this
        group's to add (a static node or another name's is not added twice); ``alive``: the
        ids still in it (an operator may have removed a node; an address still listed comes
        back). The plan changes nothing here: each change is recorded (``joined``, ``left``,
        ``back``, ``removed``) once made, so that one the fleet could not make (Redis away,
        with ``--state``) is planned again next round."""
        self.lookups[answer.outcome] += 1
        self.members = {u: m for u, m in self.members.items() if m.node_id in alive}
        if answer.outcome != "ok":
            return Plan()
        # A family that did not answer lists what it listed before.
        kept = {
            u for u, m in self.members.items() if family(u) in answer.unknown and not m.gone_since
        }
        listed = self.addresses = answer.addresses | kept
        self.listed = len(listed)
        add = tuple(sorted(u for u in listed if u not in self.members and u not in taken))
        drain, rejoin = [], []
        for address, member in self.members.items():
            if address not in listed and member.gone_since is None:
                drain.append(member.node_id)
            elif address in listed and member.gone_since is not None:
                rejoin.append(member.node_id)
        return Plan(add, tuple(drain), tuple(rejoin))

    def hand_over(self, node_id: int, heir: Group) -> None:
        """The node's address is no longer listed here but is by ``heir`` (another name of
        the role): the node is ``heir``'s from now on, not drained. README: an address
        listed by two names is one node, and only what really lists fewer removes it."""
        address = next(a for a, m in self.members.items() if m.node_id == node_id)
        heir.members[address] = self.members.pop(address)

    def joined(self, address: str, node_id: int) -> None:
        self.members[address] = Member(node_id)
        self.changes["added"] += 1

    def left(self, node_id: int, now: float) -> None:
        """The node of a gone address drains from ``now``."""
        self._member(node_id).gone_since = now
        self.changes["drained"] += 1

    def back(self, node_id: int, rejoined: bool) -> None:
        """A gone address is listed again; ``rejoined``: its node joins again (False: an
        operator's drain, which stays)."""
        self._member(node_id).gone_since = None
        self.changes["rejoined"] += rejoined

    def sweep(
        self, now: float, drain_timeout: float, idle: Callable[[int], bool]
    ) -> list[tuple[str, int, bool]]:
        """Gone nodes to remove now (address, id), each with whether it must be forced (it
        still holds requests after ``drain_timeout``)."""
        removing = []
        for address, member in self.members.items():
            if member.gone_since is None:
                continue
            empty = idle(member.node_id)
            if empty or now - member.gone_since >= drain_timeout:
                removing.append((address, member.node_id, not empty))
        return removing

    def removed(self, address: str) -> None:
        del self.members[address]
        self.changes["removed"] += 1

    def released(self, address: str) -> None:
        """A gone address's node was taken back (it serves again): no longer this name's."""
        del self.members[address]

    def _member(self, node_id: int) -> Member:
        return next(m for m in self.members.values() if m.node_id == node_id)


@dataclass
class Discovery:
    """Every name the router discovers nodes by, and how it looks them up."""

    groups: list[Group]
    # Slots of a decode node whose name does not say (--decode-slots).
    decode_slots: int = 1
    interval: float = 5.0
    drain_timeout: float = 300.0
    # ``--dns-server`` (host, port); None: the system's resolver configuration.
    server: tuple[str, int] | None = None

"""The live fleet: every node by stable id, the decode pool, and the binding table. No I/O.

The binding table is the truth for what a node's death affects: a request is bound to its
decode node from reservation to its end, and to its prefill node while prefilling. A
binding is removed on every path (end, abort, eviction), so the table never outgrows the
requests in flight.

A node's death fails exactly the requests bound to it, each through its own handle, once;
nothing else is touched. The request whose own attempt showed the node dead is spared: it
already has its error, and goes to another node if the engine never got it. A node found
unhealthy (slow, erroring) only stops getting new requests; a stalled one also ends its
silent streams, and only those. Failing is synchronous: each request is cancelled and
sends its own one terminal error from its own cleanup point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from pd_router.errors import NodeDead, RouterError, Stalled
from pd_router.fleet import models
from pd_router.fleet.holdings import KvView
from pd_router.fleet.kvevents import EventStreams
from pd_router.fleet.nodes import Failure, HealthPolicy, Node, Role, State
from pd_router.fleet.pool import DecodePool
from pd_router.fleet.prefill import DEFAULT_POLICY, POLICIES

log = logging.getLogger("pd_router.fleet")

# A joining node's reason for not serving.
JOINING = "not yet probed"
# The reason a node drained by discovery shows; only such a drain is undone by its return.
GONE = "gone from DNS"
# What a node that leads back to a router the request passed through is found to be
# (``edge/hops.py``), and how long such a node is kept out, whatever its probes say.
LOOP = "loop"
LOOP_HOLD = 60.0
# A prefill silent for the whole read timeout (the relay's soft failure ``timeout``): its
# engine's /health may well answer, so only time can show it serves again.
TIMEOUT = "timeout"
TIMEOUT_HOLD = 60.0


def _named(node: Node) -> tuple[str, int, str]:
    return node.role, node.id, node.url


def _one_node_per_engine(nodes: list[Node]) -> None:
    seen: set[tuple[Role, str]] = set()
    for node in nodes:
        if (node.role, node.url) in seen:
            raise ValueError(
                f"{node.role} node {node.url} is given twice: one engine is one node "
                "(give it once, with its slots)"
            )
        seen.add((node.role, node.url))


class Handle(Protocol):
    """What the fleet needs of an in-flight request."""

    request_id: str

    def fail(self, error: RouterError) -> None:
        """End the request with ``error`` as its one terminal outcome (idempotent)."""


class Progress(Protocol):
    """A started stream, as the stall watch sees it (``fleet/stall.py``)."""

    @property
    def received(self) -> int:
        """Bytes received from the engine so far."""

    @property
    def awaiting(self) -> bool:
        """The relay is waiting for the engine's next bytes (not busy with its client)."""


class Binding:
    __slots__ = ("handle", "prefill", "decode", "stream", "seen", "silent")

    def __init__(self, handle: Handle, decode: Node) -> None:
        self.handle = handle
        self.decode = decode
        self.prefill: Node | None = None
        # Set once the decode engine's stream has started (it has the KV): the stall watch
        # looks at these only. ``seen`` and ``silent`` are the watch's own bookkeeping.
        self.stream: Progress | None = None
        self.seen = 0
        self.silent = 0.0


class Fleet:
    def __init__(
        self,
        prefill: list[Node],
        decode: list[Node],
        policy: HealthPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        pool: Callable[[list[Node]], DecodePool] = DecodePool,
        prefill_policy: str = DEFAULT_POLICY,
        kv: KvView | None = None,
    ) -> None:
        self.policy = policy or HealthPolicy()
        self.clock = clock
        _one_node_per_engine([*prefill, *decode])
        # What each engine is predicted to hold (``fleet/holdings.py``).
        self.kv = kv if kv is not None else KvView()
        # The KV event streams of the engines that publish them (``engines/kvevents.py``).
        self.events = EventStreams(self.kv)
        self.prefill = POLICIES[prefill_policy](prefill, self.kv)
        # In-process by default; shared by every router on one Redis with ``--state``.
        self.pool = pool(decode)
        self.offer = models.offer(self.prefill.nodes, self.pool.nodes)
        self.bindings: dict[str, Binding] = {}
        # Every request in flight by id, from its arrival (before it has a slot) to its end.
        self.requests: dict[str, Handle] = {}
        self._next_id = len(prefill) + len(decode)
        # Told of each death, unhealthy verdict and readmission this router finds (not of a
        # stall, its own streams' business, nor of what it is told): with ``--state`` the
        # shared fleet publishes them to every router.
        self.on_verdict: Callable[[Node], None] = lambda node: None

    @property
    def nodes(self) -> list[Node]:
        return [*self.prefill.nodes, *self.pool.nodes]

    def node(self, node_id: int) -> Node | None:
        return next((node for node in self.nodes if node.id == node_id), None)

    def find(self, role: Role, url: str) -> Node | None:
        """The node of the engine at ``url`` (canonical, ``nodes.normalise_url``) in ``role``:
        one engine is one node."""
        group = self.pool.nodes if role == "decode" else self.prefill.nodes
        return next((node for node in group if node.url == url), None)

    def serving_view(self) -> list[int]:
        """Original nodes minus dead minus draining minus unhealthy (unless none of a role is
        serving): what new requests can land on."""
        prefill, pool = self.prefill, self.pool
        return [node.id for node in prefill.nodes if node.state in prefill.usable] + [
            node.id for node in pool.nodes if node.state in pool.usable
        ]

    # Bindings

    def admit(self, request_id: str, handle: Handle) -> str:
        """Register a request from its arrival to its end (``leave``), queued included;
        returns its id, with a suffix if a request in flight already has it: ids key the
        binding table, abort-by-id and the engines' KV."""
        candidate, n = request_id, 1
        while candidate in self.requests:
            n += 1
            candidate = f"{request_id}.{n}"
        self.requests[candidate] = handle
        return candidate

    def leave(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    @contextmanager
    def bind(self, handle: Handle, decode: Node) -> Iterator[Binding]:
        binding = Binding(handle, decode)
        rid = handle.request_id
        self.bindings[rid] = binding
        decode.bound.add(rid)
        try:
            yield binding
        finally:
            self.set_prefill(binding, None)
            binding.decode.bound.discard(rid)
            if self.bindings.get(rid) is binding:
                del self.bindings[rid]

    def set_decode(self, binding: Binding, node: Node) -> None:
        rid = binding.handle.request_id
        binding.decode.bound.discard(rid)
        binding.decode = node
        node.bound.add(rid)

    def set_prefill(self, binding: Binding, node: Node | None) -> None:
        rid = binding.handle.request_id
        if binding.prefill is not None:
            binding.prefill.bound.discard(rid)
        binding.prefill = node
        if node is not None:
            node.bound.add(rid)

    # What the prober, the relay and the stall watch saw

    def failed(
        self, node: Node, failure: Failure, *, reporter: Handle | None = None, probe: bool = False
    ) -> None:
        """``reporter``, the request that saw the failure, already has its own error and
        deals with it (a request the engine never got goes to another node): the node's
        death does not fail it. ``probe``: a health probe saw it (``Node.failed``)."""
        if failure.kind == LOOP:
            # Only a request shows a loop through another router (whose /health is fine):
            # the probes would readmit the node, and the next request would loop again.
            node.hold_until = max(node.hold_until, self.clock() + LOOP_HOLD)
        state = node.failed(failure, self.policy, probe)
        if failure.kind == TIMEOUT and node.state is State.UNHEALTHY:
            # Held once the timeouts made it unhealthy (not before: a node that stays
            # serving after one would keep an unrelated later verdict longer).
            node.hold_until = max(node.hold_until, self.clock() + TIMEOUT_HOLD)
        if state is State.DEAD:
            self.kv.lost(node.id)
            message = f"{node.role} node {node.id} ({node.url}) is dead: {failure.message}"
            failing = self.fail_bound(node, NodeDead(message), spare=reporter, spare_flowing=True)
            log.warning("%s; failing its %d requests", message, failing)
        elif state is State.UNHEALTHY:
            log.warning(
                "%s node %s (%s) is unhealthy: %s; no new requests, its %d in flight continue",
                node.role,
                node.id,
                node.url,
                failure.message,
                len(node.bound),
            )
        if state is not None:
            self._changed()
            self.on_verdict(node)

    def served(self, node: Node) -> None:
        """A real request on ``node`` succeeded."""
        node.served()

    def probed(self, node: Node) -> None:
        """A good health probe."""
        joining = node.state is State.JOINING
        if node.probed(self.policy, self.clock()):
            if joining:
                log.info("%s node %s (%s) answered its first probe: serving", *_named(node))
            else:
                log.warning("%s node %s (%s) is back: readmitted", *_named(node))
            self._changed()
            self.on_verdict(node)

    def learned(self, node: Node, cards: dict[str, models.Card]) -> None:
        """The models ``node``'s engine serves, as it listed them just now (by id)."""
        node.cards = cards
        served = frozenset(cards)
        if node.models == served:
            return
        verb = "serves" if node.models is None else "now serves"
        node.models = served
        log.info("%s node %s (%s) %s: %s", *_named(node), verb, ", ".join(sorted(served)))
        self._changed()

    # What another router found (``--state``): the same consequences, no echo

    def told(self, node: Node, state: State, reason: str | None, message: str) -> None:
        """Another router's verdict: dead (its requests here fail), unhealthy, or serving
        (again: not before a stall hold found here ends; or a joining node's first good
        probe, made by another router)."""
        if state is State.DEAD and node.state not in (State.DEAD, State.DRAINING):
            node.state, node.reason, node.last_error = State.DEAD, reason, message
            self.kv.lost(node.id)
            message = f"{node.role} node {node.id} ({node.url}) is dead: {message}"
            failing = self.fail_bound(node, NodeDead(message), spare_flowing=True)
            log.warning("%s; failing its %d requests here", message, failing)
        elif state is State.UNHEALTHY and node.state is State.SERVING:
            node.state, node.reason, node.last_error = State.UNHEALTHY, reason, message
            log.warning("%s node %s (%s) is unhealthy: %s", node.role, node.id, node.url, message)
        elif (
            state is State.SERVING
            and node.state in (State.DEAD, State.UNHEALTHY, State.JOINING)
            and self.clock() >= node.hold_until
        ):
            joining = node.state is State.JOINING
            node.served()
            node.state, node.reason = State.SERVING, None
            if joining:
                log.info("%s node %s (%s) answered its first probe: serving", *_named(node))
            else:
                log.warning("%s node %s (%s) is back: readmitted", *_named(node))
        else:
            return
        self._changed()

    def stalled(self, node: Node, silent: list[Binding], seconds: float, hold: float) -> None:
        """Every started stream on ``node`` has been silent ``seconds``: each gets one
        terminal error, and the node takes no new requests for at least ``hold`` s."""
        if node.stalled(seconds, self.clock() + hold):
            self._changed()
        error = Stalled(f"decode engine {node.url}: stalled: no token for {seconds:.0f} s")
        log.warning(
            "%s node %s (%s) stalled: no byte for %.0f s on any of its %d started streams; "
            "ending them, no new requests for at least %.0f s",
            node.role,
            node.id,
            node.url,
            seconds,
            len(silent),
            hold,
        )
        for binding in silent:
            binding.handle.fail(error)

    def _changed(self) -> None:
        """A node's state or models changed: what new requests may land on, and the queues,
        follow."""
        self.prefill.refresh()
        self.pool.refresh()
        self.offer = models.offer(self.prefill.nodes, self.pool.nodes)
        self.kv.forget({node.id for node in self.nodes})
        self.pool.wake()
        self.pool.fail_stranded()

    def fail_bound(
        self,
        node: Node,
        error: RouterError,
        spare: Handle | None = None,
        spare_flowing: bool = False,
    ) -> int:
        """Fail the requests bound to ``node`` but ``spare``; with ``spare_flowing``, also
        spare the started streams whose bytes still flowed at the stall watch's last look:
        a probe's verdict never ends a request whose own stream shows the engine at work
        (an engine shutting down gracefully refuses new connections and finishes its
        streams); if the engine is really gone, their connections break on their own."""
        failing = 0
        for rid in list(node.bound):
            binding = self.bindings.get(rid)
            if binding is None or binding.handle is spare:
                continue
            if not spare_flowing or binding.stream is None or binding.silent > 0:
                binding.handle.fail(error)
                failing += 1
        return failing

    # Administration

    def add(
        self,
        url: str,
        role: Role,
        slots: int,
        *,
        labels: dict[str, str] | None = None,
        source: str = "admin",
        joining: bool = False,
        node_id: int | None = None,
    ) -> Node:
        """A new node, under a new id unless ``node_id`` (the shared fleet's) is given;
        ``joining``: it takes no request before its first good probe (``Node.probed``).
        Refused for an engine the fleet has in that role (``add_again`` changes it)."""
        if self.find(role, url) is not None:
            raise ValueError(f"{role} node {url} is in the fleet already")
        node_id = self._next_id if node_id is None else node_id
        node = Node(id=node_id, url=url, slots=slots, role=role, labels=labels or {}, source=source)
        if joining:
            node.state, node.reason = State.JOINING, JOINING
        self._next_id = max(self._next_id, node_id + 1)
        (self.pool.nodes if role == "decode" else self.prefill.nodes).append(node)
        self._changed()
        return node

    def add_again(self, node: Node, slots: int, labels: dict[str, str]) -> None:
        """An operator added a node the fleet has: it keeps its id and takes these slots and
        labels; a drained one serves again. Its health stays what the evidence says."""
        node.labels = labels
        self.resize(node, slots)
        self.undrain(node)

    def drain(self, node: Node, reason: str = "drained") -> None:
        """No new requests for ``node``; a dead one too (else it would serve again as soon
        as its engine answers). An operator's drain of a node drained for DNS makes the
        drain the operator's, which the address's return does not undo (``rejoin``)."""
        if node.state in (State.SERVING, State.UNHEALTHY, State.JOINING, State.DEAD):
            node.drained_from, node.drained_reason = node.state, node.reason
            node.state = State.DRAINING
            node.reason = reason
            self._changed()
        elif node.state is State.DRAINING and node.reason == GONE and reason != GONE:
            node.reason = reason
            self._changed()

    def rejoin(self, node: Node, drained_for: str, joining: bool = True) -> bool:
        """Undo a drain made for ``drained_for`` (an address back in DNS before its node was
        removed): the node joins again, under its id, and serves after a good probe (with
        ``joining`` false, nothing probes: it is as before its drain). A node drained for
        another reason (an operator's) stays drained. One the evidence was against (drained
        unhealthy or dead, or held out after a stall) goes back to that, to be readmitted
        as such a node is (``--healthy-after``, its hold), not after one good probe: a hung
        engine's address may flap in DNS while its ``/health`` answers."""
        if node.state is not State.DRAINING or node.reason != drained_for:
            return False
        trusted = node.drained_from in (None, State.SERVING, State.JOINING)
        if joining and trusted and node.hold_until <= self.clock():
            node.state, node.reason = State.JOINING, JOINING
            node.drained_from = node.drained_reason = None
            node.successes = 0
            self._changed()
        else:
            self.undrain(node)
        return True

    def undrain(self, node: Node) -> None:
        """A drained node back as it was before its drain, less what the evidence said
        since: serving, unhealthy (then readmitted by good probes), or joining."""
        if node.state is not State.DRAINING:
            return
        state = node.drained_from or State.SERVING
        reason = node.drained_reason if state in (State.UNHEALTHY, State.DEAD) else None
        if state is State.SERVING and node.failures >= self.policy.unhealthy_after:
            state = State.UNHEALTHY
        node.state, node.drained_from, node.drained_reason = state, None, None
        node.reason = JOINING if state is State.JOINING else reason
        self._changed()

    def resize(self, node: Node, slots: int) -> None:
        if node.slots != slots:
            node.slots = slots
            self._changed()

    def remove(self, node: Node, *, force: bool = False) -> None:
        """Forget a drained (or dead) node; ``force`` fails its bound requests first."""
        if node.bound and not force:
            raise ValueError(f"node {node.id} still has {len(node.bound)} requests in flight")
        if node.state in (State.SERVING, State.UNHEALTHY) and not force:
            raise ValueError(f"node {node.id} is {node.state.value}: drain it first")
        node.state = State.DEAD
        node.reason = "removed"
        self.fail_bound(node, NodeDead(f"{node.role} node {node.id} ({node.url}) was removed"))
        group = self.pool.nodes if node.role == "decode" else self.prefill.nodes
        group.remove(node)
        self._changed()

"""The fleet shared by every router on one Redis (``--state``): the I/O around
``membership.apply``, which decides.

* Ids. A node's id is Redis's (``{pdr}:node-ids``: one per role and URL, never deleted, so
  never given to another node). A router's ``--prefill``/``--decode`` nodes are registered
  when it registers with the shared state (before its slots are written): a URL new to the
  fleet gets a new id; a known one keeps its id, slots and admin state, so that a restart
  of every router keeps what operators changed.
* Changes. Add, drain and remove go to Redis in one script that also publishes on
  ``{pdr}:fleet``; every router reloads the fleet on hearing it, and every ``RECONCILE``
  seconds anyway (a message lost while its subscription was down).
* DNS discovery. An address a router's lookup lists is registered like an operator's add
  but without overwriting a known node (``discover``); a router whose own lookups lost it
  drains it as ``draining gone`` (only a serving node), undoes only that drain, and
  removes the node with the admin removal's checks (README: discovery, several routers).
* Health. A death, an unhealthy verdict or a readmission found here is written to
  ``{pdr}:health`` and published the same way; until Redis has it, the local verdict
  stands over the stored one. A stall stays this router's (its own streams).
* Probing. One router probes the engines for the fleet (``{pdr}:prober``, a lease renewed
  every third of ``LEASE``); the others take its verdicts. While Redis is away each router
  probes for itself.
* Removed nodes. A removed node's record is dropped ``kept`` seconds after its removal,
  once no router has requests on it (``scripts.PRUNE``, run by every router at each
  reconciliation): its id and its removal stay, read by id only. A router that heard
  nothing meanwhile, or restarts with its URL in its flags, finds the removal when it
  puts the record back (``NODES``), and applies it while it still has the node.
* Requests in flight per node are written every second they change (and every third of
  the lease) under a key that expires with the router's lease: ``in_flight`` reads every
  live router's.
* Redis away: the local fleet stays as it is, requests in flight go on, admin changes get
  503 ``shared state unavailable``; verdicts wait and are sent when Redis answers, and the
  next reload reconciles. A Redis that lost the fleet gets it back from the routers.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pd_router.errors import StateUnavailable
from pd_router.fleet.membership import Background, Conflict, Record, Verdict, apply
from pd_router.fleet.nodes import Node, Role, State
from pd_router.fleet.registry import GONE, Fleet
from pd_router.shared import scripts
from pd_router.shared.pool import SharedPool, answered, noting
from pd_router.shared.redis import RETRY, RedisError, RedisUnavailable, Script, flag, listed

log = logging.getLogger("pd_router.shared_fleet")

# Seconds between reloads with no message: the safety net, not the way changes travel.
RECONCILE = 5.0
# Seconds between looks at this router's requests per node (written only when changed).
IN_FLIGHT_EVERY = 1.0
# Seconds a removed node's record is kept: far longer than any router takes to apply the
# removal (at the latest, its next reconciliation).
REMOVED_KEPT = 600.0
# Removed nodes' records one reconciliation drops at most: ~3 ms of Redis's time (which no
# router's request gets meanwhile); more go round by round.
PRUNE_BATCH = 500
# Pruned removals a router remembers, to put back if Redis loses the fleet (~250 bytes
# each: 16 MB at most).
PRUNED_MEMORY = 65536


def _per_router(reply: Any) -> bool:
    """``IN_FLIGHT``'s reply: a router's id, then its (node id, count) pairs, for each."""
    return (
        isinstance(reply, list)
        and all(type(router) is bytes for router in reply[::2])
        and all(isinstance(pairs, list) for pairs in reply[1::2])
        and len(reply) % 2 == 0
    )


_NODES = Script(scripts.NODES, noting(3))
_ADMIN = Script(scripts.ADMIN, flag)
_DNS_ADMIN = Script(scripts.DNS_ADMIN, flag)
_VERDICT = Script(scripts.VERDICT, flag)
_SNAPSHOT = Script(scripts.SNAPSHOT, listed(4))
_PRUNE = Script(scripts.PRUNE, lambda reply: type(reply) is int)
_PUT_IN_FLIGHT = Script(scripts.PUT_IN_FLIGHT, flag)
_IN_FLIGHT = Script(scripts.IN_FLIGHT, _per_router)
_PROBER = Script(scripts.PROBER, flag)
_UNPROBE = Script(scripts.UNPROBE, flag)
_PROBING = {True: "probes the engines for the fleet", False: "leaves probing to another router"}


class SharedFleet:
    def __init__(
        self, fleet: Fleet, pool: SharedPool, probes: bool = True, kept: float = REMOVED_KEPT
    ) -> None:
        """``probes``: this router probes the engines (``--health-interval`` > 0), so it
        may be the fleet's prober; ``kept``: seconds a removed node's record is kept."""
        self.fleet = fleet
        self.kept = kept
        self.pool = pool
        self.redis = pool.redis
        self.router_id = pool.router_id
        # This router's configured nodes and slots, until they have the fleet's ids.
        self._configured: list[tuple[Node, int]] | None = [(n, n.slots) for n in fleet.nodes]
        # Those, once adopted, until the next reload compares their slots with the fleet's.
        self._flagged: list[tuple[Node, int]] = []
        # The fleet as last read from Redis: what is put back if Redis loses it.
        self.records: dict[int, Record] = {}
        # The removals whose records were pruned that this router heard of (the oldest
        # forgotten past ``PRUNED_MEMORY``): put back with the fleet if Redis loses it.
        self._pruned: dict[tuple[Role, str], tuple[int, bool]] = {}  # (id, forced)
        # Verdicts found here that Redis has not taken yet (by node: a node found dead
        # before this router registered still has the id of its flags' order), each with the
        # node's incarnation then ("" before this router read the fleet): a verdict on an
        # incarnation since removed and added again is dropped (``scripts.VERDICT``).
        self._unsent: dict[Node, tuple[Verdict, str]] = {}
        # Created on first use: an anyio lock needs a running loop.
        self._lock: anyio.Lock | None = None
        self.probes = probes
        # Holds the prober lease (or cannot tell, Redis being away: then it probes).
        self._prober = False
        self._published: dict[int, int] | None = None
        self._published_at = -math.inf
        verdicts: tuple[MemoryObjectSendStream[Node], MemoryObjectReceiveStream[Node]]
        verdicts = anyio.create_memory_object_stream(math.inf)
        self._found, self._to_send = verdicts
        fleet.on_verdict = self._verdict_found
        pool.before_register = self.register

    # ------------------------------------------------------------------ Membership

    async def add(self, url: str, role: Role, slots: int, labels: dict[str, str]) -> Node:
        node = await self._register("set", Record(-1, role, url, slots, labels, source="admin"))
        if node is None:  # removed by another router in the meantime
            raise ValueError(f"{role} node {url} was removed meanwhile")
        return node

    async def drain(self, node: Node) -> None:
        await self._set_admin(node, "draining", "")

    async def remove(self, node: Node, force: bool, only_if: str = "") -> None:
        """Refused as in one process, and also while another router has requests on it;
        ``only_if``: and unless the fleet's admin state of it is that (its first word)."""
        if not force:
            if node.state in (State.SERVING, State.UNHEALTHY):
                raise ValueError(f"node {node.id} is {node.state.value}: drain it first")
            if node.bound:
                raise ValueError(f"node {node.id} still has {len(node.bound)} requests in flight")
            counts = await self.in_flight()
            elsewhere = sum(
                c.get(node.id, 0) for router, c in counts.items() if router != self.router_id
            )
            if elsewhere:
                raise ValueError(
                    f"node {node.id} still has {elsewhere} requests in flight on other routers"
                )
        # Checked above on what this router last heard: the removal applies only if the
        # fleet's state is still that (another router may have added it again since).
        record = self.records.get(node.id)
        seen = only_if or ("" if force or record is None else record.admin)
        await self._set_admin(node, "removed forced" if force else "removed", seen)

    async def in_flight(self) -> dict[str, dict[int, int]]:
        """Every live router's requests per node; this router's own as they are now (only
        those while Redis is away)."""
        by_router: dict[str, dict[int, int]] = {}
        reply = []
        if self.pool.available:  # else not even a timeout's wait
            with contextlib.suppress(StateUnavailable):
                reply = await self._run(_IN_FLIGHT, [])
        for router, pairs in zip(reply[::2], reply[1::2]):
            by_router[router.decode()] = _counts(pairs)
        by_router[self.router_id] = self._own_counts()
        return by_router

    def may_probe(self) -> bool:
        return self._prober

    # ------------------------------------------------------------------ DNS discovery

    async def discovered(
        self, url: str, role: Role, slots: int, labels: dict[str, str], source: str
    ) -> Node | None:
        """Registered if new (or removed): every router discovering the address agrees on
        its id; a known node is left as the fleet has it."""
        return await self._register("discover", Record(-1, role, url, slots, labels, source=source))

    async def gone(self, node: Node) -> None:
        await self._dns_admin(node, "serving", "draining gone")

    async def back(self, node: Node) -> bool:
        return await self._dns_admin(node, "draining gone", "serving")

    async def retire(self, node: Node, force: bool) -> None:
        # Still drained: a router that lists the address may have undone the drain since
        # this router last heard (a removal then would fail what runs on it everywhere).
        await self.remove(node, force, only_if="draining")

    def background(self) -> Background:
        work: Background = [
            ("the shared fleet's changes", self._listen_forever),
            ("the shared fleet's reconciliation", self._reconcile_forever),
            ("the shared fleet's verdicts", self._send_verdicts),
            ("the shared fleet's requests in flight", self._publish_in_flight),
        ]
        if self.probes:
            work.append(("the shared fleet's prober lease", self._prober_lease))
        return work

    # ------------------------------------------------------------------ registration, reload

    async def register(self) -> None:
        """Before the pool registers: this router's nodes get their ids, the fleet is read."""
        async with self._locked():
            await self._adopt()
            await self._sync()

    async def _adopt(self) -> None:
        if self._configured is None:
            return
        nodes = [node for node, _ in self._configured]
        args: list[str] = []
        for node in nodes:
            args += [node.role, node.url, Record.of(node).body().decode(), "serving", ""]
        ids, pruned = await self._nodes(["adopt", self.router_id, *args])
        # One id per role and URL, and no URL twice in a role (``Fleet``).
        for node, node_id, how in zip(nodes, ids, pruned):
            node.id = node_id
            if how:  # removed, and its record dropped since: ``_sync`` removes it here
                self.records[node_id] = _removed(Record.of(node), how)
                self._remember(self.records[node_id])
        self._flagged, self._configured = self._configured, None

    async def _put_back(self, missing: list[Record]) -> dict[tuple[Role, str], str]:
        """Redis lost these nodes (it restarted empty): written back, under their ids where
        nobody took them meanwhile (``apply`` follows any that changed); each that was
        removed and pruned instead, with its removal (``scripts.NODES``)."""
        args: list[str] = []
        for r in missing:
            args += [r.role, r.url, r.body().decode(), r.admin_value, str(r.id)]
        _, pruned = await self._nodes(["adopt", self.router_id, *args])
        told = {(r.role, r.url): how for r, how in zip(missing, pruned) if how}
        for r in missing:
            if how := told.get((r.role, r.url)):
                self._remember(_removed(r, how))
        return told

    def _remember(self, removed: Record) -> None:
        self._pruned.pop((removed.role, removed.url), None)
        self._pruned[removed.role, removed.url] = (removed.id, removed.forced)
        if len(self._pruned) > PRUNED_MEMORY:
            del self._pruned[next(iter(self._pruned))]

    def _remembered(self, known: set[tuple[Role, str]]) -> list[Record]:
        """The pruned removals remembered, but those of ``known`` nodes, as records (their
        slots and labels do not matter: an add writes its own)."""
        return [
            Record(node_id, role, url, 1, admin="removed", forced=forced)
            for (role, url), (node_id, forced) in self._pruned.items()
            if (role, url) not in known
        ]

    async def _sync(self) -> None:
        """Read the fleet and make the local one match (the lock held)."""
        records, verdicts = await self._read()
        if missing := _missing(self.records, records):
            pruned = await self._put_back(missing)
            if lost := [r for r in missing if (r.role, r.url) not in pruned]:
                log.warning("the shared state had lost %d nodes of the fleet: put back", len(lost))
                # The removals pruned before go back too: a router with such a URL in its
                # flags would find no record, and add it again.
                known = {(r.role, r.url) for r in (*missing, *self.records.values())}
                await self._put_back(self._remembered(known))
            records, verdicts = await self._read()
            for r in missing:
                how = pruned.get((r.role, r.url))
                # Removed (and pruned) while this router heard nothing, or still has
                # requests on it: the removal, applied while the node is here.
                if how and self.fleet.find(r.role, r.url) is not None:
                    records.setdefault(r.id, _removed(r, how))
        before, self.records = self.records, records
        apply(self.fleet, records, verdicts, self._unsent, self.probes, before)
        flagged, self._flagged = self._flagged, []
        for node, slots in flagged:
            if node.slots != slots and node in self.fleet.nodes:
                log.warning(
                    "%s node %s (%s): the shared fleet has %d slots, this router's flags %d; "
                    "the fleet's hold (POST /admin/nodes changes them)",
                    node.role, node.id, node.url, node.slots, slots,
                )  # fmt: skip

    async def _read(self) -> tuple[dict[int, Record], dict[int, Verdict]]:
        nodes, admin, health, incarnations = await self._run(_SNAPSHOT, [])
        states = dict(zip(admin[::2], admin[1::2]))
        added_again = dict(zip(incarnations[::2], incarnations[1::2]))
        records: dict[int, Record] = {}
        for key, body in zip(nodes[::2], nodes[1::2]):
            try:
                incarnation = int(added_again.get(key, 0))
                records[int(key)] = Record.parse(int(key), body, states.get(key), incarnation)
            except (ValueError, KeyError, TypeError) as exc:
                log.error("shared fleet: node %s unreadable, left as it is: %r", key, exc)
        verdicts: dict[int, Verdict] = {}
        for key, body in zip(health[::2], health[1::2]):
            try:
                verdicts[int(key)] = Verdict.parse(body)
            except (ValueError, KeyError, TypeError) as exc:
                log.error("shared fleet: verdict on node %s unreadable: %r", key, exc)
        return records, verdicts

    async def _register(self, how: str, record: Record) -> Node | None:
        """``record`` (its id is Redis's to give) written as ``how`` says (``NODES``)."""
        body = record.body().decode()
        async with self._locked():
            await self._adopt()
            args = [how, self.router_id, record.role, record.url, body, "serving", ""]
            (node_id,), _ = await self._nodes(args)
            await self._sync()
        return self.fleet.node(node_id)

    async def _dns_admin(self, node: Node, expected: str, state: str) -> bool:
        async with self._locked():
            await self._adopt()
            changed = await self._run(_DNS_ADMIN, [self.router_id, str(node.id), expected, state])
            await self._sync()
        return bool(changed)

    async def _set_admin(self, node: Node, state: str, seen: str) -> None:
        async with self._locked():
            await self._adopt()
            if not await self._run(_ADMIN, [self.router_id, str(node.id), state, seen]):
                await self._sync()
                # Most often another router's change; also this router's own earlier call
                # that Redis, paused, carried out after the caller had given up on it.
                raise Conflict(
                    f"node {node.id} changed in the shared fleet since this router last read "
                    "it (removed, or added again): see GET /admin/nodes"
                )
            await self._sync()

    # ------------------------------------------------------------------ verdicts found here

    def _verdict_found(self, node: Node) -> None:
        """The fleet found ``node`` dead, or back (synchronous: the fleet's hook)."""
        record = self.records.get(node.id)
        incarnation = "" if record is None else str(record.incarnation)
        self._unsent[node] = (Verdict.of(node, self.router_id), incarnation)
        self._found.send_nowait(node)
        if record is not None and record.admin == "draining":
            # Back from the dead, still drained (by an operator, or for DNS).
            self.fleet.drain(node, GONE if record.gone else "drained")

    async def _send_verdicts(self) -> None:
        async for node in self._to_send:
            while (unsent := self._unsent.get(node)) is not None:
                verdict, incarnation = unsent
                try:
                    async with self._locked():
                        await self._adopt()  # the node's id is the fleet's
                        body = verdict.body()
                        await self._run(_VERDICT, [self.router_id, str(node.id), body, incarnation])
                        if self._unsent.get(node) is unsent:
                            del self._unsent[node]
                    break
                except StateUnavailable:
                    await anyio.sleep(RETRY)

    # ------------------------------------------------------------------ background

    async def _listen_forever(self) -> None:
        while True:
            try:
                async with self.redis.subscribe(scripts.FLEET_CHANNEL) as subscription:
                    await self._reload()  # what changed while nobody listened
                    while True:
                        _, sender = await subscription.next_message()
                        if sender.decode() != self.router_id:
                            await self._reload()
            except (RedisUnavailable, RedisError, StateUnavailable):
                await anyio.sleep(RETRY)

    async def _reconcile_forever(self) -> None:
        while True:
            await anyio.sleep(RECONCILE)
            try:
                await self._reload()
                await self.prune()
            except StateUnavailable:
                pass  # the pool says so; the next round tries again

    async def prune(self) -> int:
        """Removed nodes' records kept long enough dropped (``scripts.PRUNE``): how many."""
        args = [str(int(self.kept * 1000)), str(PRUNE_BATCH), self.router_id]
        dropped: int = await self._run(_PRUNE, args)
        return dropped

    async def _reload(self) -> None:
        async with self._locked():
            if self._configured is None:  # else the pool's registration adopts first
                await self._sync()

    async def _prober_lease(self) -> None:
        """Be the fleet's prober while no other router is: one set of probes per fleet,
        whatever the number of routers and workers. The others hear its verdicts. A router
        stopping gives the lease up, so that another takes over within a third of the
        lease; one that dies keeps it until it lapses."""
        ms = str(int(self.pool.lease * 1000))
        try:
            while True:
                try:
                    prober = bool(await self._run(_PROBER, [self.router_id, ms]))
                except StateUnavailable:
                    prober = True  # its verdicts reach nobody now: it judges for itself
                if prober != self._prober:
                    log.info("router %s %s", self.router_id, _PROBING[prober])
                self._prober = prober
                await anyio.sleep(self.pool.lease / 3)
        finally:
            if self._prober:
                self._prober = False
                with anyio.CancelScope(shield=True), contextlib.suppress(StateUnavailable):
                    await self._run(_UNPROBE, [self.router_id])

    async def _publish_in_flight(self) -> None:
        ms = str(int(self.pool.lease * 1000))
        while True:
            counts = {node_id: n for node_id, n in self._own_counts().items() if n}
            now = anyio.current_time()
            if counts != self._published or now - self._published_at >= self.pool.lease / 3:
                pairs = [str(item) for pair in counts.items() for item in pair]
                try:
                    await self._run(_PUT_IN_FLIGHT, [self.router_id, ms, *pairs])
                    self._published, self._published_at = counts, now
                except StateUnavailable:
                    pass
            await anyio.sleep(IN_FLIGHT_EVERY)

    # ------------------------------------------------------------------ helpers

    def _own_counts(self) -> dict[int, int]:
        return {node.id: len(node.bound) for node in self.fleet.nodes}

    def _locked(self) -> anyio.Lock:
        if self._lock is None:
            self._lock = anyio.Lock()
        return self._lock

    async def _nodes(self, args: Sequence[str]) -> tuple[list[int], list[str]]:
        """``NODES``: the nodes' ids, and the removal of each pruned one ("" if not); what
        it found wrong logged."""
        ids, pruned, bad = await self._run(_NODES, args)
        SharedPool.noted(bad)
        return [int(node_id) for node_id in ids], [how.decode() for how in pruned]

    async def _run(self, script: Script, args: Sequence[str | bytes]) -> Any:
        try:
            return await script.run(self.redis, (), args)
        except RedisUnavailable as exc:
            raise StateUnavailable(f"shared state unavailable: {exc}") from None
        except RedisError as error:
            # Logged, never shown: an admin's answer carries no script's error text.
            log.error("shared fleet: redis %s answered: %s", self.redis.settings.address, error)
            raise answered(self.redis, error) from None


def _removed(record: Record, how: str) -> Record:
    """``record`` as removed: ``how`` is what ``{pdr}:admin`` said of it."""
    return replace(record, admin="removed", forced=how == "removed forced", gone=False)


def _missing(before: dict[int, Record], now: dict[int, Record]) -> list[Record]:
    """The records of ``before`` whose node (role and URL) ``now`` lacks."""
    known = {(r.role, r.url) for r in now.values()}
    return [r for r in before.values() if (r.role, r.url) not in known]


def _counts(pairs: list[bytes]) -> dict[int, int]:
    """A router's requests per node; a pair that is not (id, count) is logged and skipped."""
    counts: dict[int, int] = {}
    for key, value in zip(pairs[::2], pairs[1::2]):
        try:
            counts[int(key)] = int(value)
        except ValueError:
            log.error("shared fleet: requests in flight %r on node %r unreadable", value, key)
    return counts

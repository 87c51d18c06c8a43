"""The decode pool shared by every router process on one Redis (``--state``).

The decisions are ``shared/scripts.py``'s, run atomically by Redis; this module is the I/O
around them and the waiting, with the in-process pool's contract (``fleet/pool.py``) kept:

* ``acquire`` returns a reservation or raises having taken nothing. The script that takes
  a slot runs shielded: a cancellation that arrived meanwhile is delivered after the
  reservation is in hand, inside the ``try`` of ``reserve`` that releases it. A few such
  scripts run at a time per router; the acquisitions that come while they run go together
  in the next, in the order they came (``_asked``).
* A waiter is an entry in Redis's queue for its model, first come first served across
  routers; a burst on one model queues nobody asking for another. The script that frees a
  slot hands it to the oldest waiter among the models its node serves (this router says
  which, from its nodes' models and states: ``_takes``) and publishes it; this router's
  listener wakes the waiter. A waiter that times out or is cancelled leaves the queue in
  one script, which also says whether a slot reached it meanwhile: kept on a timeout (as
  the in-process pool does), given back on a cancellation.
* ``release`` is synchronous, as in-process, so that it is safe in a cancelled ``finally``:
  it queues the release, and the next acquisition carries it, in the same script, or else
  a worker sends it, again and again while Redis is away (the script is idempotent). Until
  then Redis counts the slot as used: never over the slots. A release waits up to
  ``HOLD`` seconds for an acquisition to carry it (one round trip per request instead of
  two; on asyncio by a loop timer, on trio in the worker) while no acquisition runs,
  unless slots may be short: a waiter of this router is
  queued, or the last acquisition found its node's last slot or someone waiting, in any
  queue, or was more than ``ROOM_FOR`` seconds ago (another router may have filled the
  pool since, and queued a waiter). A renewal carries the releases not sent yet too
  (else, held no more, they would be settled as calls given up on). A call that carried
  releases and failed, however, puts them back to be sent again.
* A router holds a lease, renewed every third of ``lease`` seconds. One that stops
  renewing (killed, partitioned) has its slots and queue entries returned by the next
  router to renew, within ``lease`` seconds. A router that finds its registration gone
  (Redis restarted empty, or its own lease ended) writes back what it holds.
* Redis away: new requests get 503 ``shared state unavailable`` and ``available`` is
  false (``/health`` says 503); requests in flight go on.
* A call given up on (a timeout, a lost connection, an error reply) may have run, or may
  run later: its outcome is unknown. Reservation ids are numbers, increasing; each
  renewal sends the floor (every lower id is settled: held, waiting, or given up) and the
  ids held or waiting, and Redis gives back or drops every other entry of this router
  below the floor, and refuses an acquire below it (``scripts``: "Unknown outcomes"). A
  failed call asks for a renewal at once, sent again until Redis takes it. The renewal
  also writes back the reservations held (with their nodes) and the queue entries that
  Redis lost (a failover to a replica that lacked them); releases and a waiter's
  leaving are not sent while a renewal runs, lest it write back what they just removed.
* What Redis holds is checked: the scripts repair bad values and say which (logged here
  at ERROR); a script that fails on the store's data (a key of the wrong type) has the
  store repaired (``REPAIR``), this router registered again and the call tried once more.
  A client never sees Redis's error text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from pd_router.errors import RouterError, StateUnavailable, Unavailable, fresh
from pd_router.fleet.nodes import Node, usable
from pd_router.fleet.pool import DecodePool, Reservation, Waiter
from pd_router.shared import scripts
from pd_router.shared.redis import (
    RETRY,
    Fits,
    Redis,
    RedisError,
    RedisUnavailable,
    Script,
    listed,
)

log = logging.getLogger("pd_router.shared_pool")

# Seconds a router's slots outlive it. Renewed every third of it: two renewals may fail
# (a slow Redis, a stalled loop) before the lease ends.
LEASE = 10.0
# Releases, and acquisitions, sent in one round trip at most (a script's arguments stay
# small, and one script does not keep Redis from the other routers for long).
RELEASE_BATCH = ACQUIRE_BATCH = 256
# Acquisition calls at once, at most; the requests that come while that many run wait for
# one of them to end and go together in the next. More than one, so that a call stuck on a
# connection the network stopped answering holds up only its own requests: at 64 clients
# four took as few calls as one did (1,322-1,380 scripts for 6,430 requests).
CALLS_AT_ONCE = 4
# Seconds a release waits for an acquisition to carry it, while slots are not short: one
# client's next request comes well within it.
HOLD = 0.005
# Seconds the last acquisition's word that slots are not short (its node had a slot left
# and nobody waited) is believed. Older, a release is sent at once: slots may be short by
# then, and a release held back would keep another router's waiter waiting.
ROOM_FOR = HOLD


def notes(bad: Any) -> bool:
    """Whether ``bad`` is what a script found bad in the store (``noted``): bytes, four to
    a note."""
    return isinstance(bad, list) and len(bad) % 4 == 0 and all(type(item) is bytes for item in bad)


def answered(redis: Redis, error: RedisError) -> StateUnavailable:
    """The 503 for an error reply: its code, never its text (which the caller logs)."""
    return StateUnavailable(
        f"shared state unavailable: redis {redis.settings.address} answered {error.code} "
        "(the router's log says more)"
    )


class ErrorReplies:
    """One caller's error replies, each logged once while it lasts (a call per request
    would repeat it per request), until a call succeeds (``cleared``)."""

    __slots__ = ("what", "last")

    def __init__(self, what: str) -> None:
        self.what = what
        self.last: str | None = None

    def answered(self, redis: Redis, error: RedisError) -> StateUnavailable:
        if error.what != self.last:
            self.last = error.what
            log.error("%s: redis %s answered: %s", self.what, redis.settings.address, error)
        return answered(redis, error)

    def cleared(self) -> None:
        self.last = None


def noting(*lengths: int) -> Fits:
    """A reply that is a list of one of ``lengths`` elements, the last the script's notes."""
    fits = listed(*lengths)
    return lambda reply: fits(reply) and notes(reply[-1])


_ACQUIRE = Script(scripts.ACQUIRE, noting(2), each=0)
_RELEASE = Script(scripts.RELEASE, noting(2))
_ABANDON = Script(scripts.ABANDON, noting(2, 3))
_RENEW = Script(scripts.RENEW, noting(5))
_REGISTER = Script(scripts.REGISTER, noting(2))
_REPAIR = Script(scripts.REPAIR, notes)
# Error replies that say Redis cannot serve now, not that the store holds bad data.
_TRANSIENT = frozenset(
    {"BUSY", "LOADING", "MASTERDOWN", "READONLY", "OOM", "TRYAGAIN", "CLUSTERDOWN",
     "NOREPLICAS", "MISCONF", "NOAUTH", "NOPERM", "WRONGPASS"}
)  # fmt: skip


class SharedReservation(Reservation):
    __slots__ = ("id",)

    def __init__(self, pool: SharedPool, node: Node, waited: float, reservation_id: str) -> None:
        super().__init__(pool, node, waited)
        self.id = reservation_id


class _Asked:
    """A request for a slot in an acquisition call (``SharedPool._asked``), and its answer:
    the script's reply, the call's error, or the requests this one is to send next."""

    __slots__ = ("request", "answered", "reply", "error", "lead")

    def __init__(self, request: list[str]) -> None:
        self.request = request
        self.answered: anyio.Event | None = None  # set once answered (a request that waits)
        self.reply: list[Any] | None = None
        self.error: BaseException | None = None
        self.lead: list[_Asked] | None = None

    def answer(self, reply: list[Any] | None = None, error: BaseException | None = None) -> None:
        self.reply, self.error = reply, error
        assert self.answered is not None  # nosec B101: a waiting request has one
        self.answered.set()


class SharedPool(DecodePool):
    def __init__(self, nodes: Sequence[Node], redis: Redis, lease: float = LEASE) -> None:
        super().__init__(nodes)
        self.redis = redis
        self.lease = lease
        self.router_id = secrets.token_hex(8)
        self.available = False
        self._held: dict[str, SharedReservation] = {}
        self._waiting: dict[str, Waiter] = {}
        # Those of them that are in Redis's queue (the others' scripts have not answered).
        self._queued: set[str] = set()
        # The last reservation id given, and those whose acquire has not answered yet.
        self._last_id = 0
        self._calling: set[int] = set()
        # Acquisition calls running (``_asked``), and the requests waiting for one to end.
        self._running = 0
        self._asking: list[_Asked] = []
        # Held by a renewal, a release and a waiter's leaving: a renewal writes back what
        # this router held when it was sent, so none of them may run between.
        self._settling = anyio.Lock()
        self._errors = ErrorReplies("shared state")
        # Run before each registration (a start, a lost lease, a Redis that lost its data):
        # the shared fleet adopts, or puts back, the nodes whose slots it writes.
        self.before_register: Callable[[], Awaitable[None]] | None = None
        # Releases not sent yet (reservation id, url), and a renewal asked for: the worker's.
        self._releases: list[tuple[str, str]] = []
        self._renew_asked = False
        self._ready: anyio.Event | None = None  # set when there is work for the worker
        self._carried: anyio.Event | None = None  # set when an acquisition took releases
        # On asyncio (the router's loop), releases are held back by a timer on the loop, set
        # by the first of them, and the worker is woken only when it is to send them: one
        # client's release then costs no task switch, no cancel scope, and, carried by the
        # next acquisition, no wake-up at all. On trio (tests) the worker holds them.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Until when the last acquisition's finding holds: a slot left on its node and
        # nobody waiting (``ROOM_FOR``).
        self._room_until = -math.inf
        # The scripts' lists of nodes as the fleet is now, made once (``refresh`` forgets
        # them): the nodes a request for a model may land on, and each node's entry (what
        # waiters it takes; none: it takes none).
        self._offers: dict[str | None, list[str]] = {}
        self._entries: dict[str, list[str] | None] = {}

    # ------------------------------------------------------------------ the pool's interface

    @property
    def queue_depth(self) -> int:
        return len(self._queued)

    def background(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        return [
            ("the shared state's lease", self._renew_forever),
            ("the shared state's grants", self._listen_forever),
            ("the shared state's releases", self._work),
        ]

    def refresh(self) -> None:
        super().refresh()
        self._offers.clear()
        self._entries.clear()

    def try_acquire(
        self, avoid: Node | None = None, model: str | None = None
    ) -> Reservation | None:
        return None  # every reservation is Redis's to grant: ``acquire_now``

    async def acquire_now(
        self, avoid: Node | None = None, model: str | None = None
    ) -> Reservation | None:
        reply = await self._acquire(self._new_id(), False, avoid, model)
        return reply if isinstance(reply, Reservation) else None

    async def acquire(self, timeout: float, model: str | None = None) -> Reservation:
        if not self.live_for(model):
            raise Unavailable(self.no_live(model))
        resid = self._new_id()
        started = anyio.current_time()
        # Known before Redis can hand it a slot: the listener may hear of the grant before
        # this task hears the script's own reply.
        waiter = self._waiting[resid] = Waiter(model)
        try:
            reply = await self._acquire(resid, timeout > 0, None, model)
            if isinstance(reply, Reservation):
                return reply
            if reply == "busy":
                raise self.busy(model)
            if reply != "queued":
                raise StateUnavailable(f"shared state unavailable: {reply} after registering")
            self._queued.add(resid)
            try:
                with anyio.move_on_after(timeout):
                    await waiter.event.wait()
                if waiter.node is None:
                    # Timed out, or told to fail: one script says if a slot came meanwhile.
                    waiter.node = await self._leave(resid, model) or waiter.node
            except BaseException:
                node = waiter.node or await self._leave(resid, model)
                if node is not None:
                    self._send(resid, node.url)
                raise
        finally:
            del self._waiting[resid]
            self._queued.discard(resid)
        waited = anyio.current_time() - started
        if waiter.error is not None:
            if waiter.node is not None:
                self._send(resid, waiter.node.url)
            raise fresh(waiter.error)
        if waiter.node is None:
            raise self.waited_out(model, waited)
        return self._hold(resid, waiter.node, waited)

    def wake(self) -> None:
        self._renew_asked = True
        if self._ready is not None:
            self._ready.set()
        self._hurry()

    def fail_waiters(self, error: RouterError) -> None:
        for waiter in self._waiting.values():
            if waiter.node is None and waiter.error is None:
                waiter.error = error
                waiter.event.set()

    def fail_stranded(self) -> None:
        for waiter in self._waiting.values():
            if waiter.node is None and waiter.error is None and not self.live_for(waiter.model):
                waiter.error = Unavailable(self.no_live(waiter.model))
                waiter.event.set()

    def _give_back(self, reservation: Reservation) -> None:
        """Synchronous, for a ``finally`` in a cancelled scope: Redis hears of it from the
        release worker."""
        self.released += 1
        reservation.node.in_use -= 1
        if isinstance(reservation, SharedReservation):
            self._held.pop(reservation.id, None)
            self._send(reservation.id, reservation.node.url)

    # ------------------------------------------------------------------ Redis

    async def _acquire(
        self, resid: str, may_queue: bool, avoid: Node | None, model: str | None
    ) -> Any:
        request = [resid, "1" if may_queue else "0", _key(model), *self._offer(avoid, model)]
        started = anyio.current_time()
        number = int(resid)
        self._calling.add(number)
        # Shielded: a reply lost to a cancellation would be a slot taken and never given back.
        try:
            with anyio.CancelScope(shield=True):
                reply, bad = await self._asked(request)
                if reply[0] in (b"unknown", b"stale"):
                    # Redis lost this router's registration, or the slots of a node (lost,
                    # or dropped as bad): the renewal writes them back.
                    await self._renew()
                    replies, _ = await self._call([_Asked(request)])
                    reply = replies[0]
                elif bad:
                    await self._renew()  # what Redis could not repair, before others read it
        except BaseException:
            # Whatever failed (Redis away, a hook of the registration, a bug): the script
            # may have run, or may still: settled by the renewal, asked for now.
            self.wake()
            raise
        finally:
            self._calling.discard(number)
        if reply[0] == b"ok" and reply[2] == 1:
            self._room_until = anyio.current_time() + ROOM_FOR
        else:
            self._room_until = -math.inf
            self._hurry()
        if reply[0] == b"ok":
            node = self._by_url(reply[1].decode())
            if node is None:  # removed here since
                self._send(resid, reply[1].decode())
                return "busy"
            return self._hold(resid, node, anyio.current_time() - started)
        return reply[0].decode()

    async def _asked(self, request: list[str]) -> tuple[list[Any], list[bytes]]:
        """The ACQUIRE script's reply to ``request``, and what the script found bad (told
        to one of the requests it answered).

        ``CALLS_AT_ONCE`` acquisition calls at a time: the requests that come while that
        many run wait, and go together in the next, sent by the first of them, in the order
        they came. A request that finds fewer running goes at once; under load one call
        answers many (64 clients kept all 16 connections busy with a call each, and Redis
        ran one script per request). Waiting adds no cancellation point: the request is
        shielded already, and each call is bounded by the client's timeout."""
        mine = _Asked(request)
        if self._running < CALLS_AT_ONCE:
            self._running += 1
            batch = [mine]
        else:
            mine.answered = anyio.Event()
            self._asking.append(mine)
            await mine.answered.wait()
            if mine.lead is None:
                if mine.error is not None:
                    raise fresh(mine.error)
                assert mine.reply is not None  # nosec B101: set with ``answered``
                return mine.reply, []
            batch = mine.lead
        try:
            replies, bad = await self._call(batch)
        except BaseException as exc:
            error = (
                exc
                if isinstance(exc, Exception)
                else StateUnavailable("shared state unavailable: the call was interrupted")
            )
            for other in batch[1:]:
                other.answer(error=error)
            raise
        finally:
            self._pass_on()
        for other, reply in zip(batch[1:], replies[1:]):
            other.answer(reply)
        return replies[0], bad

    def _pass_on(self) -> None:
        """A call ended: the requests waiting go next (``ACQUIRE_BATCH`` at most, the rest
        after the next call to end), sent by the first of them."""
        waiting = self._asking
        if not waiting:
            self._running -= 1
            return
        batch, self._asking = waiting[:ACQUIRE_BATCH], waiting[ACQUIRE_BATCH:]
        first = batch[0]
        first.lead = batch
        assert first.answered is not None  # nosec B101: a waiting request has one
        first.answered.set()

    async def _call(self, batch: list[_Asked]) -> tuple[list[Any], list[bytes]]:
        """One ACQUIRE call for ``batch``, carrying the releases waiting; those are put back
        if the call fails (a release runs once however often it is sent)."""
        args = [self.router_id, str(len(batch))]
        for asked in batch:
            args += asked.request
        carried = self._carry()
        try:
            try:
                arguments = [*args, *self._release_args(carried)]
                replies, bad = await self._run(_ACQUIRE, arguments, asked=len(batch))
            finally:
                if carried:
                    self._settling.release()
        except BaseException:
            self._releases[:0] = carried
            raise
        return replies, bad

    async def _leave(self, resid: str, model: str | None) -> Node | None:
        """Out of the queue; the node of the slot that reached the waiter meanwhile, if one did."""
        with anyio.CancelScope(shield=True):
            try:
                async with self._settling:
                    reply = await self._run(_ABANDON, [self.router_id, resid, _key(model)])
            except Unavailable:
                # The entry may stay: the renewal, asked for now, drops it or gives back
                # the slot handed to it.
                self.wake()
                return None
        if reply[0] != b"granted":
            return None
        node = self._by_url(reply[1].decode())
        if node is None:
            self._send(resid, reply[1].decode())
        return node

    def _hold(self, resid: str, node: Node, waited: float) -> SharedReservation:
        node.in_use += 1
        self.acquired += 1
        reservation = SharedReservation(self, node, waited, resid)
        self._held[resid] = reservation
        return reservation

    def _granted(self, resid: str, url: str) -> None:
        """A slot reached one of this router's waiters."""
        waiter = self._waiting.get(resid)
        node = self._by_url(url)
        if waiter is not None and waiter.node is None and waiter.error is None and node:
            waiter.node = node
            waiter.event.set()
        elif resid not in self._held and (waiter is None or waiter.node is None):
            self._send(resid, url)

    def _by_url(self, url: str) -> Node | None:
        return next((node for node in self.nodes if node.url == url), None)

    def _new_id(self) -> str:
        self._last_id += 1
        return str(self._last_id)

    def _floor(self) -> int:
        """The lowest reservation id whose acquire may still answer: every lower one is
        settled (held, waiting, or given up on)."""
        return min(self._calling, default=self._last_id + 1)

    async def _run(
        self, script: Script, args: Sequence[str], repair: bool = True, asked: int | None = None
    ) -> Any:
        """The script's reply, its notes on bad values logged; a failure on the store's
        data (not Redis being away) repairs the store, registers again and tries once more.
        A reply that is not the script's (``Script.run``) is Redis away: what ran is
        settled by the renewal the caller's failure asks for, as after a lost reply."""
        try:
            reply = await script.run(self.redis, (), args, asked)
        except RedisUnavailable as exc:
            self.available = False
            raise StateUnavailable(f"shared state unavailable: {exc}") from None
        except RedisError as error:
            if error.code in _TRANSIENT or not repair:
                self.available = False
                raise self._failed(error) from None
            self._failed(error)
            await self._repair()
            return await self._run(script, args, repair=False, asked=asked)
        self._errors.cleared()
        self.noted(reply if script is _REPAIR else reply[-1])
        return reply

    def _failed(self, error: RedisError) -> StateUnavailable:
        """Logged (once while it lasts); what the client is told names no script's error."""
        return self._errors.answered(self.redis, error)

    async def _repair(self) -> None:
        """Keys of a wrong type deleted, counts made again, what this router holds and
        who waits written back (as after a Redis that lost its data)."""
        await self._run(_REPAIR, [], repair=False)
        await self._register(repair=False)

    @staticmethod
    def noted(bad: Sequence[bytes]) -> None:
        """What a script found wrong in the store (and repaired), logged at ERROR."""
        for at in range(0, len(bad) - 3, 4):
            key, field, value, done = (item.decode(errors="replace") for item in bad[at : at + 4])
            where = f"{key} field {field!r}" if field else key
            log.error("shared state: %s held %r, not what it should: %s", where, value, done)

    async def _register(self, repair: bool = True) -> None:
        """Tell Redis what this router holds and who waits, with its lease: after a start,
        a lost lease, or a Redis that lost its data."""
        if self.before_register is not None:
            await self.before_register()
        held, queued = self._holding()
        args = [*self._lease_and_slots(), str(len(held) // 2), *held, *queued]
        await self._run(_REGISTER, args, repair)

    def _holding(self) -> tuple[list[str], list[str]]:
        """(id, url) of each reservation held, and (id, model) of each waiter in Redis's
        queue, oldest first (``_waiting`` is in arrival order): what Redis must know."""
        held = [item for r in self._held.values() for item in (r.id, r.node.url)]
        queued = [
            item
            for resid, waiter in self._waiting.items()
            if resid in self._queued and waiter.node is None
            for item in (resid, _key(waiter.model))
        ]
        return held, queued

    def _lease_and_slots(self) -> list[str]:
        slots = [item for node in self.nodes for item in (node.url, str(node.slots))]
        lease = str(int(self.lease * 1000))
        return [self.router_id, lease, str(self._floor()), str(len(self.nodes)), *slots]

    def _send(self, resid: str, url: str) -> None:
        """The reservation given back: by the next acquisition, or the worker."""
        self._releases.append((resid, url))
        if self._ready is None:
            return  # the worker has not started: it sends them when it does
        if self._loop is not None:
            if self._may_hold():
                if self._timer is None:  # else they go with those held back already
                    self._timer = self._loop.call_later(HOLD, self._hurry)
                return
            # Not to be held (an acquisition runs, slots may be short): those held back
            # go now too, as on trio, where the worker looks at ``_may_hold`` itself.
            self._hurry()
        self._ready.set()

    def _carry(self) -> list[tuple[str, str]]:
        """The releases waiting to be sent, taken for an acquisition to carry, holding the
        settling lock (as the worker does); none if it is taken (a renewal runs)."""
        if not self._releases:
            return []
        try:
            self._settling.acquire_nowait()
        except anyio.WouldBlock:
            return []
        carried = self._releases[:RELEASE_BATCH]
        del self._releases[:RELEASE_BATCH]
        self._hurry()  # wakes the worker only if some are left (more than a batch)
        return carried

    def _may_hold(self) -> bool:
        """Releases may wait for the next acquisition: no acquisition is running (one that
        runs holds the settling lock the next needs: under load, the worker sends at once),
        no renewal is asked for, and slots are not short (the last acquisition, at most
        ``ROOM_FOR`` seconds ago, found room; no waiter of this router is queued)."""
        return bool(
            self._releases
            and not self._renew_asked
            and not self._calling
            and not self._queued
            and anyio.current_time() < self._room_until
        )

    def _hurry(self) -> None:
        """The worker stops waiting for an acquisition to carry the releases: it sends those
        left now (none left: a call took them, and the worker sleeps on). Also the hold's
        timer, when it runs out."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            if self._releases and self._ready is not None:
                self._ready.set()
        if self._carried is not None:
            self._carried.set()

    def _release_args(self, releases: Sequence[tuple[str, str]]) -> list[str]:
        """The RELEASE script's arguments after the router: the released slots' nodes as
        they are now (whose waiters they take), and the reservation ids."""
        urls = {url for _, url in releases}
        nodes = [node for node in self.nodes if node.url in urls] if releases else []
        return [*self._takes(nodes), *(resid for resid, _ in releases)]

    # ------------------------------------------------------------------ background work

    async def _renew_forever(self) -> None:
        first = True
        while True:
            try:
                await self._renew()
                if not self.available:
                    log.info("shared state available (router %s)", self.router_id)
                self.available = True
            except Unavailable as exc:
                # Said when it starts, and at the first try: a Redis never reached (a wrong
                # URL, a certificate not trusted) is no less an error than one lost.
                if self.available or first:
                    log.error("shared state unavailable: %s", exc)
                self.available = False
            first = False
            await anyio.sleep(self.lease / 3)

    async def _listen_forever(self) -> None:
        channel = scripts.GRANTS + self.router_id
        while True:
            try:
                async with self.redis.subscribe(channel) as subscription:
                    # Grants published while nobody listened: ask about every waiter.
                    for resid in list(self._waiting):
                        url = await self.redis.call(
                            "HGET", scripts.RESERVATIONS + self.router_id, resid
                        )
                        if url is not None:
                            self._granted(resid, url.decode())
                    while True:
                        _, data = await subscription.next_message()
                        resid, _, url = data.decode(errors="replace").partition(" ")
                        if url:
                            self._granted(resid, url)
                        else:
                            log.error("shared state: %s carried %r, not a grant", channel, data)
            except (RedisUnavailable, RedisError):
                await anyio.sleep(RETRY)

    async def _work(self) -> None:
        """Send the releases (and renewals) queued since the last round trip, all at once:
        one at a time, releases fell behind acquisitions under load, and Redis counted
        slots long given back (729 counted with 64 requests in flight). While slots are not
        short, releases first wait ``HOLD`` seconds for an acquisition to carry them."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # trio: no loop timer, this task holds the releases back
            self._loop = None
        try:
            while True:
                if (not self._releases or self._timer is not None) and not self._renew_asked:
                    self._ready = anyio.Event()
                    await self._ready.wait()
                # On asyncio, ``_send`` decided to hold the releases back (the timer).
                if self._loop is None and self._may_hold():
                    self._carried = anyio.Event()
                    with anyio.move_on_after(HOLD):
                        await self._carried.wait()
                    self._carried = None
                renew, self._renew_asked = self._renew_asked, False
                try:
                    if renew:
                        await self._renew()  # which carries the releases
                    elif self._releases:  # (none: carried; the lock stays free to carry more)
                        await self._release()
                except Unavailable:
                    self._renew_asked |= renew
                    await anyio.sleep(RETRY)
        finally:
            # Stopping: releases from now on are not held (the loop may be closing).
            self._loop = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._releases:
                # Stopping: what a request gave back while its release waited is sent once,
                # briefly, rather than held in Redis until this router's lease ends.
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    with contextlib.suppress(Unavailable):
                        while self._releases:
                            await self._release()

    async def _release(self) -> None:
        """The releases waiting (a batch of them) sent, or put back if the call fails: a
        release runs once however often it is sent. Taken under the settling lock, which a
        renewal holds while it carries them."""
        async with self._settling:
            releases = self._releases[:RELEASE_BATCH]
            del self._releases[:RELEASE_BATCH]
            if not releases:  # carried meanwhile
                return
            try:
                await self._run(_RELEASE, [self.router_id, *self._release_args(releases)])
            except BaseException:
                self._releases[:0] = releases
                raise

    def _offer(self, avoid: Node | None, model: str | None) -> list[str]:
        """The nodes a request for ``model`` may land on, but ``avoid``, as the scripts'
        list (``_takes``)."""
        offer = self._offers.get(model) if avoid is None else None
        if offer is None:
            accept = self.accept(model)
            nodes = [
                node
                for node in self.nodes
                if node.state in accept and node is not avoid and node.serves(model)
            ]
            offer = self._takes(nodes)
            if avoid is None:
                self._offers[model] = offer
        return offer

    def _takes(self, nodes: Sequence[Node]) -> list[str]:
        """Those of ``nodes`` that take waiters now and which each takes, for the scripts (a
        list of nodes: ``shared_scripts``). As in-process (``DecodePool._first_for``), a
        node takes a waiter for a model it serves while its state is one that model
        accepts; a slot freed on a node left out goes back to it."""
        out: list[str] = []
        count = 0
        for node in nodes:
            if node.url not in self._entries:
                self._entries[node.url] = self._entry(node)
            entry = self._entries[node.url]
            if entry is not None:
                out += entry
                count += 1
        return [str(count), *out]

    def _entry(self, node: Node) -> list[str] | None:
        """``node``'s entry in a list of nodes, or None if it takes no waiter."""
        plus, models = self._models_taken(node)
        if plus and not models:
            return None
        return [node.url, "+" if plus else "-", str(len(models)), *models]

    def _models_taken(self, node: Node) -> tuple[bool, list[str]]:
        """(True, the models whose waiters ``node`` takes) or (False, the models whose
        waiters it does not take: it takes every other); "" for the waiters that asked for
        no model."""
        if node.state in self.usable:  # in every model's ``accept``: its models, all of them
            if node.models is None:
                return False, []
            return True, ["", *sorted(node.models)]
        # Usable only for the models that no serving node serves: ``accept`` says which.
        known = {model for other in self.nodes for model in other.models or ()}
        served = sorted(known if node.models is None else node.models)
        taken = [model for model in served if node.state in self.accept(model)]
        if node.models is not None or node.state not in usable(
            [other for other in self.nodes if other.models is None]
        ):
            return True, taken
        # Any model no node names: the nodes that serve it are those whose models are unknown.
        return False, ["", *sorted(set(served) - set(taken))]

    async def _renew(self) -> None:
        async with self._settling:
            # The releases not sent yet go with it, given back as releases: else, held no
            # more and below the floor, they would be settled as calls given up on.
            releases, self._releases = self._releases, []
            self._hurry()
            held, queued = self._holding()
            others = [resid for resid in self._waiting if resid not in queued[::2]]
            args = [*self._lease_and_slots(), *self._takes(self.nodes)]
            args += [str(len(held) // 2), *held, str(len(queued) // 2), *queued]
            args += [str(len(others)), *others, *(resid for resid, _ in releases)]
            try:
                known, reclaimed, settled, restored, _ = await self._run(_RENEW, args)
            except BaseException:
                self._releases[:0] = releases
                raise
            if not known:
                # Nothing was done: sent again once registered (were the registration alone
                # lost, Redis may still hold them).
                self._releases[:0] = releases
                await self._register()
        if restored:
            log.warning(
                "wrote back %d reservations and queue entries that redis had lost "
                "(a failover to a replica that had not received them?)",
                restored,
            )
        if reclaimed:
            log.warning("gave back %d slots of routers whose lease ended", reclaimed)
        if settled:
            log.warning(
                "gave back %d reservations and queue entries left by calls this router "
                "gave up on (their replies lost or late)",
                settled,
            )


def _key(model: str | None) -> str:
    """The model as the scripts name it: "" for none asked (a model id is never empty)."""
    return "" if model is None else model

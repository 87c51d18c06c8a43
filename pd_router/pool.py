"""The decode pool: slots per decode node, a FIFO of waiters, reserve and release.

A decode node holds one sequence per slot for as long as the response streams, so the
router reserves a slot before prefill and keeps it until the request ends.

Concurrency contract (the pool does no I/O and runs on one event loop, asyncio or trio):

* Every state change is synchronous: no ``await`` sits between reading and writing the
  counters, so the event loop itself guards them and no lock is needed. ``release`` in
  particular never awaits, so it is safe in a ``finally`` that runs inside a cancelled
  scope (an ``async with lock`` there would raise before taking the lock and leak).
* ``acquire`` is atomic under cancellation. A free slot is taken without a checkpoint. A
  waiter is handed its slot directly by ``release`` (the slot never becomes free in
  between, so a newcomer cannot overtake: first come, first served). If the waiter is
  cancelled or times out, it leaves the queue at once; if a slot had already been handed
  to it, it passes the slot on to the next waiter before the cancellation propagates. So
  ``acquire`` either returns a reservation or raises having taken nothing, and no wake-up
  is lost.
* ``reserve`` puts the reservation inside the ``try`` that releases it, with no
  checkpoint in between (a cancellation is delivered only at a checkpoint: an ``await``
  between taking and guarding the slot is where the reference change leaked).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio

from .errors import Busy, QueueTimeout, RouterError, Unavailable, fresh
from .nodes import Node, usable


class Reservation:
    """One slot on one node. Released exactly once, however often ``release`` is called."""

    __slots__ = ("node", "waited", "_pool")

    def __init__(self, pool: DecodePool, node: Node, waited: float) -> None:
        self.node = node
        self.waited = waited
        self._pool: DecodePool | None = pool

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self)


class Waiter:
    __slots__ = ("event", "node", "error")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.node: Node | None = None
        self.error: RouterError | None = None


class DecodePool:
    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = list(nodes)
        # The states a new request may land on (``nodes.usable``); the fleet refreshes it.
        self.usable = usable(self.nodes)
        self._waiters: deque[Waiter] = deque()
        self._next = 0
        self.acquired = 0
        self.released = 0

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    @property
    def in_use(self) -> int:
        return sum(node.in_use for node in self.nodes)

    @property
    def capacity(self) -> int:
        """Slots on the nodes that take new requests."""
        return sum(node.slots for node in self.nodes if node.state in self.usable)

    @property
    def live(self) -> bool:
        """Some node takes new requests (when its slots free up)."""
        return any(node.state in self.usable for node in self.nodes)

    # Whether new requests can be served at all (the shared pool's store may be away).
    available = True

    def background(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """Work that lives as long as the app (named, for its supervisor): none here."""
        return []

    async def acquire_now(self, avoid: Node | None = None) -> Reservation | None:
        """``try_acquire`` for a pool that may need I/O to answer."""
        return self.try_acquire(avoid)

    def refresh(self) -> None:
        """A node's state changed, or nodes came or went."""
        self.usable = usable(self.nodes)

    def try_acquire(self, avoid: Node | None = None) -> Reservation | None:
        """A slot now, on any node but ``avoid``, or None. Never overtakes a waiter."""
        if self._waiters:
            return None
        node = self._pick(avoid)
        if node is None:
            return None
        node.in_use += 1
        self.acquired += 1
        return Reservation(self, node, 0.0)

    async def acquire(self, timeout: float) -> Reservation:
        """A slot, waiting up to ``timeout`` seconds for one (0: fail fast).

        Raises ``Busy`` when none came in time. See the module docstring for what a
        cancellation does.
        """
        reservation = self.try_acquire()
        if reservation is not None:
            return reservation
        if not self.live:
            raise Unavailable("no live decode node")
        if timeout <= 0:
            raise Busy("all decode nodes busy")
        waiter = Waiter()
        self._waiters.append(waiter)
        started = anyio.current_time()
        try:
            with anyio.move_on_after(timeout):
                await waiter.event.wait()
        except BaseException:
            self._abandon(waiter)
            raise
        waited = anyio.current_time() - started
        if waiter.error is not None:
            raise fresh(waiter.error)  # one error may tell every waiter
        if waiter.node is None:
            # Timed out; a hand-off that raced with the deadline is kept, not wasted.
            self._waiters.remove(waiter)
            raise QueueTimeout(f"no decode node free after waiting {waited:.1f}s")
        self.acquired += 1
        return Reservation(self, waiter.node, waited)

    @asynccontextmanager
    async def reserve(self, timeout: float) -> AsyncIterator[Reservation]:
        reservation = await self.acquire(timeout)
        try:
            yield reservation
        finally:
            reservation.release()

    def wake(self) -> None:
        """Slots may have appeared (a node was added or readmitted): serve waiters, oldest
        first."""
        while self._waiters:
            node = self._pick()
            if node is None:
                return
            node.in_use += 1
            self._grant(self._waiters.popleft(), node)

    def fail_waiters(self, error: RouterError) -> None:
        """Tell every waiter at once, e.g. when no live decode node is left."""
        while self._waiters:
            waiter = self._waiters.popleft()
            waiter.error = error
            waiter.event.set()

    def _pick(self, avoid: Node | None = None) -> Node | None:
        """The usable node with the most free slots; ties go round robin to spread load."""
        best: Node | None = None
        count = len(self.nodes)
        accept = self.usable
        for offset in range(count):
            node = self.nodes[(self._next + offset) % count]
            if node is avoid or node.state not in accept or node.free <= 0:
                continue
            if best is None or node.free > best.free:
                best = node
        if best is not None:
            self._next = (self.nodes.index(best) + 1) % count
        return best

    def _give_back(self, reservation: Reservation) -> None:
        self.released += 1
        self._hand_over(reservation.node)

    def _hand_over(self, node: Node) -> None:
        """A slot on ``node`` is done with: to the first waiter, else back to the node."""
        if self._waiters and node.state in self.usable:
            self._grant(self._waiters.popleft(), node)
        else:
            node.in_use -= 1

    @staticmethod
    def _grant(waiter: Waiter, node: Node) -> None:
        waiter.node = node
        waiter.event.set()

    def _abandon(self, waiter: Waiter) -> None:
        if waiter.node is not None:
            self._hand_over(waiter.node)
        elif waiter.error is None:
            self._waiters.remove(waiter)

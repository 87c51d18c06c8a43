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

How this relates to the reference design's ``Condition``-guarded pool (threads in a thread
pool block on a ``Condition``; ``release`` calls ``notify`` once; the woken waiter re-scans
every node in a ``while`` loop, so no wake-up is lost): what it guarantees is kept, the
mechanism is not. Kept: no lost wake-up, the reservation landing inside the ``try`` that
releases it, acquisition shielded from a client's cancellation. Instead of a notified
waiter re-scanning, ``release`` hands the slot straight to the oldest waiter on the event
loop. Why: a woken thread competes with every newcomer for the freed slot (a ``Condition``
promises no order, so a burst can starve its oldest member), each wake-up costs a thread
switch and an O(nodes) scan, and on one event loop nothing can run between the release and
the hand-over, so there is no window to guard. The shield is in ``acquire`` itself (a
handed slot is passed on, not dropped, when its waiter is cancelled), so callers need none.

Model pools: a request asks for a ``model`` and lands only on a node that serves it
(``Node.serves``). Each model has its own FIFO of waiters, so a burst on one model queues
nobody asking for another; a freed slot goes to the oldest waiter among the models its node
serves. "No live node" and the unhealthy-node fallback (``nodes.usable``) are decided per
model too, over the nodes that serve it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio

from pd_router.errors import Busy, QueueTimeout, RouterError, Unavailable, fresh
from pd_router.fleet.nodes import Node, State, usable, usable_for


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
    __slots__ = ("event", "node", "error", "model", "seq")

    def __init__(self, model: str | None = None, seq: int = 0) -> None:
        self.event = anyio.Event()
        self.node: Node | None = None
        self.error: RouterError | None = None
        self.model = model
        # Arrival order across the models' queues.
        self.seq = seq


class DecodePool:
    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = list(nodes)
        # The states a new request may land on (``nodes.usable``); the fleet refreshes it.
        self.usable = usable(self.nodes)
        self._accepts: dict[str, tuple[State, ...]] = {}
        # One FIFO per model asked for (None: any model); empty ones are dropped.
        self._queues: dict[str | None, deque[Waiter]] = {}
        self._arrivals = itertools.count()
        self._next = 0
        self.acquired = 0
        self.released = 0

    @property
    def queue_depth(self) -> int:
        return sum(map(len, self._queues.values()))

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

    def live_for(self, model: str | None) -> bool:
        """Some node serving ``model`` takes new requests (when its slots free up)."""
        accept = self.accept(model)
        return any(node.state in accept and node.serves(model) for node in self.nodes)

    def no_live(self, model: str | None) -> str:
        """What a request for ``model`` is told when no node takes it: the model is named
        when it is why (some node does not serve it)."""
        named = self._reason(model)
        return "no live decode node" if named is None else f"no live decode node serves {named}"

    def busy(self, model: str | None) -> Busy:
        """No slot free now (fail fast), the model named when it is why."""
        named = self._reason(model)
        return Busy(
            "all decode nodes busy" if named is None else f"all decode nodes serving {named} busy"
        )

    def waited_out(self, model: str | None, waited: float) -> QueueTimeout:
        """No slot came free in ``waited`` seconds, the model named when it is why."""
        named = self._reason(model)
        nodes = "decode node" if named is None else f"decode node serving {named}"
        return QueueTimeout(f"no {nodes} free after waiting {waited:.1f}s")

    def _reason(self, model: str | None) -> str | None:
        """``model``, quoted, when it is why a request is refused: some node does not serve it
        (a fleet serving one model keeps the messages that do not name it)."""
        if model is None or all(node.serves(model) for node in self.nodes):
            return None
        return repr(model)

    def accept(self, model: str | None) -> tuple[State, ...]:
        """The states a request for ``model`` may land on: ``usable`` over its nodes."""
        return self.usable if model is None else usable_for(self.nodes, model, self._accepts)

    # Whether new requests can be served at all (the shared pool's store may be away).
    available = True

    def background(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """Work that lives as long as the app (named, for its supervisor): none here."""
        return []

    async def acquire_now(
        self, avoid: Node | None = None, model: str | None = None
    ) -> Reservation | None:
        """``try_acquire`` for a pool that may need I/O to answer."""
        return self.try_acquire(avoid, model)

    def refresh(self) -> None:
        """A node's state or models changed, or nodes came or went."""
        self.usable = usable(self.nodes)
        self._accepts.clear()

    def try_acquire(
        self, avoid: Node | None = None, model: str | None = None
    ) -> Reservation | None:
        """A slot now on a node serving ``model``, not ``avoid``, or None. Never overtakes a
        waiter that node could serve."""
        node = self._pick(model, avoid)
        if node is None or (self._queues and self._first_for(node) is not None):
            return None
        node.in_use += 1
        self.acquired += 1
        return Reservation(self, node, 0.0)

    async def acquire(self, timeout: float, model: str | None = None) -> Reservation:
        """A slot on a node serving ``model``, waiting up to ``timeout`` seconds for one (0:
        fail fast).

        Raises ``Busy`` when none came in time. See the module docstring for what a
        cancellation does.
        """
        reservation = self.try_acquire(model=model)
        if reservation is not None:
            return reservation
        if not self.live_for(model):
            raise Unavailable(self.no_live(model))
        if timeout <= 0:
            raise self.busy(model)
        waiter = Waiter(model, next(self._arrivals))
        self._queues.setdefault(model, deque()).append(waiter)
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
            self._dequeue(waiter)
            raise self.waited_out(model, waited)
        self.acquired += 1
        return Reservation(self, waiter.node, waited)

    @asynccontextmanager
    async def reserve(self, timeout: float, model: str | None = None) -> AsyncIterator[Reservation]:
        reservation = await self.acquire(timeout, model)
        try:
            yield reservation
        finally:
            reservation.release()

    def wake(self) -> None:
        """Slots may have appeared (a node was added or readmitted): serve waiters, oldest
        first within each model, the models with the oldest waiters first."""
        for model in sorted(self._queues, key=lambda model: self._queues[model][0].seq):
            queue = self._queues[model]
            while queue:
                node = self._pick(model)
                if node is None:
                    break
                node.in_use += 1
                self._grant(queue.popleft(), node)
            if not queue:
                del self._queues[model]

    def fail_waiters(self, error: RouterError) -> None:
        """Tell every waiter at once, e.g. when the router shuts down."""
        for model in list(self._queues):
            self._fail_queue(model, error)

    def fail_stranded(self) -> None:
        """Tell the waiters of each model that no live node serves any more."""
        for model in [model for model in self._queues if not self.live_for(model)]:
            self._fail_queue(model, Unavailable(self.no_live(model)))

    def _fail_queue(self, model: str | None, error: RouterError) -> None:
        for waiter in self._queues.pop(model):
            waiter.error = error
            waiter.event.set()

    def _pick(self, model: str | None, avoid: Node | None = None) -> Node | None:
        """The usable node serving ``model`` with the most free slots; ties go round robin
        to spread load."""
        best: Node | None = None
        count = len(self.nodes)
        accept = self.accept(model)
        for offset in range(count):
            node = self.nodes[(self._next + offset) % count]
            if node is avoid or node.state not in accept or node.free <= 0:
                continue
            if (best is None or node.free > best.free) and node.serves(model):
                best = node
        if best is not None:
            self._next = (self.nodes.index(best) + 1) % count
        return best

    def _first_for(self, node: Node) -> Waiter | None:
        """The oldest waiter ``node`` may serve now, if any."""
        first: Waiter | None = None
        for model, queue in self._queues.items():
            head = queue[0]
            if (first is None or head.seq < first.seq) and node.serves(model):
                if node.serving or node.state in self.accept(model):
                    first = head
        return first

    def _give_back(self, reservation: Reservation) -> None:
        self.released += 1
        self._hand_over(reservation.node)

    def _hand_over(self, node: Node) -> None:
        """A slot on ``node`` is done with: to the oldest waiter it serves, else back to the
        node."""
        waiter = self._first_for(node) if self._queues else None
        if waiter is None:
            node.in_use -= 1
            return
        self._dequeue(waiter)
        self._grant(waiter, node)

    @staticmethod
    def _grant(waiter: Waiter, node: Node) -> None:
        waiter.node = node
        waiter.event.set()

    def _dequeue(self, waiter: Waiter) -> None:
        queue = self._queues[waiter.model]
        queue.remove(waiter)
        if not queue:
            del self._queues[waiter.model]

    def _abandon(self, waiter: Waiter) -> None:
        if waiter.node is not None:
            self._hand_over(waiter.node)
        elif waiter.error is None:
            self._dequeue(waiter)

"""The shared decode pool (``shared/pool.py``) on a real redis-server, several "routers" (one
pool each, as each router process has) in one event loop, under asyncio and trio.

What the in-process pool guarantees must hold across them: no node over its slots, one
first-come-first-served queue, a reservation given back exactly once, a waiter that leaves
taking nothing; and what only a shared pool needs: a router that stops renewing its lease
gives its slots back, and a Redis that restarted empty gets back what the routers hold.
Model pools too: one queue per model, so a burst on one model queues nobody asking for
another, and a freed slot goes to the oldest waiter its node serves.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from pd_router.errors import Busy, QueueTimeout, ShuttingDown, Unavailable
from pd_router.fleet.nodes import State, make_nodes
from pd_router.fleet.pool import Reservation
from pd_router.shared import pool as shared_pool
from pd_router.shared.pool import SharedPool
from pd_router.shared.redis import Redis, parse_url
from tests.redis_server import RedisServer

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:9001"
USED = "{pdr}:used"
# Model pools: a node serving only model a, one serving only b, one serving both.
A_URL, B_URL, AB_URL = "http://127.0.0.1:9011", "http://127.0.0.1:9012", "http://127.0.0.1:9013"
Models = dict[str, frozenset[str] | None]
TWO: Models = {A_URL: frozenset({"a"}), B_URL: frozenset({"b"})}


@asynccontextmanager
async def router(
    server: RedisServer, slots: int = 1, lease: float = 10.0, models: Models | None = None
) -> AsyncIterator[SharedPool]:
    """One router's pool, its background work running, registered with Redis; ``models``:
    its nodes and the models each serves (default: one node, ``URL``, serving any)."""
    models = models or {URL: None}
    nodes = make_nodes(list(models), slots)
    for node in nodes:
        node.models = models[node.url]
    pool = SharedPool(nodes, Redis(parse_url(server.url), timeout=1.0), lease)
    async with anyio.create_task_group() as tg:
        for _, work in pool.background():
            tg.start_soon(work)
        await until(lambda: pool.available)
        try:
            yield pool
        finally:
            tg.cancel_scope.cancel()
    await pool.redis.aclose()


async def until(check: Callable[[], bool], seconds: float = 5.0) -> None:
    with anyio.fail_after(seconds):
        while not check():
            await anyio.sleep(0.01)


async def used(redis: Redis, url: str = URL) -> int:
    value = await redis.call("HGET", USED, url)
    return int(value or 0)


async def until_used(redis: Redis, count: int, seconds: float = 5.0, url: str = URL) -> None:
    with anyio.fail_after(seconds):
        while await used(redis, url) != count:
            await anyio.sleep(0.01)


class Waiters:
    """Waiters started one at a time, each in Redis's queue before the next starts; the
    reservation each got, and in which order."""

    def __init__(self, tg: TaskGroup) -> None:
        self.tg = tg
        self.got: dict[str, Reservation] = {}
        self.order: list[str] = []

    async def add(self, pool: SharedPool, name: str, model: str | None) -> None:
        depth = pool.queue_depth
        self.tg.start_soon(self._wait, pool, name, model)
        await until(lambda: pool.queue_depth > depth)  # Redis answered "queued"

    async def _wait(self, pool: SharedPool, name: str, model: str | None) -> None:
        reservation = await pool.acquire(10, model)
        self.got[name] = reservation
        self.order.append(name)

    async def hand(self, free: Callable[[], None], name: str, url: str) -> None:
        """``free`` a slot (a release, a wake): ``name``, and nobody else, is served next, on
        ``url``, at once, by the script that ran (a renewal, which would hand it out too, is
        3 s away)."""
        expected = [*self.order, name]
        free()
        await until(lambda: len(self.order) >= len(expected), seconds=2)
        await anyio.sleep(0.1)  # nobody else is served meanwhile
        assert self.order == expected
        assert self.got[name].node.url == url

    def release(self) -> None:
        for reservation in self.got.values():
            reservation.release()


@asynccontextmanager
async def two_routers(
    server: RedisServer, models: Models = TWO
) -> AsyncIterator[tuple[SharedPool, SharedPool]]:
    async with router(server, models=models) as x, router(server, models=models) as y:
        yield x, y


@asynccontextmanager
async def waiting(redis: Redis, *urls: str) -> AsyncIterator[Waiters]:
    """Waiters for the block; after it, what they got given back and ``urls`` all free."""
    async with anyio.create_task_group() as tg:
        waiters = Waiters(tg)
        yield waiters
        waiters.release()
    for url in urls:
        await until_used(redis, 0, url=url)


async def test_a_redis_never_reached_is_said_at_error(caplog: pytest.LogCaptureFixture) -> None:
    """Not only a Redis lost once reached: one never reached (a wrong URL, a certificate not
    trusted) left only INFO lines, and a router at --log-level warning said nothing while
    every request got a 503."""
    caplog.set_level(logging.ERROR)
    pool = SharedPool(make_nodes([URL], 1), Redis(parse_url("redis://127.0.0.1:9"), timeout=0.5))
    async with anyio.create_task_group() as tg:
        for _, work in pool.background():
            tg.start_soon(work)
        await until(
            lambda: any(
                r.levelno == logging.ERROR and "shared state unavailable" in r.getMessage()
                for r in caplog.records
            )
        )
        assert not pool.available
        tg.cancel_scope.cancel()
    await pool.redis.aclose()


async def test_a_node_never_holds_more_than_its_slots_across_routers(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server) as a, router(redis_server) as b:
        held = await a.acquire(0)
        with pytest.raises(Busy):
            await b.acquire(0)
        assert await used(redis) == 1
        held.release()
        await until_used(redis, 0)
        again = await b.acquire(0)
        assert again.node.url == URL
        again.release()
        await until_used(redis, 0)


async def test_a_slot_given_back_is_there_for_the_routers_next_request_at_once(
    redis_server: RedisServer, redis: Redis
) -> None:
    """The router's next acquisition carries the releases not sent yet and gives them back
    first: one client on a one-slot pool, each request sent as the last one ends, never
    gets a 429 for the slot it just gave back (sent apart, the release could come second).
    A renewal holds the settling lock for its round trip, and a release then goes apart:
    the lease is long enough that none runs during these 20, however slow the machine."""
    async with router(redis_server, lease=600.0) as a:
        for _ in range(20):
            held = await a.acquire(0)
            held.release()
        await until_used(redis, 0)


async def test_one_clients_requests_take_equally_free_nodes_in_turn(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Ties between equally free nodes go in turn (``{pdr}:rr``), as in-process: one client's
    requests, each given back before the next, do not all land on the node listed first."""
    async with router(redis_server, slots=4, models={A_URL: None, B_URL: None}) as a:
        nodes: list[str] = []
        for _ in range(8):
            held = await a.acquire(0)
            nodes.append(held.node.url)
            held.release()
        assert min(nodes.count(A_URL), nodes.count(B_URL)) >= 2, nodes
        await until_used(redis, 0, url=A_URL)
        await until_used(redis, 0, url=B_URL)


async def test_waiters_are_served_first_come_first_served_across_routers(
    redis_server: RedisServer, redis: Redis
) -> None:
    served: list[str] = []

    async def wait(pool: SharedPool, name: str) -> None:
        reservation = await pool.acquire(10)
        served.append(name)
        await anyio.sleep(0.05)
        reservation.release()

    async with router(redis_server) as a, router(redis_server) as b, router(redis_server) as c:
        held = await a.acquire(0)
        async with anyio.create_task_group() as tg:
            for pool, name in [(b, "b1"), (c, "c1"), (a, "a2"), (b, "b2")]:
                tg.start_soon(wait, pool, name)
                await until(lambda p=pool: p.queue_depth > 0)
                await anyio.sleep(0.02)  # its script has run: it is in Redis's queue
            held.release()
        assert served == ["b1", "c1", "a2", "b2"]
        await until_used(redis, 0)


async def test_a_waiter_that_leaves_takes_nothing_and_the_next_is_served(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server) as a, router(redis_server) as b:
        held = await a.acquire(0)
        with anyio.move_on_after(0.2):
            await b.acquire(10)  # cancelled while queued
        with pytest.raises(QueueTimeout):
            await b.acquire(0.2)  # timed out
        got: list[Reservation] = []

        async def wait() -> None:
            got.append(await a.acquire(10))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await until(lambda: a.queue_depth == 1)
            await anyio.sleep(0.05)
            held.release()
        assert await used(redis) == 1, "the leavers took nothing"
        got[0].release()
        await until_used(redis, 0)
        assert b.queue_depth == 0 and a.queue_depth == 0


async def test_a_reservation_is_given_back_once_however_often_it_is_released(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server, slots=2) as a:
        first, second = await a.acquire(0), await a.acquire(0)
        assert await used(redis) == 2
        for _ in range(3):
            first.release()
        await until_used(redis, 1)
        await anyio.sleep(0.1)
        assert await used(redis) == 1
        second.release()
        await until_used(redis, 0)


async def test_a_router_that_stops_renewing_gives_its_slots_back_within_the_lease(
    redis_server: RedisServer, redis: Redis
) -> None:
    lease = 1.0
    async with router(redis_server, lease=lease) as survivor:
        async with router(redis_server, lease=lease) as doomed:
            await doomed.acquire(0)  # never released: the router "dies" holding it
        # (leaving the block stopped its lease renewals, as a SIGKILL would)
        started = anyio.current_time()
        reservation = await survivor.acquire(3 * lease)
        assert anyio.current_time() - started <= 2 * lease
        reservation.release()
        await until_used(redis, 0)


async def test_redis_away_is_a_503_and_what_is_held_is_written_back_when_it_returns(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server, lease=1.0) as a:
        held = await a.acquire(0)
        redis_server.kill()
        with anyio.fail_after(3):
            with pytest.raises(Unavailable) as caught:
                await a.acquire(0)
        assert caught.value.status == 503 and "shared state unavailable" in caught.value.message
        await until(lambda: not a.available)
        redis_server.start()  # same port, no data: as a Redis restart that lost everything
        await until(lambda: a.available, seconds=10)
        await until_used(redis, 1)  # the reservation in flight, counted again
        held.release()
        await until_used(redis, 0)


async def acquisition_calls(redis: Redis) -> int:
    """The acquisition scripts Redis ran so far (every script the pool runs is an EVALSHA)."""
    stats = await redis.call("INFO", "commandstats")
    line = next(x for x in stats.decode().splitlines() if x.startswith("cmdstat_evalsha:"))
    return int(line.split("calls=")[1].split(",")[0])


async def test_acquisitions_that_come_while_calls_run_go_together_first_come_first_served(
    redis_server: RedisServer, redis: Redis
) -> None:
    """30 requests at once for 20 slots: 20 get one, 10 are told busy, and Redis ran far
    fewer than 30 acquisition calls. The first ``CALLS_AT_ONCE`` go alone, each on its own
    connection (as every request did before: which Redis runs first is not said); those
    that came while they ran went together, and of those the earlier got the slots."""
    asked: list[int] = []
    got: dict[int, Reservation] = {}
    busy: list[int] = []

    async def ask(pool: SharedPool, index: int) -> None:
        asked.append(index)
        try:
            got[index] = await pool.acquire(0)
        except Busy:
            busy.append(index)

    async with router(redis_server, slots=20, lease=600.0) as a:
        calls = await acquisition_calls(redis)
        async with anyio.create_task_group() as tg:
            for index in range(30):
                tg.start_soon(ask, a, index)
        calls = await acquisition_calls(redis) - calls
        assert len(got) == 20 and len(busy) == 10
        together = [index in got for index in asked[shared_pool.CALLS_AT_ONCE :]]
        assert together == sorted(together, reverse=True), "the earlier were served first"
        assert len({reservation.id for reservation in got.values()}) == 20
        assert await used(redis) == 20
        assert calls < 10, f"{calls} calls for 30 acquisitions"
        for reservation in got.values():
            reservation.release()
        await until_used(redis, 0)


async def test_a_burst_goes_in_calls_of_at_most_a_batch_each(
    redis_server: RedisServer, redis: Redis
) -> None:
    """600 requests at once: each served, in calls of at most ``ACQUIRE_BATCH`` (one script
    must not hold Redis, which every router waits on, for long)."""
    async with router(redis_server, slots=600, lease=600.0) as a:
        calls = await acquisition_calls(redis)
        got: list[Reservation] = []

        async def ask() -> None:
            got.append(await a.acquire(0))

        async with anyio.create_task_group() as tg:
            for _ in range(600):
                tg.start_soon(ask)
        calls = await acquisition_calls(redis) - calls
        assert len(got) == 600 and await used(redis) == 600
        assert calls >= 600 // shared_pool.ACQUIRE_BATCH + 1
        for reservation in got:
            reservation.release()
        await until_used(redis, 0)


async def test_acquisitions_waiting_on_a_call_fail_with_it_each_with_its_own_error(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server, slots=20, lease=1.0) as a:
        redis_server.kill()
        errors: list[Unavailable] = []

        async def ask() -> None:
            with pytest.raises(Unavailable) as caught:
                await a.acquire(0)
            errors.append(caught.value)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(10):
                    tg.start_soon(ask)
        assert len(errors) == 10 and len({id(error) for error in errors}) == 10
        assert all(error.status == 503 for error in errors)
        redis_server.start()
        await until(lambda: a.available, seconds=10)
        held = await a.acquire(0)
        held.release()
        await until_used(redis, 0)


async def test_a_release_while_redis_is_away_is_sent_when_it_returns(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server, lease=1.0) as a:
        held = await a.acquire(0)
        redis_server.stop()
        held.release()  # synchronous: queued for when Redis answers
        redis_server.start()
        await until(lambda: a.available, seconds=10)
        await until_used(redis, 0)
        again: Any = await a.acquire(0)
        again.release()
        await until_used(redis, 0)


async def test_a_burst_on_one_model_queues_nobody_asking_for_another(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with two_routers(redis_server) as (a, b):
        held = await a.acquire(0, "a")
        async with waiting(redis, A_URL, B_URL) as waiters:
            await waiters.add(a, "a1", "a")
            await waiters.add(b, "a2", "a")
            with anyio.fail_after(1):
                assert await b.acquire_now(model="a") is None, "a's waiters come first"
                now = await b.acquire(0, "b")  # fails fast if it would have to queue
            assert now.node.url == B_URL and now.waited < 1
            assert await used(redis, B_URL) == 1 and waiters.order == []
            with pytest.raises(Busy):
                await a.acquire(0, "b")  # b's own slots are all taken now
            now.release()
            await waiters.hand(held.release, "a1", A_URL)
            await waiters.hand(waiters.got["a1"].release, "a2", A_URL)


async def test_a_freed_slot_goes_to_the_oldest_waiter_its_node_serves_across_routers(
    redis_server: RedisServer, redis: Redis
) -> None:
    """First come first served within a model, across routers; an older waiter for a model
    the node does not serve is passed over, not served out of its node."""
    async with two_routers(redis_server) as (x, y):
        held_a, held_b = await x.acquire(0, "a"), await y.acquire(0, "b")
        async with waiting(redis, A_URL, B_URL) as waiters:
            await waiters.add(y, "b1", "b")  # the oldest, but a's node does not serve b
            for pool, name in [(x, "a1"), (y, "a2"), (x, "a3")]:
                await waiters.add(pool, name, "a")
            await waiters.hand(held_a.release, "a1", A_URL)
            await waiters.hand(waiters.got["a1"].release, "a2", A_URL)
            await waiters.hand(waiters.got["a2"].release, "a3", A_URL)
            await waiters.hand(held_b.release, "b1", B_URL)


async def test_a_node_serving_both_models_hands_its_slot_to_the_oldest_waiter_of_either(
    redis_server: RedisServer, redis: Redis
) -> None:
    models: Models = {**TWO, AB_URL: frozenset({"a", "b"})}
    async with two_routers(redis_server, models) as (x, y):
        held = [await x.acquire(0), await y.acquire(0), await x.acquire(0)]  # the freest each
        assert {reservation.node.url for reservation in held} == set(models)
        (on_ab,) = (reservation for reservation in held if reservation.node.url == AB_URL)
        async with waiting(redis, *models) as waiters:
            for pool, name, model in [(y, "b1", "b"), (x, "a1", "a"), (x, "any", None)]:
                await waiters.add(pool, name, model)
            await waiters.add(y, "b2", "b")
            await waiters.hand(on_ab.release, "b1", AB_URL)
            await waiters.hand(waiters.got["b1"].release, "a1", AB_URL)
            await waiters.hand(waiters.got["a1"].release, "any", AB_URL)
            await waiters.hand(waiters.got["any"].release, "b2", AB_URL)
            for reservation in held:
                reservation.release()


async def test_waiters_written_back_to_a_redis_that_lost_its_data_keep_their_model(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server, lease=1.0, models=TWO) as x:
        held_a, held_b = await x.acquire(0, "a"), await x.acquire(0, "b")
        async with waiting(redis, A_URL, B_URL) as waiters:
            await waiters.add(x, "a1", "a")  # the oldest: given b's slot, were its model lost
            await waiters.add(x, "b1", "b")
            await redis.call("FLUSHALL")  # as a Redis restarted empty
            await until_used(redis, 1, url=A_URL)  # written back, the queue with them
            await until_used(redis, 1, url=B_URL)
            await waiters.hand(held_b.release, "b1", B_URL)
            await waiters.hand(held_a.release, "a1", A_URL)


async def test_a_slot_freed_on_an_unhealthy_node_goes_to_a_model_that_only_it_serves(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Unhealthy nodes take new requests for a model no serving node serves (``nodes.usable``
    per model): a slot freed there goes to that model's waiter, as in-process."""
    async with two_routers(redis_server) as (x, y):
        for pool in (x, y):
            pool.nodes[0].state = State.UNHEALTHY  # a's only node; b's still serves
            pool.refresh()
        held = await x.acquire(0, "a")
        assert held.node.url == A_URL
        async with waiting(redis, A_URL) as waiters:
            await waiters.add(y, "a1", "a")
            await waiters.hand(held.release, "a1", A_URL)


async def test_a_free_slot_waits_for_the_renewal_to_reach_the_oldest_waiter_it_serves(
    redis_server: RedisServer, redis: Redis
) -> None:
    """A slot freed while its node took no new requests stays free: a newcomer for its
    model does not take it from that model's waiter, and the renewal that follows a node's
    readmission (``wake``) hands it to that waiter, not to an older one for another model."""
    async with two_routers(redis_server) as (x, y):
        held_a, held_b = await x.acquire(0, "a"), await x.acquire(0, "b")
        async with waiting(redis, A_URL, B_URL) as waiters:
            await waiters.add(y, "b1", "b")  # the oldest; a's node does not serve b
            await waiters.add(y, "a1", "a")
            x.nodes[0].state = State.DRAINING  # in x's eyes: a's slot is freed, not handed
            x.refresh()
            held_a.release()
            await until_used(redis, 0, url=A_URL)
            assert waiters.order == []
            assert await y.acquire_now(model="a") is None, "a1 came first"
            await waiters.hand(y.wake, "a1", A_URL)
            await waiters.hand(held_b.release, "b1", B_URL)


async def test_the_waiters_of_a_router_whose_lease_ended_are_dropped(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server, models=TWO) as x:
        held = await x.acquire(0, "a")
        await redis.call("HSET", "{pdr}:routers", "gone", "0")  # its lease long ended
        await redis.call("ZADD", "{pdr}:queue:a", "0", "gone r1")  # older than any waiter
        await redis.call("SADD", "{pdr}:queues", "a")
        x.wake()  # a renewal: it gives back what routers whose lease ended held
        with anyio.fail_after(2):
            while await redis.call("EXISTS", "{pdr}:queue:a"):
                await anyio.sleep(0.01)
        assert await redis.call("SMEMBERS", "{pdr}:queues") == []
        async with waiting(redis, A_URL) as waiters:
            await waiters.add(x, "a1", "a")
            await waiters.hand(held.release, "a1", A_URL)


# ---------------------------------------------------------------- releases held back
#
# ``HOLD`` (how long a release waits for an acquisition to carry it) is made long here, so
# that a release held back when it should not be shows as a waiter never served, and one
# carried or settled by the wrong call cannot be told apart from a race by its timing.

LONG = 30.0


@pytest.fixture
def long_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_pool, "HOLD", LONG)


@pytest.fixture
def long_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last acquisition's room believed as long as a release is held: a release follows
    its acquisition well within it, however slow the machine."""
    monkeypatch.setattr(shared_pool, "ROOM_FOR", LONG)


def gave_up_on(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "gave up on" in r.getMessage()]


async def test_a_release_held_back_and_not_yet_carried_is_no_slot_left_to_the_renewal(
    redis_server: RedisServer,
    redis: Redis,
    long_hold: None,
    long_room: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Slots not short, a release waits for the next acquisition; a renewal that comes
    first gives it back as a release, not as what a call given up on left behind (a
    warning that would send an operator looking for lost replies)."""
    caplog.set_level(logging.WARNING)
    async with router(redis_server, slots=2, lease=1.0) as a:  # renewed every 0.33 s
        held = await a.acquire(0)
        held.release()  # held back: the pool had room, and no acquisition follows
        await until_used(redis, 0)  # by the renewal: the hold lasts 30 s
    assert gave_up_on(caplog) == []


async def test_a_release_is_held_back_only_while_the_room_last_seen_is_recent(
    redis_server: RedisServer, redis: Redis, long_hold: None
) -> None:
    """What an acquisition found (room on its node, nobody waiting) goes stale: another
    router may have filled the pool since and queued a waiter, which a release held back
    would keep waiting."""
    async with router(redis_server, slots=2) as x, router(redis_server, slots=2) as y:
        held = await x.acquire(0)  # its node had room
        await anyio.sleep(10 * shared_pool.ROOM_FOR)  # what x knows of the pool grows old
        other = await y.acquire(0)  # the last slot
        async with waiting(redis, URL) as waiters:
            await waiters.add(y, "w", None)
            await waiters.hand(held.release, "w", URL)  # at once, not after HOLD
            other.release()


async def test_a_release_is_sent_at_once_while_slots_are_short(
    redis_server: RedisServer, redis: Redis, long_hold: None, long_room: None
) -> None:
    async with router(redis_server) as x, router(redis_server) as y:
        held = await x.acquire(0)  # the node's last slot: slots are short
        async with waiting(redis, URL) as waiters:
            await waiters.add(y, "w", None)
            await waiters.hand(held.release, "w", URL)


async def test_a_release_held_back_is_carried_by_the_next_acquisition(
    redis_server: RedisServer, redis: Redis, long_hold: None, long_room: None
) -> None:
    async with router(redis_server, slots=2, lease=600.0) as a:
        first = await a.acquire(0)
        first.release()  # held back: the pool had room
        second = await a.acquire(0)
        assert await used(redis) == 1, "the acquisition gave the first slot back"
        second.release()
        await a.acquire(0)  # ... and this one the second's
        assert await used(redis) == 1


async def test_releases_carried_by_an_acquisition_that_failed_are_sent_again(
    redis_server: RedisServer,
    redis: Redis,
    long_hold: None,
    long_room: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An acquisition that fails with any error, not only Redis away, puts back the releases
    it carried: the script may have stopped before giving them back."""
    caplog.set_level(logging.WARNING)
    async with router(redis_server, slots=3, lease=600.0) as a:
        held = [await a.acquire(0), await a.acquire(0)]
        for reservation in held:
            reservation.release()  # held back: the pool had room
        # The script fails after the first release (a key of the wrong type), the store is
        # repaired, and the registration that follows fails too (the shared fleet's hook).
        await redis.call("SET", "{pdr}:queues", "not a set")

        async def fail() -> None:
            a.before_register = None
            raise RuntimeError("the fleet could not be read")

        a.before_register = fail
        with pytest.raises(RuntimeError):
            await a.acquire(0)
        await until_used(redis, 0)  # the second release, sent again
    assert gave_up_on(caplog) == []


# ------------------------------------------------------- a slot that reached a waiter leaving
#
# The grant a script publishes and the waiter's own end (a cancellation, a timeout, a
# shutdown) race: whichever comes first, the slot that reached the waiter is either the
# waiter's or given back at once, never left in Redis until the next renewal (the lease is
# long here: a renewal cannot hide a slot not given back).


def grants_held(pool: SharedPool) -> list[tuple[str, str]]:
    """The grants this router's listener hears, kept from its waiters (recorded instead):
    a slot that reaches a waiter while the message telling it is still on its way."""
    heard: list[tuple[str, str]] = []
    pool._granted = lambda resid, url: heard.append((resid, url))  # type: ignore[method-assign]
    return heard


async def test_a_waiter_cancelled_as_its_slot_came_gives_the_slot_back(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Cancelled, then its grant heard before it ran again: the waiter raises the
    cancellation, and the slot handed to it goes back to Redis at once."""
    async with router(redis_server, lease=600.0) as a, router(redis_server, lease=600.0) as b:
        held = await a.acquire(0)
        scope = anyio.CancelScope()
        got: list[Reservation] = []
        deliver = b._granted

        def cancelled_first(resid: str, url: str) -> None:
            scope.cancel()  # the cancellation is on its way to the waiter ...
            deliver(resid, url)  # ... when its slot comes

        b._granted = cancelled_first  # type: ignore[method-assign]

        async def wait() -> None:
            with scope:
                got.append(await b.acquire(60))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await until(lambda: b.queue_depth == 1)  # in Redis's queue
            held.release()
        assert got == [] and scope.cancelled_caught
        await until_used(redis, 0, seconds=10)  # given back, not held until a renewal
        assert b.queue_depth == 0 and b.in_use == 0
        b._granted = deliver  # type: ignore[method-assign]
        again = await a.acquire(0)
        again.release()
        await until_used(redis, 0, seconds=10)


async def test_a_waiter_failed_after_its_slot_came_unheard_gives_the_slot_back(
    redis_server: RedisServer, redis: Redis
) -> None:
    """The router shuts down (``fail_waiters``) while the grant to one of its waiters is
    still on its way: the waiter's leaving finds the slot handed to it, and gives it back
    (the waiter fails as told, nothing is left taken)."""
    async with router(redis_server, lease=600.0) as a, router(redis_server, lease=600.0) as b:
        held = await a.acquire(0)
        heard = grants_held(b)
        errors: list[Exception] = []

        async def wait() -> None:
            try:
                await b.acquire(60)
            except ShuttingDown as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await until(lambda: b.queue_depth == 1)  # in Redis's queue
            held.release()
            await until(lambda: len(heard) == 1, seconds=10)  # the slot is the waiter's
            assert await used(redis) == 1
            b.fail_waiters(ShuttingDown("router shutting down"))
        assert len(errors) == 1 and b.in_use == 0 and b.queue_depth == 0
        await until_used(redis, 0, seconds=10)  # given back, not held until a renewal


async def test_an_acquisition_cancelled_as_it_starts_is_served_then_cancelled_taking_nothing(
    redis_server: RedisServer, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The client went away as its request came: the script that takes the slot runs
    shielded, the reservation is in hand when the cancellation is delivered (in ``reserve``,
    which gives it back), and no slot is left for a renewal to find as a call given up on."""
    caplog.set_level(logging.WARNING)
    async with router(redis_server, lease=600.0) as a:
        for _ in range(3):
            got: list[Reservation] = []
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with a.reserve(0) as reservation:
                    got.append(reservation)
                    await anyio.sleep(0)  # the cancellation, delivered here
            assert len(got) == 1 and scope.cancelled_caught
            await until_used(redis, 0, seconds=10)
        assert a.in_use == 0
    assert gave_up_on(caplog) == []


async def test_a_release_held_back_goes_when_the_hold_runs_out_with_no_acquisition_following(
    redis_server: RedisServer, redis: Redis, long_room: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Slots not short, a release waits ``HOLD`` for an acquisition to carry it; none comes:
    it is sent when the hold runs out (on asyncio by the loop's timer, on trio by the
    worker), not left counted in Redis until the next renewal (the lease is long here)."""
    caplog.set_level(logging.WARNING)
    async with router(redis_server, slots=2, lease=600.0) as a:
        for _ in range(3):
            held = await a.acquire(0)  # its node had room: the release is held back
            held.release()
            await until_used(redis, 0, seconds=10)
    assert gave_up_on(caplog) == []


async def test_an_error_reply_is_logged_once_whichever_script_met_it(
    redis_server: RedisServer, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis refuses the scripts (a master demoted to a replica, as in a failover): each
    acquisition is a 503 naming the error's code, never Redis's text, which is logged at
    ERROR once while it lasts. Redis 7 ends a script's error with the script and line, so
    an acquisition's and the renewal it asks for differed: logged again at each switch
    (3 lines for 5 requests, and on for as long as it lasted). Then serving goes on."""
    caplog.set_level(logging.ERROR)
    async with router(redis_server, lease=600.0) as a:
        await redis.call("REPLICAOF", "127.0.0.1", "9")  # a master nobody can reach
        try:
            for _ in range(5):
                with pytest.raises(Unavailable) as refused:
                    await a.acquire(0)
                assert refused.value.status == 503
                assert "answered READONLY" in refused.value.message
                assert "replica" not in refused.value.message
                await anyio.sleep(0)  # the renewal each failure asks for runs
        finally:
            await redis.call("REPLICAOF", "NO", "ONE")
        assert caplog.text.count("read only replica") == 1, caplog.text
        with anyio.fail_after(10):
            while True:
                try:
                    held = await a.acquire(0)
                    break
                except Unavailable:
                    await anyio.sleep(0.05)
        held.release()
        await until_used(redis, 0)

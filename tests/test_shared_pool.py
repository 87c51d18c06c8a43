"""The shared decode pool (``shared_pool.py``) on a real redis-server, several "routers" (one
pool each, as each router process has) in one event loop, under asyncio and trio.

What the in-process pool guarantees must hold across them: no node over its slots, one
first-come-first-served queue, a reservation given back exactly once, a waiter that leaves
taking nothing; and what only a shared pool needs: a router that stops renewing its lease
gives its slots back, and a Redis that restarted empty gets back what the routers hold.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from pd_router.errors import Busy, QueueTimeout, Unavailable
from pd_router.nodes import make_nodes
from pd_router.pool import Reservation
from pd_router.redis_client import Redis, parse_url
from pd_router.shared_pool import SharedPool
from tests.redis_server import RedisServer

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:9001"
USED = "{pdr}:used"


@asynccontextmanager
async def router(
    server: RedisServer, slots: int = 1, lease: float = 10.0
) -> AsyncIterator[SharedPool]:
    """One router's pool, its background work running, registered with Redis."""
    pool = SharedPool(make_nodes([URL], slots), Redis(parse_url(server.url), timeout=1.0), lease)
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


async def used(redis: Redis) -> int:
    value = await redis.call("HGET", USED, URL)
    return int(value or 0)


async def until_used(redis: Redis, count: int, seconds: float = 5.0) -> None:
    with anyio.fail_after(seconds):
        while await used(redis) != count:
            await anyio.sleep(0.01)


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

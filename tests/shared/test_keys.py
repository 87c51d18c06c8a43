"""Per-key requests in flight across routers (``shared/keys.py``) on a real redis-server:
several "routers" (one ``SharedKeyLimits`` each) in one event loop, under asyncio and trio.

The fleet's count of a key is the sum of the routers' own counts, each written whole at
every call under the router's lease, so the faults of a shared counter heal: a call whose
reply was lost, a router that died holding requests.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from pd_router.errors import RateLimited, StateUnavailable
from pd_router.shared.keys import SharedKeyLimits
from pd_router.shared.redis import Redis, parse_url
from tests.redis_server import DroppingProxy, RedisServer

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def router(
    server: RedisServer, lease: float = 10.0, url: str | None = None
) -> AsyncIterator[SharedKeyLimits]:
    limits = SharedKeyLimits(Redis(parse_url(url or server.url), timeout=1.0), lease)
    async with anyio.create_task_group() as tg:
        for _, work in limits.background():
            tg.start_soon(work)
        try:
            yield limits
        finally:
            tg.cancel_scope.cancel()
    await limits.redis.aclose()


async def until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    with anyio.fail_after(seconds):
        while not check():
            await anyio.sleep(0.01)


async def admitted(limits: SharedKeyLimits, name: str, limit: int) -> bool:
    """One request of ``name`` enters and leaves at once: was it let in?"""
    try:
        await limits.enter(name, limit)
    except RateLimited:
        return False
    limits.leave(name)
    return True


async def eventually_admitted(limits: SharedKeyLimits, name: str, limit: int) -> None:
    with anyio.fail_after(15):
        while not await admitted(limits, name, limit):
            await anyio.sleep(0.05)


async def test_a_keys_limit_is_the_fleets(redis: Redis, redis_server: RedisServer) -> None:
    async with router(redis_server) as first, router(redis_server) as second:
        await first.enter("carol", 2)
        await second.enter("carol", 2)
        for limits in (first, second):
            with pytest.raises(RateLimited):
                await limits.enter("carol", 2)
        # Another key is not held back by carol's.
        await first.enter("alice", 1)
        first.leave("alice")
        # A place given back on one router is another router's to take.
        first.leave("carol")
        await eventually_admitted(second, "carol", 2)
        second.leave("carol")
        assert first.in_flight == {} and second.in_flight == {}


async def test_a_place_given_back_is_told_at_once_not_when_the_lease_ends(
    redis: Redis, redis_server: RedisServer
) -> None:
    """A lease far longer than the wait: only the release's own call can free the place."""
    async with router(redis_server, 600.0) as first, router(redis_server, 600.0) as second:
        await first.enter("carol", 1)
        with pytest.raises(RateLimited):
            await second.enter("carol", 1)
        first.leave("carol")
        await eventually_admitted(second, "carol", 1)


async def test_a_request_cancelled_while_its_ask_is_out_holds_nothing(
    redis: Redis, redis_server: RedisServer
) -> None:
    """Its client gone while the ask was on its way: the answer is waited for all the same,
    so the request is told it entered and leaves, and no count stays behind here."""
    async with router(redis_server) as limits:
        entered = False
        with anyio.CancelScope() as scope:
            scope.cancel()
            await limits.enter("carol", 1)
            entered = True
        if entered:
            limits.leave("carol")
        # Asks are answered in order: once alice's is, carol's has been.
        assert await admitted(limits, "alice", 1)
        assert limits.in_flight == {}
        await eventually_admitted(limits, "carol", 1)
        assert limits.in_flight == {}


@asynccontextmanager
async def behind_proxy(
    redis_server: RedisServer, lease: float = 10.0
) -> AsyncIterator[tuple[SharedKeyLimits, DroppingProxy]]:
    """A router whose calls go through a ``DroppingProxy`` of the test's."""
    proxy = DroppingProxy(redis_server.port)
    async with anyio.create_task_group() as tg:
        port = await tg.start(proxy.serve)
        async with router(redis_server, lease, f"redis://127.0.0.1:{port}/0") as limits:
            yield limits, proxy
        tg.cancel_scope.cancel()


async def test_a_call_whose_reply_was_lost_is_undone_by_the_router_soon(
    redis: Redis, redis_server: RedisServer
) -> None:
    """The call ran in Redis, its reply never came back: the router refused the request
    (503), Redis counts it. The router tells Redis what it holds again soon, though it has
    nothing else to say (holding nothing, it renews no lease): before, Redis counted the
    ghost until the lease ended (a minute here), and every router refused the key."""
    async with behind_proxy(redis_server, lease=60.0) as (first, proxy):
        async with router(redis_server) as second:
            # The script loaded first (a dropped reply to a NOSCRIPT error is no call that
            # ran), and no release left to send: the next call is the lost one's alone.
            await first.enter("alice", 5)
            proxy.dropping = True
            with pytest.raises(StateUnavailable):
                await first.enter("carol", 1)
            proxy.dropping = False
            assert proxy.dropped >= 1 and first.in_flight == {"alice": 1}
            with anyio.fail_after(15):
                while not await admitted(second, "carol", 1):
                    await anyio.sleep(0.05)


async def test_a_call_that_reaches_redis_late_changes_nothing(
    redis: Redis, redis_server: RedisServer
) -> None:
    """A release call held on its way (a slow link, a proxy) past the router's timeout runs
    after the router's next calls: it would write back the counts it carried (none) over
    those the router holds since (two), and let another router past the key's limit."""
    async with behind_proxy(redis_server, lease=60.0) as (first, proxy):
        async with router(redis_server) as second:
            await first.enter("carol", 2)
            late = proxy.delaying = anyio.Event()
            first.leave("carol")  # its call (holding none) is held on the way
            await until(lambda: proxy.delayed == 1)
            proxy.delaying = None
            with anyio.fail_after(15):
                while True:  # refused with 503 while the call is held and given up on
                    try:
                        await first.enter("carol", 2)
                        break
                    except StateUnavailable:
                        await anyio.sleep(0.1)
            await first.enter("carol", 2)
            assert first.in_flight == {"carol": 2}
            late.set()  # after the router's newer calls, whatever the machine's pace
            await until(lambda: proxy.forwarded_late == 1)
            await anyio.sleep(0.2)  # Redis has run it
            assert not await admitted(second, "carol", 2)
            first.leave("carol")
            first.leave("carol")
            await eventually_admitted(second, "carol", 2)


async def test_a_router_that_died_holding_requests_gives_them_back_with_its_lease(
    redis: Redis, redis_server: RedisServer
) -> None:
    async with router(redis_server) as survivor:
        async with router(redis_server, lease=1.0) as doomed:
            await doomed.enter("carol", 1)
        # doomed's work stopped with it: no release was sent, and no lease renewed.
        assert not await admitted(survivor, "carol", 1)
        await eventually_admitted(survivor, "carol", 1)


async def test_a_router_holding_requests_renews_its_lease_on_them(
    redis: Redis, redis_server: RedisServer
) -> None:
    async with router(redis_server, lease=1.0) as holder, router(redis_server) as other:
        await holder.enter("carol", 1)
        await anyio.sleep(2.5)  # the lease, more than twice over
        assert not await admitted(other, "carol", 1)
        holder.leave("carol")
        await eventually_admitted(other, "carol", 1)


async def test_redis_away_refuses_with_503_and_counts_nothing(redis_server: RedisServer) -> None:
    limits = SharedKeyLimits(Redis(parse_url("redis://127.0.0.1:9"), timeout=0.5))
    async with anyio.create_task_group() as tg:
        for _, work in limits.background():
            tg.start_soon(work)
        with pytest.raises(StateUnavailable):
            await limits.enter("carol", 1)
        assert limits.in_flight == {}
        tg.cancel_scope.cancel()


async def test_a_reply_no_script_gives_refuses_with_503_and_holds_no_one(
    redis: Redis, redis_server: RedisServer
) -> None:
    """Between the router and Redis, something answers what the script never says (fewer
    counts than asks): the asks it answered for are refused with a 503, none waits for an
    answer forever, and the next true answer counts again."""
    proxy = DroppingProxy(redis_server.port)
    async with anyio.create_task_group() as tg:
        port = await tg.start(proxy.serve)
        async with router(redis_server, url=f"redis://127.0.0.1:{port}/0") as limits:
            proxy.lying = b"*0\r\n"
            errors: list[StateUnavailable] = []

            async def ask(name: str) -> None:
                try:
                    await limits.enter(name, 5)
                except StateUnavailable as exc:
                    errors.append(exc)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as asks:
                    for name in ("carol", "alice", "bob"):
                        asks.start_soon(ask, name)
            assert len(errors) == 3 and all(e.status == 503 for e in errors)
            assert limits.in_flight == {}
            proxy.lying = None
            await eventually_admitted(limits, "carol", 1)
        tg.cancel_scope.cancel()


async def test_bad_values_in_the_key_counts_are_logged_and_serving_goes_on(
    redis: Redis, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """What the store holds is not trusted, as for the slot pool: the holders of another
    type, another router's counts of another type or not a count. Each is logged at ERROR,
    its key named, and deleted or counted as 0 until its router writes it again; requests
    are served meanwhile. Before, each failed the script: every request of a limited key
    got a 503 carrying Redis's own error text, nothing was logged, nothing repaired."""
    caplog.set_level(logging.ERROR)
    far = str(10**13)  # ms: a lease that has not ended
    async with router(redis_server) as limits:
        await redis.call("SET", "{pdr}:key-holders", "oops")
        assert await admitted(limits, "carol", 1)
        assert "{pdr}:key-holders held 'a string', not what it should: deleted" in caplog.text
        assert await redis.call("TYPE", "{pdr}:key-holders") in ("none", "zset")
        await redis.call("ZADD", "{pdr}:key-holders", far, "other", far, "third")
        await redis.call("HSET", "{pdr}:keys:other", "carol", "x")
        await redis.call("SET", "{pdr}:keys:third", "y")
        assert await admitted(limits, "carol", 1)
        assert "{pdr}:keys:other field 'carol' held 'x', not what it should: counted as 0" in (
            caplog.text
        )
        assert "{pdr}:keys:third held 'a string', not what it should: deleted" in caplog.text
        # What is a count still counts: another router's request holds carol's one place.
        await redis.call("HSET", "{pdr}:keys:other", "carol", "1")
        assert not await admitted(limits, "carol", 1)


async def test_an_error_reply_is_a_503_without_its_text_logged_once(
    redis: Redis, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis refuses the script (here a master demoted to a replica, as in a failover):
    each request gets a 503 naming the error's code only, never Redis's text (README: logged,
    never sent), logged once while it lasts; once Redis takes writes again, the key is
    counted again. Before, the text went to every client and nothing was logged."""
    caplog.set_level(logging.ERROR)
    async with router(redis_server) as limits:
        await redis.call("REPLICAOF", "127.0.0.1", "9")  # a master nobody can reach
        try:
            for _ in range(3):
                with pytest.raises(StateUnavailable) as refused:
                    await limits.enter("carol", 2)
                assert "answered READONLY" in str(refused.value)
                assert "replica" not in str(refused.value)
        finally:
            await redis.call("REPLICAOF", "NO", "ONE")
        assert caplog.text.count("read only replica") == 1, caplog.text
        assert limits.in_flight == {}
        await eventually_admitted(limits, "carol", 2)


async def test_a_router_stopping_answers_every_ask_it_holds(
    redis: Redis, redis_server: RedisServer
) -> None:
    """The router stops while a call for the key counts is out (its reply held up on the
    way) and another ask waits for the next call: both are told 503 at once. Each waits
    for its answer shielded, and before, both waited forever."""
    proxy = DroppingProxy(redis_server.port)
    errors: list[StateUnavailable] = []
    async with anyio.create_task_group() as tg:
        port = await tg.start(proxy.serve)
        limits = SharedKeyLimits(Redis(parse_url(f"redis://127.0.0.1:{port}/0"), timeout=60.0))

        async def ask(name: str) -> None:
            try:
                await limits.enter(name, 5)
            except StateUnavailable as exc:
                errors.append(exc)

        proxy.holding = b"stuck"
        with anyio.fail_after(10):
            async with anyio.create_task_group() as asks:
                async with anyio.create_task_group() as work:
                    for _, job in limits.background():
                        work.start_soon(job)
                    asks.start_soon(ask, "stuck")
                    await until(lambda: proxy.held == 1)
                    asks.start_soon(ask, "later")
                    # Queued for the next call, which the one held up keeps from coming.
                    await until(lambda: limits._jobs.statistics().current_buffer_used == 1)
                    work.cancel_scope.cancel()
        assert len(errors) == 2 and all(e.status == 503 for e in errors), errors
        proxy.let_go()
        await limits.redis.aclose()
        tg.cancel_scope.cancel()

"""A reservation is held by exactly one party across any fault of the store or the link to it
(``shared/pool.py``, ``shared/scripts.py``: "Unknown outcomes"), on a real redis-server,
under asyncio and trio.

Each fault leaves Redis with the outcome of a call the router gave up on: an acquire that
timed out (``DEBUG SLEEP``, ``CLIENT PAUSE``) and ran later, one whose reply was lost after
it ran (a proxy that drops it), one whose connection was killed as it ran (``CLIENT
KILL``), one kept by a Redis that restarted; and a failover leaves the new master without
the last writes (acquires, a release, a waiter's entry). Within one renewal Redis's count
of slots in use must equal what the router holds (and no queue entry be left that nobody
waits on, nor a waiter Redis does not know), and then a burst as wide as the pool must be
served.

And what is in the store is not trusted: a bad value is logged at ERROR (key and field
named) and repaired, and the router keeps serving; no caller sees a Lua error's text.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import anyio
import pytest
from anyio.abc import SocketStream

from pd_router.errors import Unavailable
from pd_router.fleet.nodes import make_nodes
from pd_router.fleet.pool import Reservation
from pd_router.shared.pool import SharedPool
from pd_router.shared.redis import Redis, parse_url
from tests.redis_server import DroppingProxy, RedisServer

pytestmark = pytest.mark.anyio

URLS = ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
SLOTS = 2
# Renewed every second: "within one renewal" is then within a second of Redis answering
# again. The deadlines below allow a stalled machine many times that.
LEASE = 3.0
HEAL = 15.0
# Longer than the pool's call timeout (1 s): the router gives up, Redis runs the call later.
STALL = 2.5


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(debug=True) as redis_server:
        yield redis_server


@pytest.fixture
async def store(server: RedisServer) -> AsyncIterator[Redis]:
    """What the test reads Redis with (patient: it waits out the faults), on an empty store."""
    async with Redis(parse_url(server.url), timeout=10.0) as client:
        await client.call("FLUSHALL")
        yield client


@asynccontextmanager
async def router(url: str, slots: int = SLOTS) -> AsyncIterator[SharedPool]:
    """One router's pool on ``url`` (1 s call timeout, as the CLI has), running."""
    pool = SharedPool(make_nodes(URLS, slots), Redis(parse_url(url), timeout=1.0), LEASE)
    async with anyio.create_task_group() as tg:
        for _, work in pool.background():
            tg.start_soon(work)
        await until(lambda: pool.available)
        (await pool.acquire(0)).release()  # the scripts loaded: a late one runs, as in use
        while any(int(n) for n in await pool.redis.call("HVALS", "{pdr}:used")):
            await anyio.sleep(0.01)
        try:
            yield pool
        finally:
            tg.cancel_scope.cancel()
    await pool.redis.aclose()


async def until(check: Callable[[], bool], seconds: float = HEAL) -> None:
    with anyio.fail_after(seconds):
        while not check():
            await anyio.sleep(0.01)


async def in_redis(store: Redis) -> int:
    """Slots in use by Redis's count."""
    return sum(int(value) for value in await store.call("HVALS", "{pdr}:used"))


async def until_in(store: Redis, count: int) -> None:
    with anyio.fail_after(HEAL):
        while await in_redis(store) != count:
            await anyio.sleep(0.01)


async def queued_in_redis(store: Redis) -> int:
    models = await store.call("SMEMBERS", "{pdr}:queues")
    return sum([await store.call("ZCARD", b"{pdr}:queue:" + model) for model in models])


async def agree(store: Redis, *pools: SharedPool) -> None:
    """Redis counts what the routers hold, each router's reservations are its own, and
    nobody waits in Redis's queues but the routers' waiters: within one renewal (``HEAL``
    allows a slow machine)."""

    async def state() -> tuple[int, list[set[str]], int]:
        ids = []
        for pool in pools:
            ids.append(
                {r.decode() for r in await store.call("HKEYS", "{pdr}:res:" + pool.router_id)}
            )
        return await in_redis(store), ids, await queued_in_redis(store)

    with anyio.fail_after(HEAL):
        while True:
            held = [set(pool._held) for pool in pools]
            routers = sum(p.in_use for p in pools), held, sum(p.queue_depth for p in pools)
            if await state() == routers:
                return
            await anyio.sleep(0.02)


async def burst(store: Redis, pool: SharedPool) -> None:
    """Every free slot of the pool taken at once, then all given back."""
    before = pool.in_use
    free = sum(node.slots for node in pool.nodes) - before
    taken: list[Reservation] = [await pool.acquire(0) for _ in range(free)]
    assert await in_redis(store) == before + len(taken)
    for reservation in taken:
        reservation.release()
    await agree(store, pool)
    assert pool.in_use == before


async def refused(
    acquire: Callable[[], Awaitable[Reservation]], count: int, at_least: int | None = None
) -> None:
    """``count`` acquires at once, each a 503 (shared state unavailable), or ``at_least``
    that many (the others served, and their reservations given back at once)."""
    errors: list[Unavailable] = []

    async def one() -> None:
        try:
            (await acquire()).release()
        except Unavailable as exc:
            errors.append(exc)

    # Each acquire waits at most the client's timeout (1 s) per call: none waits forever.
    with anyio.fail_after(HEAL):
        async with anyio.create_task_group() as tg:
            for _ in range(count):
                tg.start_soon(one)
    assert len(errors) >= (count if at_least is None else at_least), "Redis answered in time"
    assert all(e.status == 503 and "shared state unavailable" in e.message for e in errors)


async def connection(port: int) -> SocketStream:
    """A raw connection of the test's own, Redis already serving it (a PING answered)."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    await stream.send(b"PING\r\n")
    assert await stream.receive() == b"+PONG\r\n"
    return stream


async def send(stream: SocketStream, *words: str) -> None:
    """``words`` sent, their reply not awaited."""
    encoded = b"".join(b"$%d\r\n%s\r\n" % (len(w), w.encode()) for w in words)
    await stream.send(b"*%d\r\n" % len(words) + encoded)


async def command(port: int, *words: str) -> SocketStream:
    """``words`` sent on a connection of their own (to close), read by Redis before what
    the test sends next."""
    stream = await connection(port)
    await send(stream, *words)
    await anyio.sleep(0.1)
    return stream


async def test_acquires_that_timed_out_while_redis_slept_and_ran_later_are_given_back(
    server: RedisServer, store: Redis
) -> None:
    """Another router's reservation is its own: what one router settles is only its own."""
    async with router(server.url) as pool, router(server.url) as other:
        held, elsewhere = await pool.acquire(0), await other.acquire(0)
        sleeper = await command(server.port, "DEBUG", "SLEEP", str(STALL))
        await refused(lambda: pool.acquire(0), 6)
        await sleeper.receive()  # Redis is awake: it ran the six acquires, or refused them
        await sleeper.aclose()
        await agree(store, pool, other)
        assert await in_redis(store) == 2 == pool.in_use + other.in_use
        assert await store.call("HKEYS", "{pdr}:res:" + other.router_id) == [elsewhere.id.encode()]
        held.release()
        elsewhere.release()
        await agree(store, pool, other)
        await burst(store, pool)


async def test_waiters_queued_by_calls_given_up_on_are_dropped(
    server: RedisServer, store: Redis
) -> None:
    async with router(server.url, slots=1) as pool:
        held = [await pool.acquire(0), await pool.acquire(0)]  # full: the next ones queue
        sleeper = await command(server.port, "DEBUG", "SLEEP", str(STALL))
        await refused(lambda: pool.acquire(30), 3)
        await sleeper.receive()
        await sleeper.aclose()
        await agree(store, pool)
        assert await queued_in_redis(store) == 0
        for reservation in held:
            reservation.release()
        await agree(store, pool)
        await burst(store, pool)


async def test_acquires_held_by_client_pause_and_run_after_it_are_given_back(
    server: RedisServer, store: Redis
) -> None:
    async with router(server.url) as pool:
        await store.call("CLIENT", "PAUSE", str(int(STALL * 1000)), "ALL")
        await refused(lambda: pool.acquire(0), 4)
        await agree(store, pool)  # the test's own calls wait out the pause too
        await burst(store, pool)


async def test_acquires_whose_reply_was_lost_after_they_ran_are_given_back(
    server: RedisServer, store: Redis
) -> None:
    proxy = DroppingProxy(server.port)
    dropped = await replies_lost(proxy, store, 3)
    assert dropped >= 3, "the acquires ran and their replies were dropped"


async def test_acquires_sent_together_whose_reply_was_lost_are_given_back(
    server: RedisServer, store: Redis
) -> None:
    """More acquires at once than ``CALLS_AT_ONCE``: those after go in one call, and its
    reply is lost after it took a slot for each of them. Every slot comes back."""
    dropped = await replies_lost(DroppingProxy(server.port), store, 8, slots=8)
    assert 0 < dropped < 8, "some of the acquires went together"


async def replies_lost(
    proxy: DroppingProxy, store: Redis, count: int, slots: int = SLOTS, lie: bytes | None = None
) -> int:
    """``count`` acquires at once through ``proxy``, each reply dropped after its call ran
    (with ``lie``, replaced by it), each a 503; then Redis agrees with the router and a
    burst is served. The replies lost."""
    async with anyio.create_task_group() as tg:
        port = await tg.start(proxy.serve)
        async with router(f"redis://127.0.0.1:{port}/0", slots) as pool:
            proxy.dropping, proxy.lying = lie is None, lie
            await refused(lambda: pool.acquire(0), count)
            lost = proxy.dropped + proxy.lied
            proxy.dropping, proxy.lying = False, None
            await agree(store, pool)
            await burst(store, pool)
        tg.cancel_scope.cancel()
    return lost


@pytest.mark.parametrize(
    "lie",
    [
        b"*2\r\n*0\r\n*0\r\n",  # an acquisition call's shape, with no reply for anyone
        b"+OK\r\n",  # no script's shape
    ],
    ids=["no-replies", "not-a-script-reply"],
)
async def test_acquires_answered_what_no_script_says_are_refused_and_given_back(
    server: RedisServer, store: Redis, lie: bytes
) -> None:
    """Acquires at once, some sent together, each answered with what the script never
    says: each is refused with a 503 (none waits forever for a reply the call did not
    carry), and the slots the script took come back."""
    lied = await replies_lost(DroppingProxy(server.port), store, 8, slots=8, lie=lie)
    assert lied >= 2, "some of the acquires were answered"


async def test_an_acquisition_stuck_on_its_connection_holds_up_no_other(
    server: RedisServer, store: Redis
) -> None:
    """The network stops answering on one connection (no reset: its call waits out the
    client's timeout): requests that come meanwhile are served on other connections,
    whatever the batching of acquisitions does (``shared/pool.py``, ``CALLS_AT_ONCE``)."""
    proxy = DroppingProxy(server.port)
    async with anyio.create_task_group() as tg:
        port = await tg.start(proxy.serve)
        redis = Redis(parse_url(f"redis://127.0.0.1:{port}/0"), timeout=60.0)
        pool = SharedPool(make_nodes(URLS, 8), redis, lease=600.0)
        stuck = anyio.Event()

        async def ask_stuck() -> None:
            with pytest.raises(Unavailable):
                await pool.acquire(0, "stuck")  # its reply never comes; then its link closes
            stuck.set()

        async with anyio.create_task_group() as work:
            for _, job in pool.background():
                work.start_soon(job)
            await until(lambda: pool.available)
            proxy.holding = b"stuck"
            work.start_soon(ask_stuck)
            await until(lambda: proxy.held == 1)
            served = [await pool.acquire(0) for _ in range(3)]
            assert not stuck.is_set(), "served while the stuck call still waited"
            for reservation in served:
                reservation.release()
            proxy.let_go()
            await stuck.wait()
            work.cancel_scope.cancel()
        await redis.aclose()
        tg.cancel_scope.cancel()


async def test_acquires_whose_connection_was_killed_as_they_ran_are_given_back(
    server: RedisServer, store: Redis
) -> None:
    """Redis runs the acquires and the kill in one pass once it wakes: the scripts ran,
    their connections are closed before their replies are written. (An acquire on a
    connection opened during the sleep is read in the pass after: it is served.)"""
    async with router(server.url) as pool:
        killer = await connection(server.port)
        sleeper = await command(server.port, "DEBUG", "SLEEP", "0.8")
        async with anyio.create_task_group() as tg:
            tg.start_soon(refused, lambda: pool.acquire(0), 3, 1)
            await anyio.sleep(0.3)  # the acquires are written (they wait for Redis)
            await send(killer, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        await killer.aclose()
        await sleeper.aclose()
        await agree(store, pool)
        await burst(store, pool)


async def test_acquires_run_late_and_kept_by_a_redis_that_restarted_are_given_back(
    store: Redis,
) -> None:
    with RedisServer(debug=True, persistence=True) as restarting:
        async with router(restarting.url) as pool:
            held = await pool.acquire(0)
            sleeper = await command(restarting.port, "DEBUG", "SLEEP", str(STALL))
            await refused(lambda: pool.acquire(0), 3)
            await sleeper.receive()
            await sleeper.aclose()
            restarting.stop()  # SIGTERM: Redis saves what it holds, the late acquires' too
            restarting.start()
            async with Redis(parse_url(restarting.url), timeout=10.0) as after:
                await agree(after, pool)
                assert await in_redis(after) == 1 == pool.in_use
                held.release()
                await agree(after, pool)
                await burst(after, pool)


async def test_what_a_failover_lost_or_kept_is_written_back_or_given_back() -> None:
    """The replica is promoted while the router still writes to the old master, as in a
    failover's window: a release, an acquire and a waiter's queue entry reach only the old
    master, which then dies. The new master must come to count what the router holds,
    know each of its reservations and waiters, and serve them."""
    with RedisServer() as old, RedisServer(replica_of=old.port) as new:
        proxy = DroppingProxy(old.port)
        async with anyio.create_task_group() as tg:
            port = await tg.start(proxy.serve)
            async with (
                router(f"redis://127.0.0.1:{port}/0", slots=1) as pool,
                Redis(parse_url(old.url), timeout=10.0) as before,
                Redis(parse_url(new.url), timeout=10.0) as after,
            ):
                held = [await pool.acquire(0), await pool.acquire(0)]  # full
                assert await before.call("WAIT", "1", "10000") == 1  # the replica has them
                await after.call("REPLICAOF", "NO", "ONE")
                held.pop(0).release()
                await until_in(before, 1)
                held.append(await pool.acquire(0))
                got: list[Reservation] = []

                async def wait() -> None:
                    got.append(await pool.acquire(HEAL * 2))

                tg.start_soon(wait)
                await until(lambda: pool.queue_depth == 1)
                assert await queued_in_redis(before) == 1
                proxy.port = new.port
                old.kill()
                await agree(after, pool)
                assert await in_redis(after) == 2 == pool.in_use
                held.pop(0).release()  # its slot goes to the waiter, by the new master
                await until(lambda: bool(got))
                await agree(after, pool)
                for reservation in [*held, *got]:
                    reservation.release()
                await agree(after, pool)
                assert await in_redis(after) == 0
                await burst(after, pool)
            tg.cancel_scope.cancel()


# ---------------------------------------------------------------- bad values in the store


def errors_naming(caplog: pytest.LogCaptureFixture, *words: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and all(word in r.getMessage() for word in words)
    ]


# A request checks what it reads; a renewal checks everything (``renewal``: only it can tell).
@pytest.mark.parametrize(
    "value, renewal",
    [
        pytest.param(["HSET", "{pdr}:used", URLS[0], "many"], False, id="used-not-a-number"),
        pytest.param(["HSET", "{pdr}:used", URLS[0], "-3"], False, id="used-negative"),
        pytest.param(["HSET", "{pdr}:used", URLS[0], "7"], True, id="used-wrong"),
        pytest.param(["HSET", "{pdr}:slots", URLS[0], "x"], False, id="slots-not-a-number"),
        pytest.param(["HSET", "{pdr}:floor", "?", "x"], True, id="floor-not-a-number"),
        pytest.param(["SET", "{pdr}:used", "x"], False, id="used-wrong-type"),
        pytest.param(["SET", "{pdr}:rr", "x"], False, id="rr-not-a-counter"),
        pytest.param(["HSET", "{pdr}:routers", "ghost", "soon"], True, id="lease-not-a-time"),
    ],
)
async def test_a_bad_value_in_the_store_is_logged_repaired_and_serving_goes_on(
    server: RedisServer,
    store: Redis,
    caplog: pytest.LogCaptureFixture,
    value: list[str],
    renewal: bool,
) -> None:
    caplog.set_level(logging.ERROR)
    async with router(server.url) as pool:
        held = await pool.acquire(0)
        await store.call(*(pool.router_id if word == "?" else word for word in value))
        if renewal:
            pool.wake()
            await until(lambda: bool(errors_naming(caplog, value[1])))
        await burst(store, pool)  # every slot but the one held: each acquire succeeds
        assert errors_naming(caplog, value[1]), f"nothing logged at ERROR naming {value[1]}"
        held.release()
        await agree(store, pool)
        assert await store.call("HGET", "{pdr}:slots", URLS[0]) == str(SLOTS).encode()


async def test_nodes_whose_slots_the_store_lost_get_them_back_and_serving_goes_on(
    server: RedisServer, store: Redis
) -> None:
    """Slots missing from the store are not nodes without slots: the acquisition that finds
    none free and some missing has the router write them back (its renewal), and is served."""
    async with router(server.url) as pool:
        for url in URLS:
            await store.call("HDEL", "{pdr}:slots", url)
        await burst(store, pool)  # every slot taken at once: none refused as busy
        assert await store.call("HMGET", "{pdr}:slots", *URLS) == [str(SLOTS).encode()] * 2


async def test_a_request_never_carries_a_lua_error_and_the_store_is_repaired(
    server: RedisServer, store: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A key of the wrong type fails the script that reads it: the caller is served after
    the store's repair, and a 503 (had the repair failed too) would name no script line."""
    caplog.set_level(logging.ERROR)
    async with router(server.url) as pool:
        held = await pool.acquire(0)
        for key in ["{pdr}:res:" + pool.router_id, "{pdr}:queues"]:
            await store.call("SET", key, "not what the scripts keep there")
            failures: list[str] = []
            for _ in range(3):
                try:
                    (await pool.acquire(0)).release()
                except Unavailable as exc:
                    failures.append(exc.message)
            assert failures == []
            assert errors_naming(caplog, key, "deleted")
            await agree(store, pool)
            assert await in_redis(store) == 1 == pool.in_use
        held.release()
        await agree(store, pool)


async def test_queue_entries_and_counters_that_are_not_ours_are_dropped(
    server: RedisServer, store: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    async with router(server.url, slots=1) as pool:
        held = [await pool.acquire(0), await pool.acquire(0)]
        await store.call("ZADD", "{pdr}:queue:", "0", "no-space")
        await store.call("SADD", "{pdr}:queues", "")
        await store.call("SET", "{pdr}:seq", "not a counter")
        got: list[Reservation] = []

        async def wait() -> None:
            got.append(await pool.acquire(10))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await until(lambda: pool.queue_depth == 1)
            held[0].release()
        assert got and errors_naming(caplog, "{pdr}:queue:", "no-space")
        assert errors_naming(caplog, "{pdr}:seq")
        for reservation in [held[1], *got]:
            reservation.release()
        await agree(store, pool)
        await burst(store, pool)

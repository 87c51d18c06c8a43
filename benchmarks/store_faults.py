"""Slots Redis counts against slots the router holds, after each fault of the store or the
link to it (issue 18): ``python benchmarks/store_faults.py`` (~1 min).

One router's shared pool (``shared/pool.py``, the CLI's 1 s call timeout and 10 s lease:
a renewal every ~3.3 s) on two 2-slot nodes, on a real redis-server started here with
``--enable-debug-command yes``. Each fault sends acquires the router gives up on:

* sleep: six acquires during ``DEBUG SLEEP 3`` (they time out, Redis runs them later);
* waiters: the pool full, three queueing acquires during ``DEBUG SLEEP 3``;
* pause: four acquires during ``CLIENT PAUSE 3000 ALL``;
* lost reply: three acquires through a proxy that forwards them and drops their replies;
* killed: three acquires, and a ``CLIENT KILL TYPE normal`` run in the same pass once a
  ``DEBUG SLEEP 0.8`` ends;
* restart: as sleep, then Redis stopped (SIGTERM: it saves) and started again;
* failover: three reservations replicated to a replica, the replica promoted (``REPLICAOF
  NO ONE``), then on the old master one released, two taken and a waiter queued; the
  proxy the router talks through switched to the new master and the old one killed.

Then, from the moment Redis answers again, it prints Redis's count of slots in use (and
of queue entries; m: how many of the router's reservations Redis does not know) against
the router's, at once, after one renewal (3.4 s) and after 10 s.
It reports; it asserts nothing. Every process it starts is stopped by its PID.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from anyio.abc import SocketStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_router.errors import Unavailable  # noqa: E402
from pd_router.fleet.nodes import make_nodes  # noqa: E402
from pd_router.shared.pool import SharedPool  # noqa: E402
from pd_router.shared.redis import Redis, parse_url  # noqa: E402
from tests.redis_server import DroppingProxy, RedisServer  # noqa: E402

URLS = ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
AT = (0.0, 3.4, 10.0)


async def send(stream: SocketStream, *words: str) -> None:
    encoded = b"".join(b"$%d\r\n%s\r\n" % (len(w), w.encode()) for w in words)
    await stream.send(b"*%d\r\n" % len(words) + encoded)


async def raw(port: int, *words: str) -> SocketStream:
    """A connection Redis serves already (PING answered), ``words`` sent on it unanswered."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    await stream.send(b"PING\r\n")
    await stream.receive()
    if words:
        await send(stream, *words)
        await anyio.sleep(0.1)
    return stream


async def give_up(pool: SharedPool, count: int, timeout: float = 0) -> int:
    """``count`` acquires at once; how many got a 503."""
    refused = 0

    async def one() -> None:
        nonlocal refused
        try:
            (await pool.acquire(timeout)).release()
        except Unavailable:
            refused += 1

    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(one)
    return refused


@asynccontextmanager
async def router(url: str) -> AsyncIterator[SharedPool]:
    pool = SharedPool(make_nodes(URLS, 2), Redis(parse_url(url), timeout=1.0))
    async with anyio.create_task_group() as tg:
        for _, work in pool.background():
            tg.start_soon(work)
        while not pool.available:
            await anyio.sleep(0.01)
        (await pool.acquire(0)).release()  # the scripts loaded: a late one runs, as in use
        while any(int(n) for n in await pool.redis.call("HVALS", "{pdr}:used")):
            await anyio.sleep(0.01)
        yield pool
        tg.cancel_scope.cancel()
    await pool.redis.aclose()


async def counts(server: RedisServer, pool: SharedPool) -> str:
    async with Redis(parse_url(server.url), timeout=10.0) as redis:
        used = sum(int(v) for v in await redis.call("HVALS", "{pdr}:used"))
        models = await redis.call("SMEMBERS", "{pdr}:queues")
        queued = sum([await redis.call("ZCARD", b"{pdr}:queue:" + m) for m in models])
        known = await redis.call("HKEYS", "{pdr}:res:" + pool.router_id)
    missing = len(set(pool._held) - {resid.decode() for resid in known})
    return (
        f"{used}/{pool.in_use}"
        + (f" q{queued}/{pool.queue_depth}" if queued or pool.queue_depth else "")
        + (f" m{missing}" if missing else "")
    )


Fault = Callable[[RedisServer, SharedPool], Awaitable[str]]


async def sleep(server: RedisServer, pool: SharedPool) -> str:
    sleeper = await raw(server.port, "DEBUG", "SLEEP", "3")
    refused = await give_up(pool, 6)
    await sleeper.receive()
    await sleeper.aclose()
    return f"{refused}/6 refused"


async def waiters(server: RedisServer, pool: SharedPool) -> str:
    held = [await pool.acquire(0) for _ in range(4)]
    sleeper = await raw(server.port, "DEBUG", "SLEEP", "3")
    refused = await give_up(pool, 3, timeout=30)
    await sleeper.receive()
    await sleeper.aclose()
    for reservation in held:
        reservation.release()
    await anyio.sleep(0.3)  # their releases sent
    return f"{refused}/3 refused"


async def pause(server: RedisServer, pool: SharedPool) -> str:
    pauser = await raw(server.port, "CLIENT", "PAUSE", "3000", "ALL")
    refused = await give_up(pool, 4)
    await anyio.sleep(3)
    await pauser.aclose()
    return f"{refused}/4 refused"


async def killed(server: RedisServer, pool: SharedPool) -> str:
    killer = await raw(server.port)
    sleeper = await raw(server.port, "DEBUG", "SLEEP", "0.8")
    refused = 0
    async with anyio.create_task_group() as tg:

        async def go() -> None:
            nonlocal refused
            refused = await give_up(pool, 3)

        tg.start_soon(go)
        await anyio.sleep(0.3)
        await send(killer, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    await killer.aclose()
    await sleeper.aclose()
    return f"{refused}/3 refused"


async def restart(server: RedisServer, pool: SharedPool) -> str:
    done = await sleep(server, pool)
    server.stop()
    server.start()
    return done


async def main() -> None:
    faults: list[tuple[str, Fault]] = [
        ("DEBUG SLEEP 3, 6 acquires", sleep),
        ("DEBUG SLEEP 3, 3 waiters", waiters),
        ("CLIENT PAUSE 3000, 4 acquires", pause),
        ("CLIENT KILL as they ran, 3", killed),
        ("restart (saved) after DEBUG SLEEP", restart),
    ]
    print("slots in use, Redis's count / the router's (q: queue entries, Redis / router)")
    print(f"{'fault':38} {'refused':12}" + "".join(f"{f'+{t:g} s':>14}" for t in AT))
    for name, fault in faults:
        with RedisServer(debug=True, persistence=True) as server:
            async with router(server.url) as pool:
                refused = await fault(server, pool)
                woke = anyio.current_time()
                row = []
                for at in AT:
                    await anyio.sleep(max(0.0, woke + at - anyio.current_time()))
                    row.append(await counts(server, pool))
                print(f"{name:38} {refused:12}" + "".join(f"{c:>14}" for c in row), flush=True)
    with RedisServer(debug=True) as server:
        proxy = DroppingProxy(server.port)
        async with anyio.create_task_group() as tg:
            port = await tg.start(proxy.serve)
            async with router(f"redis://127.0.0.1:{port}/0") as pool:
                proxy.dropping = True
                refused = await give_up(pool, 3)
                proxy.dropping = False
                woke = anyio.current_time()
                row = []
                for at in AT:
                    await anyio.sleep(max(0.0, woke + at - anyio.current_time()))
                    row.append(await counts(server, pool))
            tg.cancel_scope.cancel()
        name = "reply lost after the script ran, 3"
        print(f"{name:38} {f'{refused}/3 refused':12}" + "".join(f"{c:>14}" for c in row))
    await failover()


async def failover() -> None:
    with RedisServer() as old, RedisServer(replica_of=old.port) as new:
        proxy = DroppingProxy(old.port)
        async with anyio.create_task_group() as tg:
            port = await tg.start(proxy.serve)
            async with (
                router(f"redis://127.0.0.1:{port}/0") as pool,
                Redis(parse_url(old.url), timeout=10.0) as master,
                Redis(parse_url(new.url), timeout=10.0) as promoted,
            ):
                held = [await pool.acquire(0) for _ in range(3)]
                await master.call("WAIT", "1", "10000")
                await promoted.call("REPLICAOF", "NO", "ONE")
                held.pop().release()
                await anyio.sleep(0.3)  # its release sent
                held += [await pool.acquire(0), await pool.acquire(0)]
                tg.start_soon(give_up, pool, 1, 30.0)
                while not pool.queue_depth:
                    await anyio.sleep(0.01)
                proxy.port = new.port
                old.kill()
                woke = anyio.current_time()
                row = []
                for at in AT:
                    await anyio.sleep(max(0.0, woke + at - anyio.current_time()))
                    row.append(await counts(new, pool))
                for reservation in held:
                    reservation.release()
                tg.cancel_scope.cancel()
        name = "failover: 1 release, 2 acquires, 1 waiter"
        print(f"{name:38} {'-':12}" + "".join(f"{c:>14}" for c in row))


if __name__ == "__main__":
    anyio.run(main)

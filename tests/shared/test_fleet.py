"""The fleet shared on a real redis-server (``shared/fleet.py``): several "routers" (a fleet,
a shared pool and a shared fleet each, as each router process has) in one event loop,
under asyncio and trio. Ids the same on every router and kept across restarts, admin
changes everywhere within a second, deaths and readmissions everywhere, every router's
requests per node, and a Redis that lost the fleet getting it back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from pd_router.discovery.loop import apply
from pd_router.discovery.rules import Answer, Discovery, Group, parse_dns_spec
from pd_router.errors import Evidence, NodeDead, StateUnavailable
from pd_router.fleet.membership import Conflict, Record
from pd_router.fleet.nodes import Failure, HealthPolicy, Node, State, make_nodes
from pd_router.fleet.registry import Fleet
from pd_router.shared.fleet import _PUT_IN_FLIGHT as PUT_IN_FLIGHT
from pd_router.shared.fleet import _VERDICT as VERDICT
from pd_router.shared.fleet import PRUNE_BATCH, REMOVED_KEPT, SharedFleet
from pd_router.shared.pool import SharedPool
from pd_router.shared.redis import Redis, Script, parse_url
from tests.fleet.test_registry import Request
from tests.redis_server import DroppingProxy, RedisServer

pytestmark = pytest.mark.anyio

P0, D0, D1, D2 = "http://p0:1", "http://d0:1", "http://d1:1", "http://d2:1"
REFUSED = Failure("unreachable", "connection refused", Evidence.FATAL)


@asynccontextmanager
async def router(
    server: RedisServer,
    prefill: Sequence[str] = (P0,),
    decode: Sequence[str] = (D0, D1),
    lease: float = 10.0,
    slots: int = 2,
    url: str | None = None,
    kept: float = REMOVED_KEPT,
) -> AsyncIterator[SharedFleet]:
    """One router's fleet with its shared pool and shared fleet, background work running,
    on ``server`` (through ``url``, if given)."""
    first = make_nodes(prefill, 1, role="prefill")
    client = Redis(parse_url(url or server.url), timeout=1.0)
    fleet = Fleet(
        first,
        make_nodes(decode, slots, first_id=len(first)),
        HealthPolicy(unhealthy_after=3, healthy_after=2),
        pool=lambda nodes: SharedPool(nodes, client, lease),
    )
    assert isinstance(fleet.pool, SharedPool)
    shared = SharedFleet(fleet, fleet.pool, kept=kept)
    async with anyio.create_task_group() as tg:
        for _, work in [*fleet.pool.background(), *shared.background()]:
            tg.start_soon(work)
        await until(lambda: fleet.pool.available)
        try:
            yield shared
        finally:
            tg.cancel_scope.cancel()
    await client.aclose()


async def until(check: Callable[[], bool], seconds: float = 5.0) -> float:
    """Seconds until ``check`` held."""
    started = anyio.current_time()
    with anyio.fail_after(seconds):
        while not check():
            await anyio.sleep(0.005)
    return anyio.current_time() - started


def ids(shared: SharedFleet) -> dict[str, int]:
    return {node.url: node.id for node in shared.fleet.nodes}


def state(shared: SharedFleet, url: str) -> State | None:
    return next((n.state for n in shared.fleet.nodes if n.url == url), None)


async def test_every_router_gives_a_url_the_same_id_and_a_restart_keeps_them(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server, decode=[D0, D1]) as a:
        async with router(redis_server, decode=[D1, D2, D0]) as b:
            assert ids(a) == {P0: 0, D0: 1, D1: 2, D2: 3}, "b's new node is a's too"
            assert ids(b) == ids(a)
            added = await b.add("http://d9:1", "decode", 3, {"zone": "x"})
            assert added.id == 4
            await until(lambda: ids(a).get("http://d9:1") == 4, 1.0)
            d1 = a.fleet.node(2)
            assert d1 is not None
            await a.drain(d1)
            await until(lambda: state(b, D1) is State.DRAINING, 1.0)
            await b.remove(b.fleet.node(2) or d1, False)
            await until(lambda: a.fleet.node(2) is None, 1.0)
            again = await a.add(D1, "decode", 2, {})
            assert again.id == 2, "an URL added again keeps its id"
            await a.drain(again)
            await a.remove(again, False)
    # Every router stopped; they start again from their flags alone.
    async with router(redis_server, decode=[D0, D1]) as c:
        assert ids(c) == {P0: 0, D0: 1, D2: 3, "http://d9:1": 4}, "d1 stays removed"
        d9 = c.fleet.node(4)
        assert d9 is not None and d9.slots == 3 and d9.labels == {"zone": "x"}


async def test_the_slot_pool_counts_the_fleets_slots_whatever_a_routers_flags_say(
    redis_server: RedisServer, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async def slots_in_redis() -> int:
        return int(await redis.call("HGET", "{pdr}:slots", D0))

    async with router(redis_server, slots=2) as a, router(redis_server, slots=8) as b:
        assert [n.slots for n in b.fleet.pool.nodes] == [2, 2], "the fleet's, not b's flags"
        assert "the shared fleet has 2 slots, this router's flags 8" in caplog.text
        await b.pool._renew()
        assert await slots_in_redis() == 2
        await b.add(D0, "decode", 4, {})  # an operator changes them, for every router
        await until(lambda: [n.slots for n in a.fleet.pool.nodes] == [4, 2], 1.0)
        await a.pool._renew()
        assert await slots_in_redis() == 4


async def test_a_node_found_dead_is_dead_everywhere_and_each_router_fails_only_its_own(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server) as a, router(redis_server) as b:
        a_d0, b_d0 = a.fleet.node(1), b.fleet.node(1)
        assert a_d0 is not None and b_d0 is not None
        on_a, on_b, elsewhere = Request("on-a"), Request("on-b"), Request("on-b-d1")
        with (
            a.fleet.bind(on_a, a_d0),
            b.fleet.bind(on_b, b_d0),
            b.fleet.bind(elsewhere, b.fleet.pool.nodes[1]),
        ):
            a.fleet.failed(a_d0, REFUSED, reporter=on_a)  # a's own request saw it
            took = await until(lambda: b_d0.state is State.DEAD, 1.0)
            assert on_a.errors == [], "the reporter deals with its own error"
            assert [type(e) for e in on_b.errors] == [NodeDead] and elsewhere.errors == []
            assert "found by router " + a.router_id in (b_d0.last_error or "")
        for _ in range(2):
            b.fleet.probed(b_d0)
        await until(lambda: a_d0.state is State.SERVING, 1.0)
        a.fleet.failed(a_d0, REFUSED)
        await until(lambda: b_d0.state is State.DEAD, 1.0)
        await b.drain(b_d0)
        await b.remove(b_d0, False)
        added = await a.add(D0, "decode", 2, {})
        # Added again: afresh, joining (it serves from its first good probe).
        assert added.id == 1 and added.state is State.JOINING
    assert took < 1.0
    async with router(redis_server) as c:
        assert state(c, D0) is State.SERVING


async def test_a_node_removed_and_added_again_starts_afresh_on_a_router_that_missed_it(
    redis_server: RedisServer, redis: Redis
) -> None:
    """A router whose reloads come after both the removal and the add (its messages late)
    sees only the node back: it starts afresh there too, not dead from before."""
    async with router(redis_server) as a, router(redis_server) as b:
        a_d0, b_d0 = a.fleet.node(1), b.fleet.node(1)
        assert a_d0 is not None and b_d0 is not None
        a.fleet.failed(a_d0, REFUSED)
        await until(lambda: b_d0.state is State.DEAD, 1.0)
        heard = anyio.Event()
        a_reload = a._reload

        async def late() -> None:
            await heard.wait()
            await a_reload()

        a._reload = late  # type: ignore[method-assign]
        await b.drain(b_d0)
        await b.remove(b_d0, False)
        added = await a.add(D0, "decode", 2, {})
        heard.set()
        assert added.id == 1 and added.state is State.JOINING and added is not a_d0
        await until(lambda: state(b, D0) is State.JOINING, 1.0)


async def test_a_verdict_in_flight_on_a_removed_node_misses_it_added_again(
    redis_server: RedisServer, redis: Redis
) -> None:
    """A death found before the removal, reaching Redis after the add, was on the node's
    previous incarnation: the one added again joins on every router all the same."""
    async with router(redis_server) as a, router(redis_server) as b:
        a_d0, b_d0 = a.fleet.node(1), b.fleet.node(1)
        assert a_d0 is not None and b_d0 is not None
        await b.drain(b_d0)
        await until(lambda: a_d0.state is State.DRAINING, 1.0)
        sent = anyio.Event()
        a_run = a._run

        async def late(script: Script, args: Sequence[str | bytes]) -> Any:
            if script is VERDICT:
                await sent.wait()
            return await a_run(script, args)

        a._run = late  # type: ignore[method-assign]
        a.fleet.failed(a_d0, REFUSED)
        await b.remove(b_d0, False)
        added = await b.add(D0, "decode", 2, {})
        sent.set()
        await until(lambda: not a._unsent, 1.0)
        assert await redis.call("HGET", "{pdr}:health", "1") is None
        await b._reload()
        assert state(b, D0) is added.state is State.JOINING
        await until(lambda: state(a, D0) is State.JOINING, 1.0)


async def test_every_routers_requests_per_node_are_seen_by_each(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server) as a, router(redis_server) as b:
        d0 = b.fleet.node(1)
        assert d0 is not None
        x, y = Request("x"), Request("y")
        with b.fleet.bind(x, d0), b.fleet.bind(y, d0):
            await until(lambda: b._published == {1: 2}, 3.0)
            counts = await a.in_flight()
            assert counts[b.router_id] == {1: 2} and counts[a.router_id][1] == 0
            node = a.fleet.node(1)
            assert node is not None
            await a.drain(node)
            with pytest.raises(ValueError, match="2 requests in flight on other routers"):
                await a.remove(node, False)
            await a.remove(node, True)
            await until(lambda: b.fleet.node(1) is None, 1.0)
        assert [len(x.errors), len(y.errors)] == [1, 1], "forced: each failed, once"


async def fields(redis: Redis, key: str) -> list[bytes]:
    return sorted((await redis.call("HGETALL", "{pdr}:" + key))[::2])


async def test_a_removed_nodes_record_is_dropped_after_a_while_and_its_removal_stands(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Every pod a rollout replaces leaves a removed node behind; its record goes once
    kept long enough (reloads read only the fleet that is), and the removal still holds for
    a router restarted with the URL in its flags; an add brings it back under its id, and
    no other URL ever gets that id."""
    await redis.call("FLUSHALL")
    async with router(redis_server, decode=[D0, D1], kept=0.0) as a, router(redis_server) as b:
        await b.prune()  # as every router does at its reconciliations: b knows of pruning
        a_d1 = node_on(a, 2)
        await a.drain(a_d1)
        await a.remove(a_d1, False)
        await redis.call("HSET", "{pdr}:health", "2", b'{"state": "dead"}')
        await until(lambda: state(b, D1) is None)
        assert await a.prune() == 1 and await a.prune() == 0
        assert await fields(redis, "nodes") == [b"0", b"1"]
        for key in ("admin", "removed-at", "health"):
            assert b"2" not in await fields(redis, key), key
        assert D1.encode() not in await fields(redis, "slots") + await fields(redis, "used")
        assert await redis.call("HGET", "{pdr}:node-ids", "decode " + D1) == b"2"
        await b._reload()
        await a._reload()
        assert 2 not in a.records and 2 not in b.records and state(b, D1) is None
        # A verdict found on it before the prune, sent after: dropped, not kept for ever.
        assert not await a._run(VERDICT, [a.router_id, "2", b'{"state": "dead"}', ""])
        assert b"2" not in await fields(redis, "health")
        async with router(redis_server, decode=[D0, D1]) as c:
            assert state(c, D1) is None, "a router with it in its flags: still removed"
            assert ids(c) == {P0: 0, D0: 1}
            # An id counter lost meanwhile starts again past every id given, pruned ones too.
            await redis.call("DEL", "{pdr}:next-id")
            d2 = await c.add(D2, "decode", 2, {})
            assert d2.id == 3
            back = await c.add(D1, "decode", 2, {})
            assert back.id == 2 and back.state is State.JOINING
            await until(lambda: state(a, D1) is State.JOINING and state(b, D1) is not None)
        assert await fields(redis, "pruned") == []


async def test_a_removal_outlives_redis_losing_the_fleet(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Redis restarts empty after an operator removed a node: the routers put it back as
    removed, under its id, and a router started with it in its flags finds it removed."""
    await redis.call("FLUSHALL")
    async with router(redis_server, decode=[D0, D1, D2]) as a:
        d2 = node_on(a, 3)
        await a.drain(d2)
        await a.remove(d2, False)
        await until(lambda: state(a, D2) is None)
        await redis.call("FLUSHALL")
        await a.pool._renew()  # what its next renewal does: it registers again
        assert await redis.call("HGET", "{pdr}:admin", "3") == b"removed"
        async with router(redis_server, decode=[D0, D2]) as c:
            assert state(c, D2) is None and state(a, D2) is None
            added = await c.add("http://d9:1", "decode", 2, {})
            assert added.id == 4, "the removed node's id is not given again"


async def test_a_pruned_removal_outlives_redis_losing_the_fleet(
    redis_server: RedisServer, redis: Redis
) -> None:
    """The routers that heard of the prune put the removal back with the fleet: a router
    started with the URL in its flags finds it removed, not a node to serve."""
    await redis.call("FLUSHALL")
    async with router(redis_server, decode=[D0, D1, D2], kept=0.0) as a:
        d2 = node_on(a, 3)
        await a.drain(d2)
        await a.remove(d2, False)
        assert await a.prune() == 1
        await a._reload()
        await redis.call("FLUSHALL")
        await a.pool._renew()  # what its next renewal does: it registers again
        assert await redis.call("HGET", "{pdr}:admin", "3") == b"removed"
        async with router(redis_server, decode=[D0, D2]) as c:
            assert state(c, D2) is None and state(a, D2) is None


async def test_nothing_is_pruned_while_a_router_of_an_older_version_lives(
    redis_server: RedisServer, redis: Redis
) -> None:
    """One that does not prune takes a node without a record for one it may serve; and a
    verdict on a node with a record is taken whatever an older router left in ``pruned``."""
    await redis.call("FLUSHALL")
    async with router(redis_server, kept=0.0) as a:
        older = "older-router"
        seconds, micros = await redis.call("TIME")
        lease_end = int(seconds) * 1000 + int(micros) // 1000 + 3_600_000
        await redis.call("HSET", "{pdr}:routers", older, str(lease_end))
        d1 = node_on(a, 2)
        await a.drain(d1)
        await a.remove(d1, False)
        assert [await a.prune(), await a.prune()] == [0, 0]
        await redis.call("HDEL", "{pdr}:routers", older)
        assert await a.prune() == 1
        await a.add(D1, "decode", 2, {})
        await redis.call("HSET", "{pdr}:pruned", "2", "removed")  # as an older router's add
        assert await a._run(VERDICT, [a.router_id, "2", b'{"state": "dead"}', ""]) == 1


async def test_a_router_that_missed_a_removal_follows_it_after_the_record_was_dropped(
    redis_server: RedisServer, redis: Redis
) -> None:
    """b hears nothing while the node is removed and its record dropped: its next reload
    finds the removal all the same and fails what runs there, once (the removal was
    forced)."""
    await redis.call("FLUSHALL")
    async with router(redis_server, kept=0.0) as a, router(redis_server) as b:
        await b.prune()
        b_d1 = node_on(b, 2)
        heard = anyio.Event()
        b_reload, b_run = b._reload, b._run

        async def late() -> None:
            await heard.wait()
            await b_reload()

        async def unheard(script: Script, args: Sequence[str | bytes]) -> Any:
            return 1 if script is PUT_IN_FLIGHT else await b_run(script, args)

        b._reload = late  # type: ignore[method-assign]
        b._run = unheard  # type: ignore[method-assign]
        await redis.call("DEL", "{pdr}:in-flight:" + b.router_id)  # as when its lease ran out
        request = Request("r1")
        with b.fleet.bind(request, b_d1):
            a_d1 = node_on(a, 2)
            await a.drain(a_d1)
            await a.remove(a_d1, True)
            assert await a.prune() == 1
            assert state(b, D1) is State.SERVING, "b heard nothing"
            heard.set()
            await b._reload()
            assert [type(e) for e in request.errors] == [NodeDead], "forced: failed once"
            assert state(b, D1) is None
        await b._reload()
        assert 2 not in b.records and await fields(redis, "nodes") == [b"0", b"1"]


async def test_a_node_with_requests_still_on_it_keeps_its_record(
    redis_server: RedisServer, redis: Redis
) -> None:
    """A request that started on b after the removal's count runs on, the node drained
    there: its record stays while b counts it (so an operator can still force it out),
    and goes once the request ended, the node's slots with it."""
    await redis.call("FLUSHALL")
    async with router(redis_server, kept=0.0) as a, router(redis_server) as b:
        await b.prune()
        b_d1, a_d1 = node_on(b, 2), node_on(a, 2)
        request = Request("r2")
        with b.fleet.bind(request, b_d1):
            await a.drain(a_d1)
            a.in_flight = noop_counts  # type: ignore[method-assign]  # b's count not in yet
            await a.remove(a_d1, False)
            await until(lambda: 2 not in ids(a).values())
            await b._reload()
            assert state(b, D1) is State.DRAINING, "kept under the request it runs"
            await until(lambda: b._published == {2: 1}, 10.0)
            assert [await a.prune(), await a.prune()] == [0, 0], "b counts a request there"
            await b.remove(b_d1, True)
            await b._reload()
            assert [type(e) for e in request.errors] == [NodeDead]
        await until(lambda: not b._published, 10.0)
        assert await a.prune() == 1
        assert D1.encode() not in await fields(redis, "slots") + await fields(redis, "used")


async def test_removed_records_left_by_an_older_version_go_a_batch_at_a_time(
    redis_server: RedisServer, redis: Redis
) -> None:
    await redis.call("FLUSHALL")
    async with router(redis_server, kept=0.0) as a:
        many = PRUNE_BATCH + 10
        for i in range(100, 100 + many):
            record = Record(i, "decode", f"http://10.0.{i >> 8}.{i & 255}:1", 2)
            await redis.call("HSET", "{pdr}:nodes", str(i), record.body())
            await redis.call("HSET", "{pdr}:admin", str(i), "removed")
        assert await a.prune() == 0, "timed from the first look"
        assert [await a.prune(), await a.prune()] == [PRUNE_BATCH, 10]
        assert await fields(redis, "nodes") == [b"0", b"1", b"2"]


async def noop_counts() -> dict[str, dict[int, int]]:
    return {}


async def test_a_redis_that_lost_the_fleet_gets_it_back(
    redis_server: RedisServer, redis: Redis
) -> None:
    async with router(redis_server, decode=[D0, D1]) as a:
        await a.add(D2, "decode", 2, {})
        d0 = a.fleet.node(1)
        assert d0 is not None
        await a.drain(d0)
        before = ids(a)
        await redis.call("FLUSHALL")
        await a.pool._renew()  # what its next renewal does: it registers again
        assert ids(a) == before == {P0: 0, D0: 1, D1: 2, D2: 3}, "under the same ids"
        assert state(a, D0) is State.DRAINING
        await redis.call("FLUSHALL")
        # A new router takes ids before the others notice: every router follows Redis's.
        async with router(redis_server, decode=[D2]) as b:
            await until(lambda: ids(a) == ids(b) and len(ids(b)) == 4)
            assert state(b, D0) is State.DRAINING


async def test_redis_away_leaves_the_local_fleet_and_admin_changes_get_a_clear_error(
    redis: Redis,
) -> None:
    with RedisServer() as server:
        async with router(server) as a:
            server.kill()
            node = a.fleet.node(1)
            assert node is not None
            with pytest.raises(StateUnavailable):
                await a.drain(node)
            a.fleet.failed(node, REFUSED)  # found while Redis is away: sent when it is back
            assert ids(a) == {P0: 0, D0: 1, D1: 2} and node.state is State.DEAD
            server.start()
            async with router(server) as b:
                await until(lambda: state(b, D0) is State.DEAD, 3.0)


@pytest.mark.parametrize(
    "lie", [b"+OK\r\n", b"$-1\r\n", b"*1\r\n:1\r\n"], ids=["status", "nil", "list"]
)
async def test_admin_changes_answered_what_no_script_says_get_a_clear_error(
    redis_server: RedisServer, redis: Redis, lie: bytes
) -> None:
    """Every call answered through a proxy with what none of the fleet's scripts says (a
    proxy's own answer, a server that is not Redis): a drain, a removal and an addition
    each fail as after a lost reply (the admin's 503: whether it ran is not known), none
    claimed done nor refused; once the answers are true again, the router's fleet is what
    Redis holds. Before, a drain answered "+OK" was reported done, one answered nil was
    refused as "not in the shared fleet", and a removal failed on the reply's bytes (a
    500)."""
    proxy = DroppingProxy(redis_server.port)
    async with anyio.create_task_group() as tg:
        port = await tg.start(proxy.serve)
        async with router(redis_server, url=f"redis://127.0.0.1:{port}/0") as a:
            d0, d1 = a.fleet.node(1), a.fleet.node(2)
            assert d0 is not None and d1 is not None
            await a.drain(d1)  # answered truly: the removal below is then allowed
            proxy.lying = lie
            for change in (
                lambda: a.drain(d0),
                lambda: a.remove(d1, False),
                lambda: a.add("http://d9:1", "decode", 2, {}),
            ):
                with pytest.raises(StateUnavailable, match="not the script's"):
                    await change()
            assert proxy.lied >= 3
            proxy.lying = None
            # The scripts ran behind the proxy: the router learns it from Redis.
            await until(lambda: state(a, D0) is State.DRAINING, 15.0)
            await until(lambda: ids(a) == {P0: 0, D0: 1, "http://d9:1": 3}, 15.0)
        tg.cancel_scope.cancel()


async def test_one_router_probes_for_the_fleet_and_another_takes_over_when_it_stops(
    redis_server: RedisServer, redis: Redis
) -> None:
    # A router that died holding the prober lease: it lapses within a second.
    await redis.call("SET", "{pdr}:prober", "dead-router", "PX", "1000")
    async with router(redis_server, lease=1.0) as a:
        assert not a.may_probe()
        took = await until(a.may_probe, 3.0)
        assert took > 0.3, "not before the dead router's lease lapsed"
        async with router(redis_server, lease=1.0) as b:
            await anyio.sleep(1.0)
            assert a.may_probe() and not b.may_probe(), "one prober for the fleet"


async def test_dns_discovery_through_the_shared_fleet_keeps_one_id_and_the_operators_drain(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Two routers discovering one address get one node, one id; a DNS drain is undone by
    the address's return but an operator's drain is not; a removal waits for the other
    router's requests; an address back after its removal keeps its id."""
    source = "dns:decode.test:8200"
    async with router(redis_server, decode=[D0]) as a, router(redis_server, decode=[D0]) as b:
        found = await a.discovered(D2, "decode", 4, {"zone": "a"}, source)
        assert found is not None and found.state is State.JOINING and found.source == source
        again = await b.discovered(D2, "decode", 4, {"zone": "a"}, source)
        assert again is not None and again.id == found.id
        assert [n.url for n in b.fleet.nodes].count(D2) == 1
        # A good probe on one router admits the node on the other.
        a.fleet.probed(found)
        await until(lambda: state(b, D2) is State.SERVING)
        # Gone from a's lookups: drained everywhere, and back: joining again everywhere.
        await a.gone(found)
        await until(lambda: state(b, D2) is State.DRAINING)
        assert await a.back(found)
        await until(lambda: state(b, D2) is State.JOINING)
        # An operator's drain is neither marked as DNS's nor undone by a return.
        await b.drain(again)
        await until(lambda: state(a, D2) is State.DRAINING)
        await a.gone(found)
        assert not await a.back(found)
        assert state(a, D2) is State.DRAINING
        # Gone for good: the removal waits while b has a request on it.
        with b.fleet.bind(Request("r1"), again):
            await counted(a, b, found.id, 1)
            with pytest.raises(ValueError, match="1 requests in flight on other routers"):
                await a.retire(found, force=False)
        await counted(a, b, found.id, 0)
        await a.retire(found, force=False)
        await until(lambda: state(b, D2) is None)
        # Listed again after its removal: registered again under the same id.
        back = await b.discovered(D2, "decode", 4, {"zone": "a"}, source)
        assert back is not None and (back.id, back.state) == (found.id, State.JOINING)
        await until(lambda: state(a, D2) is State.JOINING)


async def counted(asker: SharedFleet, other: SharedFleet, node_id: int, count: int) -> None:
    """Until ``asker`` reads ``count`` requests of ``other``'s on the node."""
    with anyio.fail_after(5):
        while (await asker.in_flight()).get(other.router_id, {}).get(node_id, 0) != count:
            await anyio.sleep(0.05)


BOTH, ONLY_D0 = Answer(frozenset({D0, D2})), Answer(frozenset({D0}))


class Lookups:
    """Routers each following a name's answers with the discovery loop's rule (``apply``),
    a node that joins probed good at once."""

    def __init__(self, *routers: SharedFleet) -> None:
        spec = parse_dns_spec("decode.test:1", "decode")
        self.of = {r: Discovery([Group(spec)], drain_timeout=60) for r in routers}

    async def look(self, r: SharedFleet, answer: Answer) -> None:
        for node in await apply(self.of[r].groups[0], answer, r.fleet, self.of[r], r):
            r.fleet.probed(node)

    async def listed_by_all(self) -> int:
        """Every router's lookup lists D0 and D2: D2's id, the same on all."""
        for r in self.of:
            await self.look(r, BOTH)
        (d2,) = {ids(r)[D2] for r in self.of}
        return d2


def node_on(r: SharedFleet, node_id: int) -> Node:
    node = r.fleet.node(node_id)
    assert node is not None, f"node {node_id} is not on router {r.router_id}"
    return node


async def test_routers_whose_lookups_differ_never_fail_a_request_nor_duplicate_a_node(
    redis_server: RedisServer, redis: Redis
) -> None:
    """The discovery loop's rule with --state: a router whose lookup lost an address drains
    it for the fleet and removes it once no router has a request on it; one that still
    lists it registers it again, under its id, after the removal."""
    async with router(redis_server, decode=[]) as a, router(redis_server, decode=[]) as b:
        found = Lookups(a, b)
        look, both, only_d0 = found.look, BOTH, ONLY_D0
        d2 = await found.listed_by_all()
        assert ids(a) == ids(b) and len(b.fleet.pool.nodes) == 2
        b_d2 = node_on(b, d2)
        request = Request("r1")
        with b.fleet.bind(request, b_d2):
            await counted(a, b, d2, 1)
            await look(a, only_d0)  # a's view: D2 gone; b still lists it
            assert state(a, D2) is State.DRAINING, "not removed under b's request"
            await until(lambda: state(b, D2) is State.DRAINING)
            await look(b, both)
            assert state(b, D2) is State.DRAINING, "b leaves a's drain alone"
        assert request.errors == []
        await counted(a, b, d2, 0)
        await look(a, only_d0)
        await until(lambda: state(b, D2) is None)
        await look(b, both)  # b lists it still: the same node, back
        await until(lambda: state(a, D2) is State.SERVING)
        assert ids(a) == ids(b) and ids(b)[D2] == d2 and len(a.fleet.pool.nodes) == 2


async def test_a_drain_another_router_undid_is_not_forced_into_a_removal(
    redis_server: RedisServer, redis: Redis
) -> None:
    """b's lookups lost an address and drained its node for the fleet; a's lost it briefly
    and, listing it again, undid the drain: the node serves everywhere. b's drain bound
    then runs out: b must not remove it (that would fail a's requests on it), and lets it
    go from its name."""
    async with router(redis_server, decode=[]) as a, router(redis_server, decode=[]) as b:
        found = Lookups(a, b)
        look, both, only_d0 = found.look, BOTH, ONLY_D0
        d2 = await found.listed_by_all()
        a_d2 = node_on(a, d2)
        request = Request("r1")
        with a.fleet.bind(request, a_d2):
            await counted(b, a, d2, 1)
            found.of[b].drain_timeout = 60.0
            await look(b, only_d0)  # drained for the fleet, kept under a's request
            await until(lambda: state(a, D2) is State.DRAINING)
            await look(a, only_d0)
            await look(a, both)  # a lists it again: a's return undoes the drain
            await until(lambda: state(b, D2) in (State.JOINING, State.SERVING))
            # Had b not heard yet, Redis refuses its forced removal all the same.
            with pytest.raises(Conflict):
                await b.retire(node_on(b, d2), force=True)
            found.of[b].drain_timeout = 0.0  # b's bound runs out at its next sweep
            await look(b, only_d0)
            await look(b, only_d0)
            assert state(b, D2) is not None and state(a, D2) is not None
            assert request.errors == []
        assert D2 not in found.of[b].groups[0].members


async def test_bad_values_in_the_fleets_keys_are_logged_and_serving_goes_on(
    redis_server: RedisServer, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A count of requests in flight that is not one is logged and skipped (the admin API
    still answers); an id counter that does not count starts again past the ids taken;
    an admin change that fails on the store's data answers with no script's error text."""
    await redis.call("FLUSHALL")
    async with router(redis_server) as a:
        await redis.call("HSET", "{pdr}:in-flight:ghost", "1", "many")
        await redis.call("HSET", "{pdr}:routers", "ghost", "99999999999999")
        counts = await a.in_flight()
        assert counts["ghost"] == {} and counts[a.router_id][1] == 0
        assert any("'many'" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
        await redis.call("SET", "{pdr}:next-id", "not a counter")
        added = await a.add("http://d9:1", "decode", 1, {})
        assert added.id == 3, "the next id past those taken (0, 1, 2)"
        assert any("{pdr}:next-id" in r.getMessage() for r in caplog.records)
        await redis.call("SET", "{pdr}:admin", "not a hash")
        with pytest.raises(StateUnavailable) as caught:
            await a.drain(added)
        assert "script" not in caught.value.message and "WRONGTYPE" in caught.value.message
        await redis.call("DEL", "{pdr}:admin", "{pdr}:in-flight:ghost")
        await redis.call("HDEL", "{pdr}:routers", "ghost")


async def test_an_admin_change_another_router_overtook_is_refused_not_applied(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Each router checks an operator's change against what it last heard of the fleet;
    Redis applies it only if the fleet's state is still that. A drain on a router that had
    not heard of a removal through another brought the removed node back, draining, for
    good; a removal checked on a stale "draining" removed a node another router had just
    added again, serving. Both are now refused (``Conflict``: 409 ``conflict``)."""
    async with router(redis_server) as a, router(redis_server) as b:
        a_d0, b_d0 = a.fleet.node(1), b.fleet.node(1)
        assert a_d0 is not None and b_d0 is not None
        await a.drain(a_d0)
        await until(lambda: b_d0.state is State.DRAINING, 1.0)
        # B's reloads come late: it goes on seeing the node draining.
        b_reload = b._reload
        b._reload = noop  # type: ignore[method-assign]
        await a.remove(a_d0, False)
        with pytest.raises(Conflict):
            await b.drain(b_d0)
        assert await redis.call("HGET", "{pdr}:admin", "1") == b"removed"
        # Added again through A, serving: B's stale view says draining, its removal is refused.
        added = await a.add(D0, "decode", 2, {})
        assert added.id == 1
        with pytest.raises(Conflict):
            await b.remove(b_d0, False)
        assert await redis.call("HGET", "{pdr}:admin", "1") == b"serving"
        b._reload = b_reload  # type: ignore[method-assign]


async def noop() -> None:
    pass

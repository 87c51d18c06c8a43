"""Three router processes sharing one fleet on a real Redis (``--state``), in front of
simulated engines: an admin change through one router is on every router within about a
second and survives a restart of them all; an engine found dead by one is dead on all, and
only the requests on it fail; ``/admin/nodes`` and ``pd-router status`` show every
router's requests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from pd_router.sim.fleet import SimFleet
from tests.fleet.test_fleet_e2e import Stream, echo
from tests.helpers import RouterProcess, _redis, flush_state, wait_for
from tests.redis_server import RedisServer
from tests.test_status import rows, status

TOKEN = "fleet-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROBING = ("--health-interval", "0.2", "--unhealthy-after", "2", "--healthy-after", "2")
# A router that never probes: what it knows of the engines' health it is told.
DEAF = ("--health-interval", "0")


@pytest.fixture(scope="module")
def engines() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=2, decode_args=["--slots", "64", "--itl", "0.05"]) as fleet:
        yield fleet


@pytest.fixture
def state(redis_server: RedisServer) -> str:
    flush_state(redis_server.url)
    return redis_server.url


@contextmanager
def routers(
    engines: SimFleet, state: str, *flags: tuple[str, ...], decode: int = 2
) -> Iterator[list[RouterProcess]]:
    """One router per entry of ``flags``, each with those flags, on ``decode`` engines."""
    prefill, decodes = [e.url for e in engines.prefill], [e.url for e in engines.decode]
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                RouterProcess(
                    prefill, decodes[:decode], "--state", state, "--admin-token", TOKEN, *extra
                )
            )
            for extra in flags
        ]


def admin(router: RouterProcess, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{router.url}/admin{path}", headers=AUTH, timeout=10, **kwargs)


def fleet_of(router: RouterProcess) -> dict[str, tuple[int, str]]:
    """URL -> (id, state) as ``router`` sees the fleet."""
    nodes = admin(router, "GET", "/nodes").json()["nodes"]
    return {n["url"]: (n["id"], n["state"]) for n in nodes}


def seen_within(routers: list[RouterProcess], check: Any, seconds: float, what: str) -> float:
    """Seconds until every router's fleet passes ``check``."""
    started = time.monotonic()
    wait_for(lambda: all(check(fleet_of(r)) for r in routers), timeout=seconds, what=what)
    return time.monotonic() - started


def test_admin_changes_reach_every_router_and_survive_a_restart_of_them_all(
    engines: SimFleet, state: str
) -> None:
    d0, d1 = (e.url for e in engines.decode)
    with routers(engines, state, PROBING, PROBING, PROBING, decode=1) as (a, b, c):
        assert fleet_of(a) == fleet_of(b) == fleet_of(c)
        added = admin(a, "POST", "/nodes", json={"url": d1, "role": "decode", "slots": 8})
        assert added.status_code == 201, added.text
        new_id = added.json()["id"]
        # How soon is printed (benchmarks/state_cost.py measures it): a loaded machine
        # takes longer, and the test is that it arrives.
        took = seen_within([b, c], lambda f: f.get(d1, (None,))[0] == new_id, 60, "d1 added")
        print(f"an added node was on the two other routers after {took * 1000:.0f} ms")
        d0_id = fleet_of(a)[d0][0]
        assert admin(b, "POST", f"/nodes/{d0_id}/drain").status_code == 202
        took = seen_within([a, c], lambda f: f[d0][1] == "draining", 60, "d0 draining")
        print(f"a drain was on the two other routers after {took * 1000:.0f} ms")
        for router in (a, b, c):
            answer = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": "sim-model", "prompt": "where", "max_tokens": 2},
                timeout=10,
            )
            assert answer.status_code == 200
        assert admin(c, "DELETE", f"/nodes/{d0_id}").status_code == 200
        seen_within([a, b], lambda f: d0 not in f, 2, "d0 removed")
        ids = fleet_of(a)
    # Every router stops, and starts again from the same flags (d0 among them).
    with routers(engines, state, PROBING, PROBING, PROBING, decode=1) as restarted:
        for router in restarted:
            assert fleet_of(router) == ids, "the fleet and its ids, as the operator left them"


def test_an_engine_found_dead_by_one_router_is_dead_on_all_and_only_its_requests_fail(
    engines: SimFleet, state: str
) -> None:
    victim = engines.decode[0]
    # Only ``prober`` probes: the others know of the death only by being told.
    slots = ("--decode-slots", "8")
    with routers(engines, state, (*slots, *PROBING), DEAF, DEAF, DEAF) as rs:
        prober, told, idle, holder = rs
        victim_id = fleet_of(prober)[victim.url][0]
        streams = [Stream(holder, f"w{i} x{i} y{i}", 60, f"s{i}") for i in range(8)]
        for stream in streams:
            stream.start()
        wait_for(lambda: all(d.stats()["active"] == 4 for d in engines.decode), what="4 + 4")
        nodes = admin(holder, "GET", "/nodes").json()["nodes"]
        on_victim = set(next(n for n in nodes if n["id"] == victim_id)["bound_requests"])
        assert len(on_victim) == 4
        victim.kill()
        try:
            took = seen_within(
                [told, idle], lambda f: f[victim.url][1] == "dead", 5, "dead everywhere"
            )
            print(f"a death was on the routers that do not probe after {took * 1000:.0f} ms")
            for stream in streams:
                stream.join(60)
            for stream in streams:
                assert stream.failure is None
                if stream.rid in on_victim:
                    assert stream.status == 502 or len(stream.errors) == 1, stream.events
                    assert stream.events.count("data: [DONE]") <= 1
                else:
                    assert stream.completed() and stream.text == echo(stream.prompt, 60)
            holder.assert_idle()
        finally:
            victim.start().wait_healthy()
        seen_within([told, idle, holder], lambda f: f[victim.url][1] == "serving", 5, "back")


def test_every_router_shows_every_routers_requests_per_node(engines: SimFleet, state: str) -> None:
    flags = ("--decode-slots", "8", *DEAF)
    with routers(engines, state, flags, flags, flags) as (a, b, c):
        streams = [Stream(a, f"a{i}", 100, f"a{i}") for i in range(3)]
        streams += [Stream(b, f"b{i}", 100, f"b{i}") for i in range(2)]
        for stream in streams:
            stream.start()

        def counts() -> list[int]:
            return sorted(admin(c, "GET", "/nodes").json()["routers"].values())

        wait_for(lambda: counts() == [0, 2, 3], what="every router's requests, through c")
        document = admin(c, "GET", "/nodes").json()
        assert sum(n["fleet_in_flight"] for n in document["nodes"] if n["role"] == "decode") == 5
        assert document["in_flight"] == 0, "c itself holds none"
        shown = status("--url", c.url, token=TOKEN)
        assert shown.returncode == 0, shown.stderr
        assert "5 in flight on 3 routers" in shown.stdout
        requests = sum(int(r[5]) for r in rows(shown.stdout).values() if r[1] == "decode")
        assert requests == 5
        for stream in streams:
            stream.join(60)
            assert stream.completed()
        wait_for(lambda: counts() == [0, 0, 0], what="all done, everywhere")


def test_one_router_probes_for_the_fleet_and_another_takes_over_when_it_dies(
    engines: SimFleet, state: str
) -> None:
    slow = engines.decode[1]
    probing = "probes the engines for the fleet"
    with routers(engines, state, PROBING, PROBING, PROBING) as rs:
        wait_for(lambda: sum(probing in r.log() for r in rs) == 1, what="one prober")
        time.sleep(1.0)
        (prober,) = (r for r in rs if probing in r.log())
        others = [r for r in rs if r is not prober]
        assert all(probing not in r.log() for r in others), "one prober, however many routers"
        slow.configure(health_delay=2.0)  # its probes time out: unhealthy, for every router
        try:
            seen_within(rs, lambda f: f[slow.url][1] == "unhealthy", 10, "unhealthy everywhere")
        finally:
            slow.configure(health_delay=0.0)
        seen_within(rs, lambda f: f[slow.url][1] == "serving", 10, "readmitted everywhere")
        prober.kill()
        killed = time.monotonic()
        # Once the killed one's lease (10 s) lapsed.
        wait_for(lambda: any(probing in r.log() for r in others), what="a new prober")
        took = time.monotonic() - killed
        print(f"a new prober took over {took:.1f} s after the last one was killed")
        (second,) = (r for r in others if probing in r.log())
        (third,) = (r for r in others if r is not second)
        assert second.stop() == 0  # SIGTERM: it gives the lease up as it stops
        stopped = time.monotonic()
        # Given up, not left to lapse: no longer the stopped router's (whose lease would
        # still run for seconds), but free or taken by the third, whose log names it.
        holder = _redis(state, "GET", "{pdr}:prober")
        wait_for(lambda: probing in third.log(), what="the third router probing")
        took = time.monotonic() - stopped
        print(f"a new prober took over {took:.1f} s after the last one stopped")
        assert holder is None or f"router {holder.decode()} {probing}" in third.log(), holder


def test_redis_away_keeps_each_routers_fleet_and_on_return_the_fleet_is_put_back(
    engines: SimFleet,
) -> None:
    d1 = engines.decode[1].url
    flags = ("--decode-slots", "8", *DEAF)
    with RedisServer() as server, routers(engines, server.url, flags, flags) as (a, b):
        d1_id = fleet_of(a)[d1][0]
        assert admin(a, "POST", f"/nodes/{d1_id}/drain").status_code == 202
        seen_within([b], lambda f: f[d1][1] == "draining", 2, "drained on b")
        before = fleet_of(b)
        stream = Stream(b, "through the outage", 60, "outage")
        stream.start()
        wait_for(lambda: admin(b, "GET", "/nodes").json()["in_flight"] == 1, what="in flight")
        server.kill()
        assert fleet_of(a) == fleet_of(b) == before, "each router's fleet as it was"
        wait_for(
            lambda: admin(a, "GET", "/nodes").json().get("shared_state") == "unavailable",
            what="shared_state unavailable in /admin/nodes",
        )
        refused = admin(a, "POST", f"/nodes/{d1_id}/drain")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shared_state_unavailable"
        stream.join(30)
        assert stream.completed(), stream.events
        server.start()  # empty: the routers put the fleet back, under the same ids
        wait_for(lambda: httpx.get(f"{a.url}/health").status_code == 200, timeout=15, what="up")
        added = admin(b, "POST", "/nodes", json={"url": "http://127.0.0.1:9", "role": "decode"})
        assert (
            added.status_code == 201
            and added.json()["id"] == max(i for i, _ in before.values()) + 1
        )
        seen_within([a], lambda f: f == fleet_of(b), 2, "one fleet again")
        assert {url: v for url, v in fleet_of(a).items() if url in before} == before

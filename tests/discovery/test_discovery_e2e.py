"""Engines found through DNS, end to end: a real DNS server on 127.0.0.1
(``tests/dns_server.py``) whose records the tests change while load runs through a real
router process in front of simulated engines.

The prefill engine is found by its A record (``prefill.test:PORT``). Decode engines all
listen on 127.0.0.1, each on its own port, so they are told apart by SRV records
(``_http._tcp.decode.test``: target ``engines.test.`` and the engine's port), as a
Kubernetes headless Service's named port publishes them.
"""

from __future__ import annotations

import json
import subprocess  # nosec B404
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import anyio
import httpx
import pytest

from pd_router.shared.redis import Redis, parse_url
from pd_router.sim.fleet import EngineProcess, ServerProcess
from tests.dns_server import DnsServer
from tests.helpers import RouterProcess, flush_state, wait_for
from tests.redis_server import RedisServer

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INTERVAL = 0.3
SRV = "_http._tcp.decode.test"
BODY = {"model": "sim-model", "prompt": "found by name", "max_tokens": 12, "stream": True}


class DiscoveringRouter(RouterProcess):
    """The router with no static engine: every node comes from DNS."""

    def __init__(self, *args: str) -> None:
        ServerProcess.__init__(self, list(args))

    def nodes(self) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/admin/nodes", headers=AUTH, timeout=10)
        nodes: list[dict[str, Any]] = answer.json()["nodes"]
        return nodes

    def decode(self) -> dict[str, tuple[int, str]]:
        """Decode nodes now: URL -> (id, state)."""
        return {n["url"]: (n["id"], n["state"]) for n in self.nodes() if n["role"] == "decode"}


def records(prefill: EngineProcess, decode: Sequence[EngineProcess]) -> dict[str, Any]:
    return {
        "prefill.test.": {"A": ["127.0.0.1"]},
        "engines.test.": {"A": ["127.0.0.1"]},
        f"{SRV}.": {"SRV": [[0, 0, engine.port, "engines.test."] for engine in decode]},
    }


class Load:
    """Streaming clients in threads, each sending requests one after another until
    stopped (or 60 s); keeps every outcome that is not a whole answer."""

    def __init__(self, router: RouterProcess, clients: int = 4) -> None:
        self.router = router
        self.stopping = threading.Event()
        self.failures: list[str] = []
        self.done = 0
        self.threads = [
            threading.Thread(target=self.run, args=(0.25 * i / clients,), daemon=True)
            for i in range(clients)
        ]

    def run(self, stagger: float) -> None:
        # Clients started together would send in waves, one per answer's length (~0.25 s);
        # staggered, requests arrive all along, as the timing of a new engine's first needs.
        time.sleep(stagger)
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=30) as client:
            while not self.stopping.is_set() and time.monotonic() < deadline:
                try:
                    with client.stream(
                        "POST", f"{self.router.url}/v1/completions", json=BODY
                    ) as response:
                        text = response.read().decode()
                    if response.status_code != 200 or '"error"' in text:
                        self.failures.append(f"{response.status_code} {text[-300:]}")
                    elif not text.rstrip().endswith("data: [DONE]"):
                        self.failures.append(f"cut short: {text[-300:]}")
                    else:
                        self.done += 1
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(40)


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    with DnsServer() as server:
        yield server


@pytest.fixture
def engines() -> Iterator[tuple[EngineProcess, list[EngineProcess]]]:
    """One prefill engine and four decode engines (20 ms between tokens)."""
    prefill = EngineProcess("prefill")
    decode = [EngineProcess("decode", ["--itl", "0.02"]) for _ in range(4)]
    try:
        for engine in [prefill, *decode]:
            engine.start()
        for engine in [prefill, *decode]:
            engine.wait_healthy(30)
        yield prefill, decode
    finally:
        for engine in [prefill, *decode]:
            engine.stop()


def router_for(
    dns: DnsServer, prefill: EngineProcess, *args: str, decode: str = f"{SRV},slots=8,pool=test"
) -> DiscoveringRouter:
    return DiscoveringRouter(
        "--prefill-dns",
        f"prefill.test:{prefill.port}",
        "--decode-dns",
        decode,
        "--dns-server",
        dns.address,
        "--discovery-interval",
        str(INTERVAL),
        "--health-interval",
        "0.2",
        "--admin-token",
        TOKEN,
        "--queue-timeout",
        "10",
        *args,
    )


def requests_on(engine: EngineProcess) -> int:
    return int(engine.stats()["requests"])


def test_scale_up_then_down_under_load(
    dns: DnsServer, engines: tuple[EngineProcess, list[EngineProcess]]
) -> None:
    prefill, decode = engines
    dns.set(records(prefill, decode[:1]))
    with router_for(dns, prefill) as router, Load(router) as load:
        assert set(router.decode()) == {decode[0].url}
        wait_for(lambda: load.done >= 4, what="load on one engine")
        # Scale up 1 -> 3: each new engine gets requests (within two intervals on a quiet
        # machine: printed, and measured by benchmarks/discovery_latency.py).
        changed = time.monotonic()
        dns.set(records(prefill, decode[:3]))
        first: dict[str, float] = {}

        def all_serve() -> bool:
            for engine in decode[1:3]:
                if engine.url not in first and requests_on(engine) > 0:
                    first[engine.url] = time.monotonic() - changed
            return len(first) == 2

        wait_for(all_serve, what="traffic on the new engines")
        print(
            f"\nDNS change to first request on a new engine: {sorted(first.values())} s"
            f" (interval {INTERVAL} s)"
        )
        sources = {n["url"]: n["source"] for n in router.nodes()}
        assert {sources[e.url] for e in decode[:3]} == {f"dns:{SRV}"}
        assert sources[prefill.url] == f"dns:prefill.test:{prefill.port}"
        assert all(n["labels"] == {"pool": "test"} for n in router.nodes() if n["role"] == "decode")
        time.sleep(1)
        assert all(requests_on(engine) > 0 for engine in decode[:3])
        # Scale down 3 -> 1: streams on the two leaving engines finish (the load sees no
        # failure); they drain, then leave the fleet once empty, and get nothing after.
        ids = router.decode()
        dns.set(records(prefill, decode[:1]))
        wait_for(
            lambda: all(
                router.decode().get(e.url, (0, "gone"))[1] != "serving" for e in decode[1:3]
            ),
            what="the two leaving engines draining",
        )
        wait_for(lambda: set(router.decode()) == {decode[0].url}, what="the two removed")
        after_removal = [requests_on(engine) for engine in decode[1:3]]
        done = load.done
        wait_for(lambda: load.done >= done + 8, what="more requests")
        assert [requests_on(engine) for engine in decode[1:3]] == after_removal
        assert all(engine.stats()["active"] == 0 for engine in decode[1:3])
        assert router.decode() == {decode[0].url: ids[decode[0].url]}, "the survivor's id stays"
        metrics = router.metrics()
    assert load.failures == [], load.failures[:3]
    assert load.done > 20
    name = f"name={SRV},role=decode"
    assert metrics[f"pd_router_discovery_changes_total{{change=added,{name}}}"] == 3
    assert metrics[f"pd_router_discovery_changes_total{{change=drained,{name}}}"] == 2
    assert metrics[f"pd_router_discovery_changes_total{{change=removed,{name}}}"] == 2
    assert metrics[f"pd_router_discovery_addresses{{{name}}}"] == 1


def test_an_address_replaced_by_another(
    dns: DnsServer, engines: tuple[EngineProcess, list[EngineProcess]]
) -> None:
    prefill, decode = engines
    old, new = decode[0], decode[3]
    dns.set(records(prefill, [old, decode[1]]))
    with router_for(dns, prefill) as router, Load(router, clients=3) as load:
        wait_for(lambda: len(router.decode()) == 2 and load.done >= 4, what="two engines")
        old_id = router.decode()[old.url][0]
        dns.set(records(prefill, [new, decode[1]]))
        wait_for(lambda: set(router.decode()) == {new.url, decode[1].url}, what="old out, new in")
        wait_for(lambda: requests_on(new) > 0, what="traffic on the new engine")
        assert router.decode()[new.url][0] != old_id
        before = requests_on(old)
        time.sleep(1)
        assert requests_on(old) == before, "nothing reaches the replaced engine"
    assert load.failures == [], load.failures[:3]


def test_dns_trouble_keeps_the_fleet(
    dns: DnsServer, engines: tuple[EngineProcess, list[EngineProcess]]
) -> None:
    """An empty answer, a failed lookup and a stopped server all keep the fleet as it was,
    and are counted apart; requests are served throughout; lookups answer again after."""
    prefill, decode = engines
    dns.set(records(prefill, decode[:2]))

    def lookups(router: RouterProcess, outcome: str) -> float:
        key = f"pd_router_discovery_lookups_total{{name={SRV},outcome={outcome},role=decode}}"
        return router.metrics()[key]

    def rounds(router: RouterProcess, outcome: str, count: int = 3) -> None:
        start = lookups(router, outcome)
        wait_for(lambda: lookups(router, outcome) >= start + count, what=f"{count} {outcome}")

    with router_for(dns, prefill) as router, Load(router, clients=3) as load:
        wait_for(lambda: len(router.decode()) == 2, what="two engines")
        fleet = router.decode()
        dns.set({"prefill.test.": {"A": ["127.0.0.1"]}})  # the SRV name is gone: NXDOMAIN
        rounds(router, "empty")
        assert router.decode() == fleet
        dns.set({**records(prefill, decode[:2]), f"{SRV}.": {"rcode": "SERVFAIL"}})
        rounds(router, "failed")
        assert router.decode() == fleet
        dns.stop()
        done = load.done
        rounds(router, "failed")
        assert router.decode() == fleet
        assert all(state == "serving" for _, state in fleet.values())
        wait_for(lambda: load.done >= done + 6, what="requests served without DNS")
        dns.set(records(prefill, decode[:1]))
        dns.start()
        wait_for(lambda: set(router.decode()) == {decode[0].url}, what="a real answer applies")
        status = subprocess.run(  # nosec B603
            [sys.executable, "-m", "pd_router", "status", "--url", router.url],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "PD_ROUTER_ADMIN_TOKEN": TOKEN},
        )
        log = router.log()
    assert load.failures == [], load.failures[:3]
    assert status.returncode == 0, status.stderr
    assert "SOURCE" in status.stdout and f"dns:{SRV}" in status.stdout, status.stdout
    srv, a = f"dns:{SRV}: ", f"dns:prefill.test:{prefill.port}: "
    assert log.count(srv + "the name lists no address; the fleet is kept as it is") == 1, log
    # SERVFAIL, then the stopped server: failures in a row, logged once.
    assert log.count(srv + "lookup failed: SRV") == 1, log
    assert log.count(a + "lookup failed: A") == 1, log
    assert log.count(srv + "lookups answer again") == 1, log


def test_a_gone_engine_still_streaming_after_the_drain_bound_ends_with_the_usual_error(
    dns: DnsServer, engines: tuple[EngineProcess, list[EngineProcess]]
) -> None:
    prefill, decode = engines
    slow, other = decode[0], decode[1]
    slow.configure(itl=0.1)  # 200 tokens: 20 s, far beyond the bound
    dns.set(records(prefill, [slow]))
    with router_for(dns, prefill, "--discovery-drain-timeout", "1") as router:
        with httpx.stream(
            "POST",
            f"{router.url}/v1/completions",
            json={**BODY, "max_tokens": 200},
            timeout=30,
        ) as response:
            events = response.iter_lines()
            assert next(events).startswith("data: ")
            left = time.monotonic()
            dns.set(records(prefill, [other]))
            rest = [line for line in events if line]
            ended = time.monotonic() - left
        errors = [json.loads(line[6:])["error"] for line in rest if '"error"' in line]
        assert [e["code"] for e in errors] == ["node_dead"], rest[-3:]
        assert "was removed" in errors[0]["message"] and rest[-1] == "data: [DONE]"
        assert 1 <= ended < 1 + 3 * INTERVAL + 1, ended
        assert set(router.decode()) == {other.url}
        assert "removed 1 s after it left DNS, failing its 1 requests" in router.log()


def test_routers_sharing_a_pool_discover_the_same_engines_by_address(
    dns: DnsServer, engines: tuple[EngineProcess, list[EngineProcess]], redis_server: RedisServer
) -> None:
    """Two routers on one Redis (--state), each discovering on its own: an engine one of
    them found is the same node to the shared pool as the other's (keyed by address), so
    a burst through both never puts more on an engine than its slots, before and after a
    scale-up."""
    prefill, decode = engines
    flush_state(redis_server.url)
    dns.set(records(prefill, decode[:1]))
    with ExitStack() as stack:
        routers = [
            stack.enter_context(
                router_for(
                    dns, prefill, "--state", redis_server.url, "--decode-slots", "2", decode=SRV
                )
            )
            for _ in range(2)
        ]
        for router in routers:
            assert set(router.decode()) == {decode[0].url}

        def burst(count: int) -> list[int]:
            statuses: list[int] = []

            def client(index: int) -> None:
                body = {**BODY, "stream": False, "max_tokens": 8}
                url = routers[index % 2].url
                statuses.append(
                    httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code
                )

            threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            return statuses

        assert burst(8) == [200] * 8
        assert decode[0].stats()["peak_active"] <= 2
        dns.set(records(prefill, decode[:2]))
        for router in routers:
            wait_for(lambda: len(router.decode()) == 2, what="both routers see the new engine")
        assert burst(12) == [200] * 12
        peaks = [engine.stats()["peak_active"] for engine in decode[:2]]
        assert max(peaks) <= 2 and decode[1].stats()["requests"] > 0, peaks
        for router in routers:
            router.assert_idle()


def test_routers_sharing_the_fleet_agree_on_discovered_nodes_and_scale_down_under_load(
    dns: DnsServer, engines: tuple[EngineProcess, list[EngineProcess]], redis_server: RedisServer
) -> None:
    """Three routers on one Redis (--state) discovering the same names go through the
    shared fleet: each address is one node with one id on every router, never two; a
    scale-down drains the leaving engine on all of them without failing a request; an
    address back after its removal keeps its id (ids belong to role and URL)."""
    prefill, decode = engines
    flush_state(redis_server.url)
    dns.set(records(prefill, decode[:2]))
    with ExitStack() as stack:
        routers = [
            stack.enter_context(router_for(dns, prefill, "--state", redis_server.url))
            for _ in range(3)
        ]

        def fleets() -> list[dict[str, tuple[int, str]]]:
            return [{n["url"]: (n["id"], n["state"]) for n in r.nodes()} for r in routers]

        def agreed(urls: set[str]) -> bool:
            views = fleets()
            return all(set(v) == urls and v == views[0] for v in views) and all(
                state == "serving" for _, state in views[0].values()
            )

        wanted = {prefill.url, decode[0].url, decode[1].url}
        wait_for(lambda: agreed(wanted), what="the same fleet, serving, on every router")
        ids = {url: node_id for url, (node_id, _) in fleets()[0].items()}
        assert len(set(ids.values())) == 3, ids
        loads = [stack.enter_context(Load(router, clients=2)) for router in routers]
        wait_for(
            lambda: all(load.done >= 3 for load in loads) and requests_on(decode[1]) > 0,
            what="load on every router and both engines",
        )
        # Scale down 2 -> 1 while streams run on both engines through every router.
        dns.set(records(prefill, decode[:1]))
        wait_for(lambda: agreed(wanted - {decode[1].url}), what="the leaving engine removed")
        wait_for(lambda: decode[1].stats()["active"] == 0, what="nothing left on it")
        done = [load.done for load in loads]
        wait_for(
            lambda: all(load.done >= d + 3 for load, d in zip(loads, done)), what="more requests"
        )
        # Back in DNS after its removal: the same id, on every router.
        dns.set(records(prefill, decode[:2]))
        wait_for(lambda: agreed(wanted), what="the engine back on every router")
        assert {url: node_id for url, (node_id, _) in fleets()[0].items()} == ids
        assert anyio.run(registered, redis_server.url) == {
            f"{role} {url}": node_id
            for url, node_id in ids.items()
            for role in ["prefill" if url == prefill.url else "decode"]
        }
        logs = "".join(router.log() for router in routers)
    assert all(load.failures == [] for load in loads), [load.failures[:3] for load in loads]
    assert "drained and removed" in logs and "failing its" not in logs, logs


async def registered(url: str) -> dict[str, int]:
    """The shared fleet's ids by role and URL."""
    async with Redis(parse_url(url), timeout=2.0) as redis:
        pairs = await redis.call("HGETALL", "{pdr}:node-ids")
    return {pairs[i].decode(): int(pairs[i + 1]) for i in range(0, len(pairs), 2)}

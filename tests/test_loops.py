"""A request never passes through the same router twice, end to end: real routers through
the CLI that are their own engines (through another address) or name each other."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pd_router.sim.fleet import SimFleet, free_port
from tests.helpers import FAST_HEALTH, Forwarder, RouterProcess, wait_for

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"model": "sim-model", "prompt": "round and round", "max_tokens": 4}


def admin(router: RouterProcess, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{router.url}/admin{path}", headers=AUTH, timeout=30, **kwargs)


def node(router: RouterProcess, url: str) -> dict[str, Any]:
    return next(n for n in admin(router, "GET", "/nodes").json()["nodes"] if n["url"] == url)


def outcomes(router: RouterProcess) -> dict[str, float]:
    prefix = "pd_router_requests_total{endpoint=completions,outcome="
    metrics = router.metrics()
    return {k[len(prefix) : -1]: v for k, v in metrics.items() if k.startswith(prefix) and v}


def post(router: RouterProcess, **extra: Any) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", json={**BODY, **extra}, timeout=60)


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=1, decode_args=["--slots", "64", "--itl", "0.01"]) as fleet:
        yield fleet


def router_for(fleet: SimFleet, *args: str) -> RouterProcess:
    return RouterProcess(
        [fleet.prefill[0].url], [fleet.decode[0].url], "--admin-token", TOKEN, *FAST_HEALTH, *args
    )


def test_a_router_that_is_its_own_node_answers_508_and_serves_on(fleet: SimFleet) -> None:
    # Without probes the node added serves at once: the requests themselves find the loop.
    with router_for(
        fleet, "--health-interval", "0", "--decode-slots", "4", "--queue-timeout", "30"
    ) as router:
        with Forwarder(router.port) as itself:
            added = admin(
                router, "POST", "/nodes", json={"url": itself.url, "role": "decode", "slots": 4}
            )
            assert added.status_code == 201 and added.json()["state"] == "serving"
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda i: post(router, prompt=f"loop {i}"), range(16)))
            statuses = sorted(a.status_code for a in answers)
            assert set(statuses) <= {200, 502, 508} and 508 in statuses, statuses
            looped = next(a for a in answers if a.status_code == 508).json()["error"]
            assert looped["code"] == "loop_detected", looped
            assert "loop detected" in looped["message"]
            # Each loop came back once: the router saw the 16 requests and, at most, one
            # returning copy of each.
            seen = sum(outcomes(router).values())
            assert seen <= 32, outcomes(router)
            assert itself.connections <= 16
            view = node(router, itself.url)
            assert view["state"] == "dead" and view["reason"] == "loop", view
            # The real nodes serve on, and the operator can still remove the bad one.
            assert [post(router, prompt=f"after {i}").status_code for i in range(4)] == [200] * 4
            removed = admin(router, "DELETE", f"/nodes/{view['id']}")
            assert removed.status_code == 200, removed.text
        router.assert_idle()


def test_a_router_probing_itself_never_takes_the_node(fleet: SimFleet) -> None:
    with router_for(fleet) as router, Forwarder(router.port) as itself:
        added = admin(router, "POST", "/nodes", json={"url": itself.url, "role": "prefill"})
        assert added.status_code == 201, added.text
        view = added.json()
        assert view["state"] == "joining" and "508" in view["last_error"], view
        assert [post(router, prompt=f"p {i}").status_code for i in range(6)] == [200] * 6
        assert node(router, itself.url)["state"] == "joining"


def test_two_routers_naming_each_other_refuse_the_loop_not_storm(fleet: SimFleet) -> None:
    port_a, port_b = free_port(), free_port()
    a_url, b_url = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    prefill = [fleet.prefill[0].url]
    a = RouterProcess(prefill, [b_url], "--admin-token", TOKEN, "--max-connections", "200")
    b = RouterProcess(prefill, [a_url], "--admin-token", TOKEN, "--max-connections", "200")
    a.port, b.port = port_a, port_b
    a.start(), b.start()
    try:
        a.wait_healthy(), b.wait_healthy()
        answer = post(a)
        assert answer.status_code == 508, answer.text
        assert answer.json()["error"]["code"] == "loop_detected"
        # A -> B -> A: refused at A's second sight of it; B saw it once.
        assert outcomes(a).get("loop_detected") == 1, outcomes(a)
        assert sum(outcomes(b).values()) == 1, outcomes(b)
        assert node(a, b_url)["reason"] == "loop" and node(b, a_url)["reason"] == "loop"
        # Out for a while: the next request is refused at once, not sent round again.
        again = post(a)
        assert again.status_code == 503 and again.json()["error"]["code"] == "no_live_node"
        assert outcomes(a).get("loop_detected") == 1
    finally:
        a.stop(), b.stop()


def test_the_admin_api_refuses_the_routers_own_address(fleet: SimFleet) -> None:
    with router_for(fleet) as router:
        for url in (
            router.url,
            f"HTTP://localhost:{router.port}/",
            f"http://127.0.0.1:0{router.port}",
        ):
            answer = admin(router, "POST", "/nodes", json={"url": url, "role": "decode"})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == "url" and "this router's own address" in error["message"]
        assert len(admin(router, "GET", "/nodes").json()["nodes"]) == 2


def test_a_router_given_its_own_address_at_start_is_refused(fleet: SimFleet) -> None:
    router = RouterProcess([fleet.prefill[0].url], [fleet.decode[0].url])
    router.extra_args[3:3] = [f"http://localhost:{router.port}"]  # a second decode node
    router.start()
    try:
        assert router.wait_exit(timeout=30) == 2
        assert "is this router's own address" in router.log()
    finally:
        router.stop()


def test_the_admin_api_is_reachable_with_every_client_connection_taken(fleet: SimFleet) -> None:
    with router_for(fleet, "--max-connections", "4") as router:
        held = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(4)]
        try:
            wait_for(
                lambda: router.metrics()["pd_router_client_connections"] >= 4,
                what="4 connections open",
            )
            refused = post(router)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "too_many_connections"
            answer = admin(router, "GET", "/nodes")
            assert answer.status_code == 200 and len(answer.json()["nodes"]) == 2
            assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
        finally:
            for sock in held:
                sock.close()
        assert post(router).status_code == 200

"""One engine is one node, from every source, end to end: real routers through the CLI,
simulated engines, the admin API over HTTP (and a real redis-server with ``--state``)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pd_router.sim.fleet import EngineProcess, SimFleet, free_port
from tests.helpers import FAST_HEALTH, RouterProcess, flush_state, wait_for
from tests.redis_server import RedisServer

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def admin(router: RouterProcess, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{router.url}/admin{path}", headers=AUTH, timeout=30, **kwargs)


def nodes_at(router: RouterProcess, port: int) -> list[dict[str, Any]]:
    """The router's nodes whose URL names ``port``, however spelt."""
    nodes = admin(router, "GET", "/nodes").json()["nodes"]
    return [n for n in nodes if n["url"].rstrip("/").endswith(f":{port}")]


def spellings(port: int) -> list[str]:
    """One engine, spelt as an operator might."""
    return [
        f"HTTP://127.0.0.1:{port}/",
        f"http://127.0.0.1:0{port}",
        f"http://127.0.0.1:{port}",
    ]


def complete(router: RouterProcess, prompt: str) -> int:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 12, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as answer:
        answer.read()
        return answer.status_code


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=2, decode_args=["--slots", "64", "--itl", "0.02"]) as fleet:
        yield fleet


def router_for(fleet: SimFleet, *args: str) -> RouterProcess:
    return RouterProcess(
        [fleet.prefill[0].url],
        [f"{fleet.decode[0].url},slots=2"],
        "--admin-token",
        TOKEN,
        "--queue-timeout",
        "60",
        *FAST_HEALTH,
        *args,
    )


def test_an_engine_added_three_times_is_one_node_and_never_gets_more_than_its_slots(
    fleet: SimFleet,
) -> None:
    engine = fleet.decode[1]
    fleet.reset()
    with router_for(fleet) as router:
        answers = [
            admin(router, "POST", "/nodes", json={"url": url, "role": "decode", "slots": slots})
            for url, slots in zip(spellings(engine.port), (2, 3, 4))
        ]
        assert [a.status_code for a in answers] == [201, 200, 200], [a.text for a in answers]
        ids = {a.json()["id"] for a in answers}
        assert len(ids) == 1, "the engine kept its first id"
        (node,) = nodes_at(router, engine.port)
        assert node["url"] == engine.url and node["slots"] == 4 and node["state"] == "serving"
        health = httpx.get(f"{router.url}/health", timeout=10).json()
        assert health["decode_slots"] == 2 + 4
        with ThreadPoolExecutor(20) as pool:
            statuses = list(pool.map(lambda i: complete(router, f"client {i} asks"), range(40)))
        assert statuses == [200] * 40
        assert engine.stats()["completed"] > 0, "nothing reached the added engine"
        assert engine.stats()["peak_active"] <= 4, engine.stats()
        assert fleet.decode[0].stats()["peak_active"] <= 2
        router.assert_idle()


def test_a_draining_node_added_again_keeps_its_id_and_serves_again(fleet: SimFleet) -> None:
    engine = fleet.decode[1]
    with router_for(fleet, "--decode-slots", "5") as router:
        added = admin(router, "POST", "/nodes", json={"url": engine.url, "role": "decode"})
        node_id = added.json()["id"]
        # Slots not given: --decode-slots, as for a node on the command line (before, 1).
        assert added.json()["slots"] == 5
        assert admin(router, "POST", f"/nodes/{node_id}/drain").json()["state"] == "draining"
        again = admin(
            router,
            "POST",
            "/nodes",
            json={"url": f"{engine.url}/", "role": "decode", "slots": 3, "labels": {"z": "b"}},
        )
        assert again.status_code == 200, again.text
        view = again.json()
        assert view["id"] == node_id and view["state"] == "serving"
        assert view["slots"] == 3 and view["labels"] == {"z": "b"}
        assert [n["id"] for n in nodes_at(router, engine.port)] == [node_id]
        # A node added again is given whole: what it leaves out is the default again.
        again = admin(router, "POST", "/nodes", json={"url": engine.url, "role": "decode"})
        assert again.status_code == 200 and again.json()["id"] == node_id
        assert again.json()["slots"] == 5 and again.json()["labels"] == {}
        # Another role is another node: an engine may serve both.
        prefill = admin(router, "POST", "/nodes", json={"url": engine.url, "role": "prefill"})
        assert prefill.status_code == 201 and prefill.json()["id"] != node_id


def test_an_added_node_joins_and_serves_from_its_first_good_probe(fleet: SimFleet) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with router_for(fleet) as router:
        added = admin(router, "POST", "/nodes", json={"url": url, "role": "decode", "slots": 4})
        assert added.status_code == 201
        # Probed before the answer: joining, and why (before, "not yet probed" whatever
        # its probes said).
        assert added.json()["state"] == "joining" and added.json()["reason"] == "probe refused"
        # Nothing listens there: a node taken as serving would have taken (and failed) some.
        assert [complete(router, f"while joining {i}") for i in range(6)] == [200] * 6
        assert nodes_at(router, port)[0]["state"] == "joining"
        with EngineProcess("decode", ["--slots", "8"], port=port) as engine:
            wait_for(lambda: nodes_at(router, port)[0]["state"] == "serving", what="serving")
            # A live engine added is probed before the answer: serving at once.
            other = admin(
                router, "POST", "/nodes", json={"url": fleet.decode[1].url, "role": "decode"}
            )
            assert other.status_code == 201 and other.json()["state"] == "serving"
            assert engine.stats()["requests"] == 0


def test_without_probes_an_added_node_serves_at_once(fleet: SimFleet) -> None:
    with router_for(fleet, "--health-interval", "0") as router:
        added = admin(router, "POST", "/nodes", json={"url": fleet.decode[1].url, "role": "decode"})
        assert added.status_code == 201 and added.json()["state"] == "serving"


def test_one_engine_given_twice_on_the_command_line_is_refused(fleet: SimFleet) -> None:
    engine = fleet.decode[0]
    router = RouterProcess(
        [fleet.prefill[0].url], [engine.url, f"HTTP://127.0.0.1:0{engine.port}/,slots=4"]
    )
    router.start()
    try:
        assert router.wait_exit(timeout=30) == 2
        assert f"decode node {engine.url} is given twice: one engine is one node" in router.log()
    finally:
        router.stop()


def test_with_state_every_spelling_through_every_router_is_one_node(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    flush_state(redis_server.url)
    engine = fleet.decode[1]
    fleet.reset()
    state = ("--state", redis_server.url)
    with router_for(fleet, *state) as a, router_for(fleet, *state) as b:
        answers = []
        for router, url in zip((a, b, a), spellings(engine.port)):
            answer = admin(
                router, "POST", "/nodes", json={"url": url, "role": "decode", "slots": 4}
            )
            answers.append(answer)
            wait_for(lambda: len(nodes_at(b, engine.port)) > 0, what="b has the node")
        assert [r.status_code for r in answers] == [201, 200, 200], [r.text for r in answers]
        assert len({r.json()["id"] for r in answers}) == 1
        for router in (a, b):
            wait_for(
                lambda: [(n["url"], n["slots"]) for n in nodes_at(router, engine.port)]
                == [(engine.url, 4)],
                what="one node for the engine on every router",
            )
        with ThreadPoolExecutor(20) as pool:
            routers = [a, b] * 20
            statuses = list(
                pool.map(lambda r: complete(r[1], f"client {r[0]}"), enumerate(routers))
            )
        assert statuses == [200] * 40
        assert 0 < engine.stats()["peak_active"] <= 4, engine.stats()

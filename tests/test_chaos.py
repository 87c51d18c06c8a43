"""Chaos, bounded in count and time: 600 requests while clients hang up, engines are
killed and restarted, and engines answer errors. Every request must end in exactly one
terminal outcome, and afterwards no slot is held and the binding table is empty. How many
were served (a share that falls on a slow machine, as the kills come by the clock) is
printed, not asserted."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from pd_router.sim.fleet import EngineProcess, SimFleet
from tests.helpers import RouterProcess, slots_in_use, wait_for

REQUESTS = 600
CONCURRENCY = 24
TIME_LIMIT = 240.0
TOKEN = "chaos"


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=2, decode=3, decode_args=["--slots", "64", "--itl", "0.01"]) as fleet:
        yield fleet


def classify(status: int, text: str, stream: bool) -> str:
    """``ok``, ``error``, or a description of a protocol violation."""
    if status != 200:
        error = json.loads(text).get("error", {})
        return (
            "error" if {"message", "type", "param", "code"} <= set(error) else f"bad body {text!r}"
        )
    if not stream:
        return "ok" if json.loads(text).get("choices") else f"no choices {text!r}"
    events = [e for e in text.split("\n\n") if e]
    errors = [e for e in events if e.startswith('data: {"error"')]
    if events[-1:] != ["data: [DONE]"] or events.count("data: [DONE]") != 1:
        return f"stream not ended by one [DONE]: {events[-2:]!r}"
    if len(errors) > 1 or (errors and events[-2] != errors[0]):
        return f"more than one terminal error: {errors!r}"
    return "error" if errors else "ok"


class Chaos(threading.Thread):
    """Kills and restarts engines, and makes them answer errors, until told to stop."""

    def __init__(self, fleet: SimFleet, seed: int) -> None:
        super().__init__(daemon=True)
        self.fleet = fleet
        self.random = random.Random(seed)
        self.stopping = threading.Event()
        self.kills = 0
        self.error_bursts = 0

    def run(self) -> None:
        while not self.stopping.wait(self.random.uniform(0.3, 0.8)):
            engine: EngineProcess = self.random.choice(self.fleet.engines)
            if self.random.random() < 0.5:
                engine.kill()
                self.kills += 1
                time.sleep(self.random.uniform(0.1, 0.6))
                engine.start().wait_healthy(60)
            else:
                change = self.random.choice([{"fail_status": 500}, {"fail_after_tokens": 2}])
                engine.configure(**change)
                self.error_bursts += 1
                time.sleep(self.random.uniform(0.1, 0.4))
                engine.configure(fail_status=None, fail_after_tokens=None)


async def drive(routers: list[RouterProcess], seed: int) -> Counter[str]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(i)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        stream = rng.random() < 0.7
        body = {
            "model": "sim-model",
            "prompt": f"chaos {i} " * rng.randint(1, 40),
            "max_tokens": rng.randint(1, 30),
            "stream": stream,
        }
        url = f"{routers[i % len(routers)].url}/v1/completions"
        if rng.random() < 0.15:
            # A client that hangs up at a random moment: before, during or after anything.
            try:
                async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                    async with client.stream("POST", url, json=body) as response:
                        await response.aread()
            except TimeoutError:
                return "hung_up"
        else:
            response = await client.post(url, json=body)
        return classify(response.status_code, response.text, stream)

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while not queue.empty():
                outcomes[await one(client, queue.get_nowait())] += 1

    async with asyncio.timeout(TIME_LIMIT):
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return outcomes


@pytest.mark.parametrize("routers", [1, 3], ids=["one-router", "three-routers-one-pool"])
def test_chaos(fleet: SimFleet, routers: int, request: pytest.FixtureRequest) -> None:
    args = ["--decode-slots", "8", "--queue-timeout", "5", "--health-interval", "0.2"]
    if routers > 1:
        args += ["--state", request.getfixturevalue("redis_server").url]
    engines = [e.url for e in fleet.prefill], [e.url for e in fleet.decode]
    with ExitStack() as stack:
        started = [
            stack.enter_context(RouterProcess(*engines, *args, "--admin-token", TOKEN))
            for _ in range(routers)
        ]
        chaos = Chaos(fleet, seed=7)
        begun = time.monotonic()
        chaos.start()
        try:
            outcomes = asyncio.run(drive(started, seed=11))
        finally:
            chaos.stopping.set()
            chaos.join(90)
        elapsed = time.monotonic() - begun
        print(
            f"\nchaos: {sum(outcomes.values())} requests in {elapsed:.1f}s, {dict(outcomes)} "
            f"({outcomes['ok'] / REQUESTS:.0%} ok), {chaos.kills} engine kills, "
            f"{chaos.error_bursts} error bursts"
        )
        violations = {k: v for k, v in outcomes.items() if k not in ("ok", "error", "hung_up")}
        assert violations == {}
        assert sum(outcomes.values()) == REQUESTS
        assert outcomes["ok"] > 0, "the fleet kept serving through the chaos"
        assert chaos.kills > 0 and outcomes["hung_up"] > 0 and outcomes["error"] > 0
        for engine in fleet.engines:
            if engine.pid is None:
                engine.start().wait_healthy(60)
        counted: Counter[str] = Counter()
        for router in started:
            router.assert_idle()
            wait_for(lambda: router.metrics()["pd_router_in_flight"] == 0, what="bindings empty")
            nodes = httpx.get(
                f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {TOKEN}"}
            ).json()
            assert nodes["in_flight"] == 0
            assert all(node["bound_requests"] == [] for node in nodes["nodes"])
            for key, value in router.metrics().items():
                if key.startswith("pd_router_requests_total"):
                    counted[key.split("outcome=")[1].rstrip("}")] += int(value)
        if routers > 1:
            state = args[args.index("--state") + 1]
            wait_for(lambda: slots_in_use(state) == 0, what="no slot left held in Redis")
        # A client that hung up before its request reached a router is never seen by it;
        # every other request is counted once, under one outcome.
        print(f"router outcomes: {dict(counted)}")
        assert REQUESTS - outcomes["hung_up"] <= sum(counted.values()) <= REQUESTS
        assert counted.get("ok", 0) >= outcomes["ok"]
        assert counted.get("client_aborted", 0) <= outcomes["hung_up"]

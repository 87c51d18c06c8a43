"""``GET /v1/models`` through a real router in front of simulated engines: answered from the
lists the router reads every 30 s, so any number of callers costs the engines nothing.

300 concurrent callers against an engine whose ``/v1/models`` took 5 s used to cost 303
reads of it and 302 router-to-engine connections; with a low ``ulimit -n`` the router ran
out of file descriptors.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pd_router.sim.fleet import SimFleet
from tests.helpers import RouterProcess, wait_for

CALLERS = 300
# The engines' /v1/models answers this late: under the model watch's 5 s bound, so the
# router learns the lists, and slow enough that a caller waiting on an engine would show.
SLOW = 2.0


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=2) as fleet:
        yield fleet


def router_for(fleet: SimFleet, *args: str) -> RouterProcess:
    prefill = [engine.url for engine in fleet.prefill]
    decode = [engine.url for engine in fleet.decode]
    return RouterProcess(prefill, decode, *args)


def reads(fleet: SimFleet) -> list[int]:
    return [int(engine.stats()["models_requests"]) for engine in fleet.engines]


def listed(router: RouterProcess) -> bool:
    return httpx.get(f"{router.url}/v1/models", timeout=10).status_code == 200


@pytest.fixture
def slow_lists(fleet: SimFleet) -> Iterator[None]:
    for engine in fleet.engines:
        engine.configure(models_delay=SLOW)
    try:
        yield
    finally:
        for engine in fleet.engines:
            engine.configure(models_delay=0.0)


# --health-interval 0: no prober, but the lists are still read (routing needs them too).
@pytest.mark.parametrize("interval", ["1", "0"])
def test_any_number_of_callers_costs_the_engines_nothing(
    fleet: SimFleet, slow_lists: None, interval: str
) -> None:
    with router_for(fleet, "--health-interval", interval) as router:
        wait_for(lambda: listed(router), timeout=30, what="the engines' lists read")
        before = reads(fleet)

        limits = httpx.Limits(max_connections=CALLERS)
        with httpx.Client(timeout=60, limits=limits) as client:

            def call(_: int) -> tuple[int, float]:
                started = time.perf_counter()
                response = client.get(f"{router.url}/v1/models")
                return response.status_code, time.perf_counter() - started

            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=CALLERS) as pool:
                answers = list(pool.map(call, range(CALLERS)))
            elapsed = time.perf_counter() - started
        after = reads(fleet)
    assert [status for status, _ in answers] == [200] * CALLERS
    # The watch reads each node every 30 s: at most one of its own reads fell in the burst.
    extra = [a - b for a, b in zip(after, before)]
    assert all(count <= 1 for count in extra), extra
    slowest = max(seconds for _, seconds in answers)
    print(
        f"\n{CALLERS} callers of /v1/models (engines answer it in {SLOW:g} s): "
        f"engine reads during the burst {extra}, slowest caller {slowest * 1000:.0f} ms, "
        f"all in {elapsed:.2f} s"
    )


def test_the_engines_model_objects_are_listed_as_they_gave_them(fleet: SimFleet) -> None:
    with router_for(fleet) as router:
        wait_for(lambda: listed(router), timeout=30, what="the engines' lists read")
        data = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"]
        sdk = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        ids = [model.id for model in sdk.models.list()]
    # One model served by every engine: listed once, whole (max_model_len included), as
    # the first node (the prefill engine) gave it.
    assert data == httpx.get(f"{fleet.prefill[0].url}/v1/models", timeout=10).json()["data"]
    assert data[0]["max_model_len"] == 4096
    assert ids == ["sim-model"]


def test_before_any_list_is_read_the_answer_is_a_503_to_retry(fleet: SimFleet) -> None:
    """Engines whose lists never come in time (the watch gives up after 5 s)."""
    for engine in fleet.engines:
        engine.configure(models_delay=60.0)
    try:
        with router_for(fleet) as router:
            response = httpx.get(f"{router.url}/v1/models", timeout=10)
            # Requests are served meanwhile: a node whose list is unknown takes any model.
            served = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": "sim-model", "prompt": "hello", "max_tokens": 2},
                timeout=30,
            )
    finally:
        for engine in fleet.engines:
            engine.configure(models_delay=0.0)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json() == {
        "error": {
            "message": "no serving engine's model list has been read yet",
            "type": "service_unavailable",
            "param": None,
            "code": "models_unknown",
        }
    }
    assert served.status_code == 200

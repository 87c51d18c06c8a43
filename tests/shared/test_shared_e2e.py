"""Three router processes on one Redis (``--state``) in front of simulated engines: one pool,
whatever router a client reaches; a killed router's slots come back; Redis going away is a
clear 503 and the routers recover when it returns."""

from __future__ import annotations

import contextlib
import json
import select
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from pd_router.sim.fleet import SimFleet
from tests.helpers import (
    RawClient,
    RouterProcess,
    flush_state,
    queued,
    slots_in_use,
    wait_for,
)
from tests.redis_server import RedisServer

STREAM = {"model": "sim-model", "prompt": "hello shared pool", "max_tokens": 20, "stream": True}


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=2, decode_args=["--slots", "64", "--itl", "0.02"]) as engines:
        yield engines


@contextmanager
def routers(
    fleet: SimFleet, server: RedisServer, count: int, *args: str
) -> Iterator[list[RouterProcess]]:
    engines = [e.url for e in fleet.prefill], [e.url for e in fleet.decode]
    flush_state(server.url)
    with ExitStack() as stack:
        started = [
            stack.enter_context(RouterProcess(*engines, "--state", server.url, *args))
            for _ in range(count)
        ]
        yield started


def stream(url: str, body: dict[str, Any] = STREAM, timeout: float = 60) -> httpx.Response:
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    return response


def test_a_burst_wider_than_the_pool_never_puts_more_on_an_engine_than_its_slots(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    for engine in fleet.engines:
        engine.reset()
    with routers(fleet, redis_server, 3, "--decode-slots", "2", "--queue-timeout", "60") as rs:
        answers: list[httpx.Response] = []

        def client(index: int) -> None:
            answers.append(stream(rs[index % 3].url))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(answers) == 24
        assert all(a.status_code == 200 and a.text.endswith("data: [DONE]\n\n") for a in answers)
        peaks = [engine.stats()["peak_active"] for engine in fleet.decode]
        assert max(peaks) <= 2, f"an engine served more than its 2 slots: {peaks}"
        assert min(peaks) == 2, "the burst filled every slot"
        for router in rs:
            router.assert_idle()
        wait_for(lambda: slots_in_use(redis_server.url) == 0, what="Redis's count")


def test_waiters_on_different_routers_are_served_in_arrival_order(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    """One queue across routers: the pool is full, six requests queue one after another on
    three routers, and one slot frees at a time; each request must be served before any
    that came after it, whichever router either came through."""
    with routers(fleet, redis_server, 3, "--decode-slots", "1", "--queue-timeout", "60") as rs:
        long = {**STREAM, "max_tokens": 4000}
        holders = [RawClient(rs[0].url, "/v1/completions", long) for _ in fleet.decode]
        for holder in holders:
            holder.read_until(b"data: ")
        assert slots_in_use(redis_server.url) == len(holders)
        waiters: list[RawClient] = []
        for index in range(6):
            body = {**long, "prompt": f"waiter {index}"}
            waiters.append(RawClient(rs[index % 3].url, "/v1/completions", body))
            # The next one arrives only once this one is in the queue.
            wait_for(lambda: queued(redis_server.url) == index + 1, what=f"waiter {index} queued")
        holders[0].hang_up()  # one slot, so the waiters go through it one at a time
        served: list[int] = []
        for _ in waiters:
            # Each served waiter streams, holding the slot until it hangs up: whichever
            # starts next is the one the queue chose (no thread's timing decides the order).
            left = {waiter.sock: i for i, waiter in enumerate(waiters) if i not in served}
            readable, _, _ = select.select(list(left), [], [], 60)
            assert readable, f"nobody served after {served}"
            index = left[readable[0]]
            head = waiters[index].read_until(b"data: ")
            assert head.startswith(b"HTTP/1.1 200"), head[:300]
            served.append(index)
            waiters[index].hang_up()
        assert served == list(range(6)), f"served out of arrival order: {served}"
        holders[1].hang_up()
        for router in rs:
            router.assert_idle()
        wait_for(lambda: slots_in_use(redis_server.url) == 0, what="Redis's count")


def test_a_killed_router_gives_its_slots_back_within_the_lease(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    slow = {**STREAM, "max_tokens": 2000}
    with routers(fleet, redis_server, 2, "--queue-timeout", "60") as (doomed, survivor):

        def hold() -> None:
            with contextlib.suppress(httpx.HTTPError):  # its router is killed under it
                stream(doomed.url, slow)

        holders = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
        for holder in holders:
            holder.start()
        wait_for(lambda: slots_in_use(redis_server.url) == 2, what="both slots held")
        doomed.kill()  # SIGKILL: it gives nothing back itself
        killed = time.monotonic()
        # Served once the dead router's lease (10 s) has lapsed: within the queue timeout.
        answer = stream(survivor.url)
        assert answer.status_code == 200
        print(f"served {time.monotonic() - killed:.1f} s after the kill (the lease: 10 s)")
        wait_for(lambda: slots_in_use(redis_server.url) == 0, what="slots back")


def test_redis_away_is_a_503_for_new_requests_and_streams_in_flight_go_on(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    with routers(fleet, redis_server, 1, "--admin-token", "admin") as (router,):
        answers: list[httpx.Response] = []
        long = {**STREAM, "max_tokens": 100}
        before = threading.Thread(target=lambda: answers.append(stream(router.url, long)))
        before.start()
        wait_for(lambda: slots_in_use(redis_server.url) == 1, what="a stream in flight")
        redis_server.kill()
        refused = stream(router.url)
        assert refused.status_code == 503
        assert json.loads(refused.text)["error"]["code"] == "shared_state_unavailable"
        wait_for(lambda: httpx.get(f"{router.url}/health").status_code == 503, what="/health 503")
        # An abort of a request this router does not hold asks the others through Redis:
        # a 503 as for any admin change (before: a plain-text 500).
        url = f"{router.url}/admin/requests/elsewhere/abort"
        unasked = httpx.post(url, headers={"authorization": "Bearer admin"})
        assert unasked.status_code == 503, unasked.text
        assert unasked.json()["error"]["code"] == "shared_state_unavailable"
        before.join(30)
        assert answers[0].status_code == 200 and answers[0].text.endswith("data: [DONE]\n\n")
        redis_server.start()
        wait_for(
            lambda: httpx.get(f"{router.url}/health").status_code == 200,
            timeout=15,
            what="/health 200",
        )
        assert stream(router.url).status_code == 200
        router.assert_idle()
        wait_for(lambda: slots_in_use(redis_server.url) == 0, what="Redis's count")


def test_an_abort_sent_to_any_router_reaches_the_one_holding_the_request(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    admin = {"authorization": "Bearer admin"}
    with routers(fleet, redis_server, 2, "--admin-token", "admin") as (holder, other):
        answers: list[httpx.Response] = []
        body = {**STREAM, "max_tokens": 2000}
        headers = {"x-request-id": "far-away"}

        def client() -> None:
            url = f"{holder.url}/v1/completions"
            answers.append(httpx.post(url, json=body, headers=headers, timeout=60))

        thread = threading.Thread(target=client)
        thread.start()
        wait_for(lambda: slots_in_use(redis_server.url) == 1, what="the stream under way")
        time.sleep(0.3)  # a few tokens out
        aborted = httpx.post(f"{other.url}/admin/requests/far-away/abort", headers=admin)
        assert aborted.status_code == 200
        assert aborted.json()["aborted"] is True and aborted.json()["streaming"] is True
        thread.join(30)
        events = [e for e in answers[0].text.split("\n\n") if e]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "abort"
        assert events[-1] == "data: [DONE]"
        missing = httpx.post(f"{other.url}/admin/requests/nobody/abort", headers=admin)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        holder.assert_idle()
        wait_for(lambda: slots_in_use(redis_server.url) == 0, what="Redis's count")

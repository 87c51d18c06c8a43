"""The cancellation matrix on the real app: a client hangs up at every stage of a request.

Each case checks the three things that matter in production: the decode slot is free
again (released exactly once: acquisitions == releases), the engine working on the
request saw the abort (or, between prefill and decode, the KV blocks were pulled and so
freed instead of staying pinned until the lease), and the router keeps serving.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from pd_router.sim.fleet import EngineProcess, SimFleet
from tests.helpers import RawClient, RouterProcess, slots_in_use, wait_for

BODY = {"model": "sim-model", "prompt": "cancel me please now", "max_tokens": 50, "stream": True}
LEASE = "60"  # long enough that "freed" can only mean "pulled"
# What a wait allows: it ends as soon as the state is there. The steps the tests wait out
# instead (a prefill, a first token, a whole answer) are made longer than this, so that
# "aborted" cannot mean "it ended anyway" however slow the machine.
WAIT = 30
FOREVER = 600


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=1, prefill_args=["--kv-lease", LEASE]) as fleet:
        yield fleet


@pytest.fixture(scope="module", params=["in-process", "shared"])
def router(fleet: SimFleet, request: pytest.FixtureRequest) -> Iterator[RouterProcess]:
    """Every case runs against the in-process pool and against the one shared on Redis."""
    state: list[str] = []
    if request.param == "shared":
        state = ["--state", request.getfixturevalue("redis_server").url]
    with RouterProcess(
        [fleet.prefill[0].url], [fleet.decode[0].url], "--queue-timeout", "30", *state
    ) as router:
        yield router
        if state:
            wait_for(lambda: slots_in_use(state[1]) == 0, what="Redis's count back to 0")


@pytest.fixture
def engines(
    fleet: SimFleet, router: RouterProcess
) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    prefill.configure(prefill_delay=0, fail_status=None)
    decode.configure(accept_delay=0, ttft=0, itl=0.02, fail_status=None, fail_after_tokens=None)
    prefill.reset()
    decode.reset()
    yield prefill, decode
    router.assert_idle()
    # The router still serves after whatever the test did.
    after = RawClient(router.url, "/v1/completions", {**BODY, "max_tokens": 2})
    assert after.read_all().endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    router.assert_idle()


def test_client_leaves_while_queued(
    router: RouterProcess, engines: tuple[EngineProcess, ...]
) -> None:
    prefill, decode = engines
    holder = RawClient(router.url, "/v1/completions", BODY)
    holder.read_until(b"data: ")
    queued = RawClient(router.url, "/v1/completions", BODY)
    wait_for(lambda: router.metrics()["pd_router_queue_depth"] == 1, what="a queued request")
    queued.hang_up()
    wait_for(lambda: router.metrics()["pd_router_queue_depth"] == 0, what="the waiter to leave")
    assert router.in_use() == 1, "the holder keeps its slot; the leaver took none"
    assert holder.read_all().endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert prefill.stats()["requests"] == 1, "the queued request never reached an engine"


def test_client_leaves_during_prefill_and_the_answer_comes_within_the_grace(
    router: RouterProcess, engines: tuple[EngineProcess, ...]
) -> None:
    """Closing the prefill connection cannot reach an engine that has just answered (its
    KV pinned until the lease ends: 34 of 400 hang-ups timed around the answer did so), so
    the router waits for the answer and drains the KV through the decode engine."""
    prefill, decode = engines
    prefill.configure(prefill_delay=1)
    client = RawClient(router.url, "/v1/completions", BODY)
    wait_for(lambda: prefill.stats()["active"] == 1, what="prefill to start")
    assert router.in_use() == 1, "the decode slot is reserved before prefill"
    client.hang_up()
    wait_for(lambda: prefill.stats()["transfers"] == 1, timeout=WAIT, what="the KV to be pulled")
    wait_for(lambda: router.in_use() == 0, timeout=WAIT, what="the slot")
    assert prefill.stats()["blocks_pinned"] == 0 and prefill.stats()["aborted"] == 0
    assert decode.stats()["requests"] == 1, "one drain request"


def test_hang_ups_around_the_prefill_answer_leave_no_kv_pinned(
    router: RouterProcess, engines: tuple[EngineProcess, ...]
) -> None:
    """Before the prefill was shielded, 34 of 400 such hang-ups left KV pinned."""
    prefill, decode = engines
    prefill.configure(prefill_delay=0.02)
    rng = random.Random(5)
    for _ in range(100):
        client = RawClient(router.url, "/v1/completions", BODY)
        time.sleep(rng.uniform(0.015, 0.03))
        client.hang_up()
    wait_for(lambda: router.in_use() == 0, timeout=2 * WAIT, what="every drain")
    stats = prefill.stats()
    assert stats["blocks_pinned"] == 0
    assert stats["transfers"] == stats["completed"], "every answered prefill was pulled"


def test_client_leaves_during_a_prefill_slower_than_the_grace(
    router: RouterProcess, engines: tuple[EngineProcess, ...]
) -> None:
    prefill, decode = engines
    prefill.configure(prefill_delay=FOREVER)
    client = RawClient(router.url, "/v1/completions", BODY)
    wait_for(lambda: prefill.stats()["active"] == 1, what="prefill to start")
    client.hang_up()
    left = time.monotonic()
    wait_for(lambda: prefill.stats()["aborted"] == 1, timeout=WAIT, what="the prefill abort")
    assert time.monotonic() - left > 4.5, "not before --handoff-grace (5 s)"
    wait_for(lambda: router.in_use() == 0, timeout=WAIT, what="the slot")
    assert prefill.stats()["blocks_pinned"] == 0
    assert decode.stats()["requests"] == 0
    prefill.configure(prefill_delay=0)


def test_client_leaves_between_prefill_and_decode(
    router: RouterProcess, engines: tuple[EngineProcess, ...]
) -> None:
    """The prefill engine holds the KV; the router still hands it over so it gets freed."""
    prefill, decode = engines
    decode.configure(accept_delay=1.5)
    client = RawClient(router.url, "/v1/completions", BODY)
    wait_for(lambda: prefill.stats()["blocks_pinned"] > 0, what="prefill to finish")
    wait_for(lambda: decode.stats()["active"] == 1, what="the decode request to arrive")
    client.hang_up()
    wait_for(
        lambda: prefill.stats()["blocks_pinned"] == 0, timeout=WAIT, what="the KV to be pulled"
    )
    assert prefill.stats()["transfers"] == 1 and prefill.stats()["blocks_expired"] == 0
    wait_for(lambda: decode.stats()["aborted"] == 1, timeout=WAIT, what="the decode abort")
    assert decode.stats()["completed"] == 0


def test_client_leaves_before_the_first_chunk(
    router: RouterProcess, engines: tuple[EngineProcess, ...]
) -> None:
    prefill, decode = engines
    decode.configure(ttft=5)
    # 2000 tokens at 20 ms after the first: 40 s for the whole answer.
    client = RawClient(router.url, "/v1/completions", {**BODY, "max_tokens": 2000})
    wait_for(lambda: decode.stats()["transfers"] == 1, what="decode to pull the KV")
    client.read_until(b"\r\n\r\n", timeout=WAIT)  # the headers, and nothing else yet
    client.hang_up()
    wait_for(lambda: decode.stats()["aborted"] == 1, timeout=WAIT, what="the decode abort")
    wait_for(lambda: router.in_use() == 0, timeout=WAIT, what="the slot")


def test_client_leaves_mid_stream(
    router: RouterProcess, engines: tuple[EngineProcess, ...]
) -> None:
    prefill, decode = engines
    # 2000 tokens at 20 ms: 40 s for the whole answer.
    client = RawClient(router.url, "/v1/completions", {**BODY, "max_tokens": 2000})
    client.read_until(b'"text"', count=3, timeout=WAIT)
    client.hang_up()
    wait_for(lambda: decode.stats()["aborted"] == 1, timeout=WAIT, what="the decode abort")
    wait_for(lambda: router.in_use() == 0, timeout=WAIT, what="the slot")
    assert decode.stats()["completed"] == 0


def test_client_leaves_after_the_end(
    router: RouterProcess, engines: tuple[EngineProcess, ...]
) -> None:
    prefill, decode = engines
    client = RawClient(router.url, "/v1/completions", {**BODY, "max_tokens": 5})
    assert client.read_all().endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    client.hang_up()
    wait_for(lambda: decode.stats()["completed"] == 1, what="decode to complete")
    assert decode.stats()["aborted"] == 0


def test_non_streaming_client_leaves_during_decode(
    router: RouterProcess, engines: tuple[EngineProcess, ...]
) -> None:
    prefill, decode = engines
    # 2000 tokens at 20 ms: 40 s for the whole answer.
    client = RawClient(router.url, "/v1/completions", {**BODY, "stream": False, "max_tokens": 2000})
    wait_for(lambda: decode.stats()["transfers"] == 1, what="decode to start")
    client.hang_up()
    wait_for(lambda: decode.stats()["aborted"] == 1, timeout=WAIT, what="the decode abort")
    assert decode.stats()["completed"] == 0

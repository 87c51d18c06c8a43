"""Model pools end to end: a real router in front of simulated engines serving two models,
driven by the openai SDK. Each request lands on its model's engines, a model nobody serves
is 404 ``model_not_found``, and a queue on one model holds up nobody asking for another."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from pd_router.sim.fleet import EngineProcess
from tests.helpers import RawClient, RouterProcess, flush_state, queued, slots_in_use, wait_for
from tests.redis_server import RedisServer

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineProcess]]:
    """A prefill and a decode engine per model; alpha's decode engine has one slot."""
    made = {
        "prefill-alpha": EngineProcess("prefill", ["--model", "alpha"]),
        "prefill-beta": EngineProcess("prefill", ["--model", "beta"]),
        "decode-alpha": EngineProcess("decode", ["--model", "alpha"]),
        "decode-beta": EngineProcess("decode", ["--model", "beta"]),
    }
    try:
        for engine in made.values():
            engine.start()
        for engine in made.values():
            engine.wait_healthy()
        yield made
    finally:
        for engine in made.values():
            engine.stop()


@pytest.fixture(scope="module")
def router(engines: dict[str, EngineProcess]) -> Iterator[RouterProcess]:
    prefill = [engines["prefill-alpha"].url, engines["prefill-beta"].url]
    decode = [engines["decode-alpha"].url, engines["decode-beta"].url]
    args = ("--decode-slots", "1", "--queue-timeout", "20", "--health-interval", "0.2")
    with RouterProcess(prefill, decode, *args, "--admin-token", TOKEN) as router:
        wait_for(lambda: all(n["models"] for n in nodes(router)), what="models learned")
        yield router


def nodes(router: RouterProcess) -> list[dict[str, Any]]:
    answer = httpx.get(
        f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )
    return list(answer.json()["nodes"])


def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def test_the_router_learns_each_nodes_models(router: RouterProcess) -> None:
    learned = {(n["role"], n["url"]): n["models"] for n in nodes(router)}
    assert sorted(learned.values()) == [["alpha"], ["alpha"], ["beta"], ["beta"]]


def test_each_request_lands_on_its_models_engines(
    router: RouterProcess, engines: dict[str, EngineProcess]
) -> None:
    for engine in engines.values():
        engine.reset()
    sdk = client(router)
    for _ in range(3):
        for model in ("alpha", "beta"):
            answer = sdk.completions.create(model=model, prompt="one two three", max_tokens=4)
            assert answer.model == model
            chat = sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=3
            )
            assert chat.choices[0].message.content
    # A sim engine answers 404 to a model it does not serve: each got its own six, and
    # every one of them succeeded.
    for name, engine in engines.items():
        stats = engine.stats()
        assert (stats["requests"], stats["completed"], stats["failed"]) == (6, 6, 0), name


def test_a_model_nobody_serves_is_404_model_not_found_naming_the_served_ones(
    router: RouterProcess,
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(router).completions.create(model="gpt-7", prompt="hello", max_tokens=2)
    error = caught.value
    assert error.status_code == 404
    assert error.code == "model_not_found"
    assert error.body == {
        "message": "The model 'gpt-7' is not served here (served: alpha, beta)",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    listed = sorted(model.id for model in client(router).models.list())
    assert listed == ["alpha", "beta"]
    assert (
        router.metrics()["pd_router_requests_total{endpoint=completions,outcome=model_not_found}"]
        == 1
    )
    router.assert_idle()


def test_a_queue_on_one_model_holds_up_nobody_asking_for_another(
    router: RouterProcess, engines: dict[str, EngineProcess]
) -> None:
    burst(engines, [router], lambda: router.metrics()["pd_router_queue_depth"])
    router.assert_idle()


def test_with_shared_state_too_across_two_routers(
    engines: dict[str, EngineProcess], redis_server: RedisServer
) -> None:
    prefill = [engines["prefill-alpha"].url, engines["prefill-beta"].url]
    decode = [engines["decode-alpha"].url, engines["decode-beta"].url]
    args = ("--state", redis_server.url, "--decode-slots", "1", "--queue-timeout", "20")
    flush_state(redis_server.url)
    with (
        RouterProcess(prefill, decode, *args) as first,
        RouterProcess(prefill, decode, *args) as second,
    ):
        for router in (first, second):
            wait_for(lambda: model_not_found(router), what="models learned")
        burst(engines, [first, second], lambda: queued(redis_server.url))
        wait_for(lambda: slots_in_use(redis_server.url) == 0, what="Redis's count")


def model_not_found(router: RouterProcess) -> bool:
    answer = httpx.post(
        f"{router.url}/v1/completions", json={"model": "nobody", "prompt": "x"}, timeout=10
    )
    return answer.status_code == 404


def burst(
    engines: dict[str, EngineProcess], routers: list[RouterProcess], waiting: Callable[[], float]
) -> None:
    """alpha's one decode slot is held by a slow stream and two more alpha requests queue
    behind it (sent through the routers in turn); beta's requests are served meanwhile,
    each at once."""
    engines["decode-alpha"].configure(itl=0.05)
    try:
        finished: dict[str, float] = {}
        failures: list[BaseException] = []

        def ask(name: str, router: RouterProcess, model: str, tokens: int) -> None:
            try:
                sdk = client(router)
                sdk.completions.create(model=model, prompt="a b c", max_tokens=tokens)
                finished[name] = time.monotonic()
            except BaseException as exc:  # the test asserts there are none
                failures.append(exc)

        started = time.monotonic()
        alpha = [
            threading.Thread(target=ask, args=(f"alpha{i}", routers[i % len(routers)], "alpha", 30))
            for i in range(3)
        ]
        for thread in alpha:
            thread.start()
        wait_for(lambda: waiting() == 2, what="two alpha requests queued")
        for i in range(3):
            ask(f"beta{i}", routers[i % len(routers)], "beta", 4)
        assert waiting() == 2  # alpha's are still waiting
        for thread in alpha:
            thread.join(timeout=30)
        assert not failures
        # Each alpha request takes ~1.5 s on its one slot; the betas were done before the
        # first alpha was.
        assert max(finished[f"beta{i}"] for i in range(3)) < min(
            finished[f"alpha{i}"] for i in range(3)
        ), {name: round(at - started, 2) for name, at in finished.items()}
    finally:
        engines["decode-alpha"].configure(itl=0.0)


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "state"])
@pytest.mark.parametrize("queue_timeout", ["0", "0.5"], ids=["fail-fast", "queued"])
def test_a_429_names_the_model_whose_nodes_are_busy(
    engines: dict[str, EngineProcess], redis_server: RedisServer, shared: bool, queue_timeout: str
) -> None:
    """It said 'all decode nodes busy' while beta's node had a free slot."""
    prefill = [engines["prefill-alpha"].url, engines["prefill-beta"].url]
    decode = [engines["decode-alpha"].url, engines["decode-beta"].url]
    args = ["--decode-slots", "1", "--queue-timeout", queue_timeout]
    if shared:
        flush_state(redis_server.url)
        args += ["--state", redis_server.url]
    engines["decode-alpha"].configure(itl=0.1)
    try:
        with RouterProcess(prefill, decode, *args) as router:
            wait_for(lambda: model_not_found(router), what="models learned")
            body = {"model": "alpha", "prompt": "a b c", "max_tokens": 60, "stream": True}
            holder = RawClient(router.url, "/v1/completions", body)
            holder.read_until(b"data: ")  # alpha's one slot is held
            with pytest.raises(openai.RateLimitError) as caught:
                client(router).completions.create(model="alpha", prompt="x", max_tokens=2)
            served = client(router).completions.create(model="beta", prompt="x", max_tokens=2)
            holder.hang_up()
            router.assert_idle()
    finally:
        engines["decode-alpha"].configure(itl=0.0)
    assert served.model == "beta"  # beta's node was free all along
    error = caught.value
    assert (error.status_code, error.code) == (429, "decode_nodes_busy")
    if queue_timeout == "0":
        assert error.body["message"] == "all decode nodes serving 'alpha' busy"
    else:
        assert error.body["message"] == "no decode node serving 'alpha' free after waiting 0.5s"

"""End to end: the router's CLI on loopback, simulated engines as separate servers, the
``openai`` SDK as the client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from pd_router.sim.fleet import SimFleet
from tests.helpers import RawClient, RouterProcess, streamed_text, wait_for

SIM_DEFAULTS = {
    "prefill": {"prefill_delay": 0, "fail_status": None},
    "decode": {
        "accept_delay": 0,
        "ttft": 0,
        "itl": 0,
        "fail_status": None,
        "fail_after_tokens": None,
    },
}


def echo(prompt: str, tokens: int) -> str:
    """What a simulated decode engine answers: the pulled prompt's words, repeated."""
    words = prompt.split()
    return "".join(" " + words[i % len(words)] for i in range(tokens))


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=2, decode_args=["--slots", "64"]) as fleet:
        yield fleet


@pytest.fixture
def sims(fleet: SimFleet) -> Iterator[SimFleet]:
    """The module's fleet with default behaviour and zeroed counters for each test."""
    for engine in fleet.engines:
        engine.configure(**SIM_DEFAULTS[engine.role])
        engine.reset()
    yield fleet


@pytest.fixture(scope="module")
def router(fleet: SimFleet) -> Iterator[RouterProcess]:
    prefill = [e.url for e in fleet.prefill]
    with RouterProcess(prefill, [e.url for e in fleet.decode], "--decode-slots", "32") as router:
        yield router


def client_for(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def test_completion(router: RouterProcess, sims: SimFleet) -> None:
    prompt = "the quick brown fox jumps"
    answer = client_for(router).completions.create(model="sim-model", prompt=prompt, max_tokens=7)
    assert answer.choices[0].text == echo(prompt, 7)
    assert answer.usage is not None and answer.usage.prompt_tokens == 5
    # The decode engine claims all 5 prompt tokens were cached; the prefill engine knows
    # none were.
    assert answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    router.assert_idle()


def test_cached_tokens_are_the_prefill_engines(router: RouterProcess, sims: SimFleet) -> None:
    prompt = " ".join(f"w{i}" for i in range(40))  # 2 full blocks of 16 + 8
    client = client_for(router)
    client.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_streamed_completion_with_usage(router: RouterProcess, sims: SimFleet) -> None:
    prompt = "one two three"
    stream = client_for(router).completions.create(
        model="sim-model",
        prompt=prompt,
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == echo(prompt, 9)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == 3 and usage.completion_tokens == 9
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0
    router.assert_idle()


def test_chat_stream_and_not(router: RouterProcess, sims: SimFleet) -> None:
    client = client_for(router)
    messages = [{"role": "user", "content": "hello there router"}]
    rendered = "user: hello there router"
    answer = client.chat.completions.create(model="sim-model", messages=messages, max_tokens=5)
    assert answer.choices[0].message.content == echo(rendered, 5)
    assert answer.usage is not None and answer.usage.prompt_tokens == 4
    stream = client.chat.completions.create(
        model="sim-model", messages=messages, max_tokens=6, stream=True
    )
    text = streamed_text(stream)
    assert text == echo(rendered, 6)
    router.assert_idle()


def test_the_request_id_is_the_same_at_prefill_decode_and_client(
    router: RouterProcess, sims: SimFleet
) -> None:
    response = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "sim-model", "prompt": "a b", "max_tokens": 2},
        headers={"X-Request-Id": "trace-42"},
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-42"
    assert "trace-42" in sims.prefill[0].stats()["request_ids"]
    assert any("trace-42" in d.stats()["request_ids"] for d in sims.decode)


def test_64_concurrent_requests_each_get_their_own_prompts_answer(
    router: RouterProcess, sims: SimFleet
) -> None:
    for engine in sims.decode:
        engine.configure(itl=0.01)
    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[str, str]:
        prompt = f"prompt{i} alpha{i} beta{i}"
        stream = await client.completions.create(
            model="sim-model", prompt=prompt, max_tokens=8, stream=True
        )
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        return prompt, text

    async def all_of_them() -> list[tuple[str, str]]:
        async with client:
            return await asyncio.gather(*(one(i) for i in range(64)))

    for prompt, text in asyncio.run(all_of_them()):
        assert text == echo(prompt, 8)
    assert sum(d.stats()["completed"] for d in sims.decode) == 64
    assert all(d.stats()["completed"] > 0 for d in sims.decode), "both decode nodes served"
    router.assert_idle()


def test_models_and_health(router: RouterProcess, sims: SimFleet) -> None:
    models = client_for(router).models.list()
    assert [m.id for m in models.data] == ["sim-model"]
    health = httpx.get(f"{router.url}/health")
    assert health.status_code == 200 and health.json()["decode_slots"] == 64


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{", None),
        (b'{"prompt": "x"}', "model"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "ten"}', "max_tokens"),
    ],
)
def test_bad_requests_get_a_400_and_cost_nobody_a_slot(
    router: RouterProcess, sims: SimFleet, body: bytes, param: str | None
) -> None:
    response = httpx.post(
        f"{router.url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    assert sims.prefill[0].stats()["requests"] == 0
    router.assert_idle()


def test_prefill_failure_passes_its_status_and_message_and_frees_the_slot(
    router: RouterProcess, sims: SimFleet
) -> None:
    sims.prefill[0].configure(fail_status=503, fail_message="prefill overloaded")
    with pytest.raises(openai.APIStatusError) as caught:
        client_for(router).completions.create(model="sim-model", prompt="x y", max_tokens=3)
    assert caught.value.status_code == 503
    assert "prefill overloaded" in caught.value.message
    assert sum(d.stats()["requests"] for d in sims.decode) == 0
    router.assert_idle()


def test_decode_failure_before_streaming_passes_its_status(
    router: RouterProcess, sims: SimFleet
) -> None:
    for engine in sims.decode:
        engine.configure(fail_status=400, fail_message="context too long for decode")
    response = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "sim-model", "prompt": "x y", "stream": True},
    )
    assert response.status_code == 400
    assert "context too long for decode" in response.json()["error"]["message"]
    router.assert_idle()


def test_decode_death_mid_stream_is_one_error_event_then_done(
    router: RouterProcess, sims: SimFleet
) -> None:
    for engine in sims.decode:
        engine.configure(fail_after_tokens=3)
    response = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "sim-model", "prompt": "a b c", "max_tokens": 10, "stream": True},
    )
    assert response.status_code == 200
    events = [e for e in response.text.split("\n\n") if e]
    assert len(events) == 5, events
    assert all('"text"' in e for e in events[:3])
    error = json.loads(events[3].removeprefix("data: "))["error"]
    assert error["type"] == "upstream_error" and "stream" in error["message"]
    assert events[4] == "data: [DONE]"
    router.assert_idle()


def test_unreachable_prefill_is_a_clear_502(sims: SimFleet) -> None:
    # Nothing listens on port 9 (discard) on loopback.
    with RouterProcess(["http://127.0.0.1:9"], [sims.decode[0].url]) as router:
        response = httpx.post(
            f"{router.url}/v1/completions", json={"model": "sim-model", "prompt": "x"}, timeout=30
        )
        assert response.status_code == 502
        message = response.json()["error"]["message"]
        assert message.startswith("prefill engine http://127.0.0.1:9/"), message
        assert "unreachable" in message, message
        router.assert_idle()


def single_slot_router(sims: SimFleet, *args: str) -> RouterProcess:
    return RouterProcess([sims.prefill[0].url], [sims.decode[0].url], *args)


def test_fail_fast_429_when_the_pool_is_full(sims: SimFleet) -> None:
    sims.decode[0].configure(itl=0.05)
    with single_slot_router(sims) as router:
        holder = RawClient(router.url, "/v1/completions", STREAM_40)
        holder.read_until(b"data: ")
        response = httpx.post(f"{router.url}/v1/completions", json=STREAM_40)
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json() == {
            "error": {
                "message": "all decode nodes busy",
                "type": "rate_limit_error",
                "param": None,
                "code": "decode_nodes_busy",
            }
        }
        assert holder.read_all().endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        router.assert_idle()


def test_queue_timeout_429_names_the_wait(sims: SimFleet) -> None:
    sims.decode[0].configure(itl=0.1)
    with single_slot_router(sims, "--queue-timeout", "0.5") as router:
        holder = RawClient(router.url, "/v1/completions", STREAM_40)
        holder.read_until(b"data: ")
        response = httpx.post(f"{router.url}/v1/completions", json=STREAM_40)
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["message"] == "no decode node free after waiting 0.5s"
        holder.hang_up()
        router.assert_idle()


def test_a_queued_request_is_served_when_the_slot_frees(sims: SimFleet) -> None:
    sims.decode[0].configure(itl=0.02)
    with single_slot_router(sims, "--queue-timeout", "30") as router:
        holder = RawClient(router.url, "/v1/completions", STREAM_40)
        holder.read_until(b"data: ")
        answer = client_for(router).completions.create(
            model="sim-model", prompt="late comer", max_tokens=4
        )
        assert answer.choices[0].text == echo("late comer", 4)
        assert holder.read_all().endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        router.assert_idle()
        wait_for(lambda: "for decode node" in router.log(), what="the queue log line")
        line = next(x for x in router.log().splitlines() if "for decode node" in x)
        assert f"for decode node {sims.decode[0].url} request_id=" in line
        assert float(line.split("queued ")[1].split("s ")[0]) > 0.1


STREAM_40 = {"model": "sim-model", "prompt": "hold the slot", "max_tokens": 40, "stream": True}


def test_the_admin_api_lists_the_requests_in_flight_and_where_each_is(sims: SimFleet) -> None:
    """``GET /admin/requests``: this router's requests, oldest first, each with its phase
    and nodes. Each phase is held until the test aborts the request (a sim that sleeps
    60 s), so what is listed is read while it is so, however slow the machine."""
    admin = {"authorization": "Bearer t0ken"}

    def listed() -> list[dict[str, object]]:
        answer = httpx.get(f"{router.url}/admin/requests", headers=admin, timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()["requests"]  # type: ignore[no-any-return]

    def phases() -> list[object]:
        return [view["phase"] for view in listed()]

    sims.decode[0].configure(itl=0.05)
    prefill_id, decode_id = 0, 1
    with single_slot_router(sims, "--queue-timeout", "120", "--admin-token", "t0ken") as router:
        assert httpx.get(f"{router.url}/admin/requests", timeout=10).status_code == 401
        assert listed() == []
        holder = RawClient(router.url, "/v1/completions", {**STREAM_40, "max_tokens": 4000})
        holder.read_until(b"data: ")
        waiters = []
        for name, body in [
            ("queued", {"model": "sim-model", "prompt": "wait in line", "max_tokens": 4}),
            ("chat", {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}),
        ]:
            path = "/v1/chat/completions" if name == "chat" else "/v1/completions"
            waiters.append(RawClient(router.url, path, body))
            wait_for(lambda: len(listed()) == len(waiters) + 1, what=f"{name} listed")
        first, second, third = listed()
        assert first["phase"] == "answering" and first["stream"] is True
        assert (first["prefill_node"], first["decode_node"]) == (prefill_id, decode_id)
        assert int(first["bytes_sent"]) > 0  # type: ignore[call-overload]
        for view, endpoint in [(second, "completions"), (third, "chat")]:
            assert view["phase"] == "queued" and view["endpoint"] == endpoint
            assert (view["prefill_node"], view["decode_node"], view["stream"]) == (
                None,
                None,
                False,
            )
        assert first["age_s"] >= second["age_s"] >= third["age_s"] > 0  # type: ignore[operator]
        assert (first["key"], first["model"]) == (None, "sim-model")
        oldest = httpx.get(f"{router.url}/admin/requests?limit=1", headers=admin, timeout=10)
        assert oldest.json()["in_flight"] == 3
        assert [view["id"] for view in oldest.json()["requests"]] == [first["id"]]
        for bad in ["0", "10001", "1_0", "x"]:
            refused = httpx.get(f"{router.url}/admin/requests?limit={bad}", headers=admin)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "limit"

        # The slot freed: the next in line is in prefill, on both its nodes, until aborted.
        sims.prefill[0].configure(prefill_delay=60)
        holder.hang_up()
        wait_for(lambda: phases() == ["prefill", "queued"], what="the first waiter in prefill")
        in_prefill = listed()[0]
        assert in_prefill["id"] == second["id"]
        assert (in_prefill["prefill_node"], in_prefill["decode_node"]) == (prefill_id, decode_id)
        # The last: prefilled at once, then with the decode engine, which waits 60 s. Set
        # before the abort frees the slot: its prefill may start before a call after it
        # (the first waiter's 60 s were taken when its prefill began).
        sims.prefill[0].configure(prefill_delay=0)
        sims.decode[0].configure(ttft=60)
        abort = f"{router.url}/admin/requests/{second['id']}/abort"
        assert httpx.post(abort, headers=admin, timeout=10).status_code == 200
        wait_for(lambda: phases() == ["decode"], what="the chat with the decode engine")
        abort = f"{router.url}/admin/requests/{third['id']}/abort"
        assert httpx.post(abort, headers=admin, timeout=10).status_code == 200
        wait_for(lambda: listed() == [], what="nothing in flight")
        for waiter in waiters:  # each got its one terminal error (a JSON body, keep-alive)
            answer = waiter.read_until(b'"code":"abort"}}', timeout=30)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
        router.assert_idle()


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/admin/nodes"), ("POST", "/admin/nodes/0/drain"), ("GET", "/admin")],
)
def test_the_admin_api_says_it_is_off_and_how_to_turn_it_on(
    router: RouterProcess, method: str, path: str
) -> None:
    """This router has no --admin-token: the path is right, the API is off."""
    response = httpx.request(method, router.url + path, headers={"authorization": "Bearer x"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": f"{method} {path}: the admin API is off; start pd-router with "
            "--admin-token TOKEN (or PD_ROUTER_ADMIN_TOKEN, or admin_token in the config file) "
            "to turn it on",
            "type": "invalid_request_error",
            "param": None,
            "code": "admin_disabled",
        }
    }


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/v1/chat/completions",
            {"model": "sim-model", "messages": "hi"},
            "messages",
            "'messages' must be a non-empty list of messages, got a string",
        ),
        (
            "/v1/chat/completions",
            {"model": "sim-model", "messages": []},
            "messages",
            "'messages' must be a non-empty list of messages, got an empty list",
        ),
        ("/v1/chat/completions", {"model": "sim-model"}, "messages", "'messages' is required"),
        (
            "/v1/chat/completions",
            {"model": "sim-model", "messages": [{"role": "user"}, {"content": "hi"}]},
            "messages",
            "'messages[1].role' is required",
        ),
        (
            "/v1/chat/completions",
            {"model": "sim-model", "messages": ["hi"]},
            "messages",
            "'messages[0]' must be an object, got a string",
        ),
        (
            "/v1/completions",
            {"model": 7, "prompt": "hi"},
            "model",
            "'model' must be a non-empty string, got 7",
        ),
        ("/v1/completions", {"prompt": "hi"}, "model", "'model' is required"),
        (
            "/v1/completions",
            {"model": "sim-model", "prompt": None},
            "prompt",
            "'prompt' must be a string, a list of strings, a list of token ids (integers) or a "
            "list of such lists, got null",
        ),
        (
            "/v1/completions",
            {"model": "sim-model", "prompt": "hi", "max_tokens": "8"},
            "max_tokens",
            "'max_tokens' must be a positive integer, got a string",
        ),
    ],
)
def test_a_field_of_the_wrong_type_is_told_so_not_that_it_is_missing(
    router: RouterProcess, path: str, body: dict[str, object], param: str, message: str
) -> None:
    response = httpx.post(router.url + path, json=body)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }

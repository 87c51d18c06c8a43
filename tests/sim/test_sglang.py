"""The simulated engines in SGLang's dialect (``--dialect sglang``), driven over loopback
the way SGLang's router drives them: one body, with the bootstrap fields, sent to a prefill
and a decode engine at once."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pd_router.sim.fleet import EngineProcess, SimFleet
from tests.helpers import wait_for
from tests.sim.helpers import body_for, sse_events

SGLANG = ["--dialect", "sglang"]
# A prefill whose rooms time out fast; the fleet's wait as long as a slow machine needs.
SHORT_TIMEOUT = ["--bootstrap-timeout", "1"]


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(1, 1, prefill_args=[*SGLANG, "--block-size", "4"], decode_args=SGLANG) as sims:
        yield sims


@pytest.fixture(scope="module")
def impatient() -> Iterator[EngineProcess]:
    with EngineProcess("prefill", [*SGLANG, *SHORT_TIMEOUT]) as prefill:
        yield prefill


@pytest.fixture(autouse=True)
def clean(fleet: SimFleet, impatient: EngineProcess) -> None:
    for engine in [*fleet.engines, impatient]:
        engine.configure(fail_after_tokens=None)
        engine.reset()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as started:
        yield started


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as started:
        yield started


def new_room() -> int:
    return random.randint(0, 2**63 - 1)  # nosec B311: as SGLang's router draws one


def sglang_body(
    prompt: str, prefill: EngineProcess, chat: bool = False, room: int | None = None, **extra: Any
) -> dict[str, Any]:
    """What SGLang's router sends both engines: the client's body and the bootstrap fields."""
    bootstrap = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.port,
        "bootstrap_room": new_room() if room is None else room,
    }
    return body_for(prompt, chat, **bootstrap, **extra)


def path_for(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def post(
    pool: ThreadPoolExecutor, client: httpx.Client, engine: EngineProcess, body: dict[str, Any]
) -> Future[httpx.Response]:
    chat = "messages" in body
    return pool.submit(client.post, engine.url + path_for(chat), json=body)


def take(client: httpx.Client, prefill: EngineProcess, room: object) -> httpx.Response:
    return client.post(prefill.url + "/sglang/bootstrap", json={"room": room})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_one_body_sent_to_both_engines(
    client: httpx.Client, pool: ThreadPoolExecutor, fleet: SimFleet, chat: bool, stream: bool
) -> None:
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    body = sglang_body(
        "alpha beta gamma",
        prefill,
        chat,
        max_tokens=4,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
    )
    # Both at once, as SGLang's router sends them.
    prefill_answer = post(pool, client, prefill, body)
    decode_answer = post(pool, client, decode, body)
    decoded, prefilled = decode_answer.result(), prefill_answer.result()
    assert (decoded.status_code, prefilled.status_code) == (200, 200), (decoded, prefilled)

    tokens = ["user:", "alpha", "beta", "gamma"] if chat else ["alpha", "beta", "gamma"]
    expected = "".join(" " + tokens[i % len(tokens)] for i in range(4))
    full_usage = {
        "prompt_tokens": len(tokens),
        "total_tokens": len(tokens) + 4,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": len(tokens)},
    }
    first_usage = {
        "prompt_tokens": len(tokens),
        "total_tokens": len(tokens) + 1,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert answered(decoded, chat, stream) == (expected, "length", full_usage)
    assert answered(prefilled, chat, stream) == (" " + tokens[0], "length", first_usage)
    stats = prefill.stats()
    assert (stats["rooms_taken"], stats["transfers"], stats["rooms_held"]) == (1, 1, 0)
    assert decode.stats()["transfers"] == 1


def answered(response: httpx.Response, chat: bool, stream: bool) -> tuple[str, str, Any]:
    """An answer's text, finish reason and usage, streamed or not, checking its framing."""
    if not stream:
        assert response.headers["content-type"] == "application/json"
        result = response.json()
        choice = result["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return text, choice["finish_reason"], result["usage"]
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.content)
    assert events[-1] == "[DONE]"
    usage_event = events[-2]
    assert usage_event["choices"] == []
    content = events[:-2]
    if chat:
        assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = content[1:]
    texts = [
        e["choices"][0]["delta"]["content"] if chat else e["choices"][0]["text"] for e in content
    ]
    finishes = [e["choices"][0]["finish_reason"] for e in content]
    assert all(finish is None for finish in finishes[:-1])
    return "".join(texts), finishes[-1], usage_event["usage"]


def test_the_decode_answers_from_the_prefill_tokens(
    client: httpx.Client, pool: ThreadPoolExecutor, fleet: SimFleet
) -> None:
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    room = new_room()
    prefilled = post(pool, client, prefill, sglang_body("why yes indeed", prefill, room=room))
    decoded = post(
        pool, client, decode, sglang_body("x marks the spot", prefill, room=room, max_tokens=3)
    )
    assert decoded.result().json()["choices"][0]["text"] == " why yes indeed"
    assert prefilled.result().json()["choices"][0]["text"] == " why"


def test_a_decode_asking_before_the_prefill_request_arrives(
    client: httpx.Client, pool: ThreadPoolExecutor, fleet: SimFleet
) -> None:
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    body = sglang_body("early bird", prefill, max_tokens=2)
    decoded = post(pool, client, decode, body)
    wait_for(lambda: prefill.stats()["rooms_awaited"] == 1, what="the decode's take to wait")
    assert client.post(prefill.url + "/v1/completions", json=body).status_code == 200
    assert decoded.result().json()["choices"][0]["text"] == " early bird"


def test_a_room_nobody_takes_times_out(client: httpx.Client, impatient: EngineProcess) -> None:
    room = new_room()
    started = time.monotonic()
    response = client.post(
        impatient.url + "/v1/completions", json=sglang_body("lonely", impatient, room=room)
    )
    assert time.monotonic() - started >= 1.0
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": f"no decode engine took bootstrap room {room} within 1 s",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    stats = impatient.stats()
    assert (stats["bootstrap_timeouts"], stats["rooms_taken"], stats["rooms_held"]) == (1, 0, 0)
    late = take(client, impatient, room)
    assert late.status_code == 404
    assert late.json()["error"]["message"] == (
        f"bootstrap room {room} was forgotten: its prefill request ended before a decode "
        "engine took it"
    )


def test_a_decode_whose_room_never_comes_fails(
    client: httpx.Client, fleet: SimFleet, impatient: EngineProcess
) -> None:
    decode = fleet.decode[0]
    room = new_room()
    response = client.post(
        decode.url + "/v1/completions", json=sglang_body("a", impatient, room=room)
    )
    assert response.status_code == 500
    assert response.json()["error"]["message"] == (
        f"KV transfer failed: http://127.0.0.1:{impatient.port}/sglang/bootstrap answered 404: "
        f"no prompt was computed for bootstrap room {room} within 1 s"
    )
    stats = decode.stats()
    assert (stats["pull_failures"], stats["transfers"]) == (1, 0)
    assert impatient.stats()["rooms_awaited"] == 0


def test_a_decode_fetches_from_the_host_as_sent(client: httpx.Client, fleet: SimFleet) -> None:
    """SGLang's router brackets an IPv6 host: the decode uses it as it is (nothing listens
    on [::1] here, so the fetch fails, naming the URL)."""
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    body = {**sglang_body("a", prefill), "bootstrap_host": "[::1]"}
    response = client.post(decode.url + "/v1/completions", json=body)
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert message.startswith(f"KV transfer failed: http://[::1]:{prefill.port}/sglang/bootstrap")


def test_a_room_is_taken_once(
    client: httpx.Client, pool: ThreadPoolExecutor, fleet: SimFleet
) -> None:
    prefill = fleet.prefill[0]
    room = new_room()
    prefilled = post(pool, client, prefill, sglang_body("one two", prefill, room=room))
    first = take(client, prefill, room)
    assert (first.status_code, first.json()) == (200, {"tokens": ["one", "two"]})
    assert prefilled.result().status_code == 200
    again = take(client, prefill, room)
    assert again.status_code == 404
    assert again.json()["error"]["message"] == f"bootstrap room {room} was already taken"
    for bad in (None, "1", True, -1, 2**63):
        refused = take(client, prefill, bad)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "room"


def test_a_room_in_use_is_refused(
    client: httpx.Client, pool: ThreadPoolExecutor, fleet: SimFleet
) -> None:
    prefill = fleet.prefill[0]
    room = new_room()
    body = sglang_body("first come", prefill, room=room)
    first = post(pool, client, prefill, body)
    wait_for(lambda: prefill.stats()["rooms_held"] == 1, what="the room to be held")
    second = client.post(prefill.url + "/v1/completions", json=body)
    assert second.status_code == 400
    assert (
        second.json()["error"]["message"] == f"bootstrap room {room} is in use by another request"
    )
    assert take(client, prefill, room).status_code == 200
    assert first.result().status_code == 200


def test_a_router_hanging_up_forgets_the_room(client: httpx.Client, fleet: SimFleet) -> None:
    prefill = fleet.prefill[0]
    room = new_room()
    with httpx.Client(timeout=0.5) as hasty:
        with pytest.raises(httpx.ReadTimeout):
            hasty.post(
                prefill.url + "/v1/completions", json=sglang_body("gone", prefill, room=room)
            )
    wait_for(lambda: prefill.stats()["aborted"] == 1, what="the prefill request to end")
    assert prefill.stats()["rooms_held"] == 0
    late = take(client, prefill, room)
    assert late.status_code == 404
    assert "was forgotten" in late.json()["error"]["message"]


def test_a_prefill_that_crashes_fails_the_waiting_decode(
    client: httpx.Client, pool: ThreadPoolExecutor, fleet: SimFleet
) -> None:
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    prefill.configure(fail_after_tokens=0)
    body = sglang_body("doomed", prefill)
    decoded = post(pool, client, decode, body)
    wait_for(lambda: prefill.stats()["rooms_awaited"] == 1, what="the decode's take to wait")
    with pytest.raises(httpx.RemoteProtocolError):
        client.post(prefill.url + "/v1/completions", json=body)
    response = decoded.result()
    assert response.status_code == 500
    assert "was forgotten" in response.json()["error"]["message"]


MISSING = "is missing: the sglang dialect needs bootstrap_host, bootstrap_port and bootstrap_room"
BAD_FIELDS = [
    ({"bootstrap_host": None}, "bootstrap_host", "bootstrap_host " + MISSING),
    ({"bootstrap_port": None}, "bootstrap_port", "bootstrap_port " + MISSING),
    ({"bootstrap_room": None}, "bootstrap_room", "bootstrap_room " + MISSING),
    ({"bootstrap_host": ""}, "bootstrap_host", "bootstrap_host must be a non-empty string"),
    ({"bootstrap_host": 1}, "bootstrap_host", "bootstrap_host must be a non-empty string"),
    ({"bootstrap_port": 0}, "bootstrap_port", "bootstrap_port must be an integer in [1, 65535]"),
    (
        {"bootstrap_port": 65536},
        "bootstrap_port",
        "bootstrap_port must be an integer in [1, 65535]",
    ),
    ({"bootstrap_port": "80"}, "bootstrap_port", "bootstrap_port must be an integer in [1, 65535]"),
    (
        {"bootstrap_room": True},
        "bootstrap_room",
        "bootstrap_room must be an integer in [0, 2**63 - 1]",
    ),
    (
        {"bootstrap_room": -1},
        "bootstrap_room",
        "bootstrap_room must be an integer in [0, 2**63 - 1]",
    ),
    (
        {"bootstrap_room": 2**63},
        "bootstrap_room",
        "bootstrap_room must be an integer in [0, 2**63 - 1]",
    ),
    (
        {"bootstrap_room": 1.5},
        "bootstrap_room",
        "bootstrap_room must be an integer in [0, 2**63 - 1]",
    ),
    (
        {"bootstrap_room": [1, 2]},
        "bootstrap_room",
        "bootstrap_room is a list: the sim takes one prompt per request, with one room",
    ),
]


@pytest.mark.parametrize(("change", "param", "message"), BAD_FIELDS)
def test_missing_or_bad_fields_are_refused(
    client: httpx.Client, fleet: SimFleet, change: dict[str, Any], param: str, message: str
) -> None:
    prefill = fleet.prefill[0]
    body = {**sglang_body("a b", prefill), **change}
    for engine in fleet.engines:
        response = client.post(engine.url + "/v1/completions", json=body)
        assert response.status_code == 400, engine
        assert response.json()["error"] == {
            "message": message,
            "type": "BadRequestError",
            "param": param,
            "code": 400,
        }


def test_standalone_decode_and_prefill_naming(
    client: httpx.Client, pool: ThreadPoolExecutor, fleet: SimFleet
) -> None:
    prefill = fleet.prefill[0]
    args = [*SGLANG, "--standalone", "--name-prefill", "--default-max-tokens", "3"]
    with EngineProcess("decode", args) as decode:
        alone = client.post(decode.url + "/v1/completions", json=body_for("just me", False))
        assert alone.status_code == 200, alone.text
        assert alone.json()["choices"][0]["text"] == " just me just"
        body = sglang_body("from afar", prefill)
        prefilled, decoded = post(pool, client, prefill, body), post(pool, client, decode, body)
        text = decoded.result().json()["choices"][0]["text"]
        assert text == f"[prefill 127.0.0.1:{prefill.port}] from afar from"
        assert prefilled.result().status_code == 200
        partial = client.post(
            decode.url + "/v1/completions", json=body_for("a", False, bootstrap_room=1)
        )
        assert partial.status_code == 400
        assert partial.json()["error"]["param"] == "bootstrap_host"

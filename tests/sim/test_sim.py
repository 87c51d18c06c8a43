"""The simulated engines, driven over loopback the way a P/D router drives vLLM."""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pd_router.engines.handshake import PREFILL_KV_PARAMS
from pd_router.sim.fleet import EngineProcess, SimFleet
from pd_router.sim.kvcache import PinnedBlocks, PrefixCache
from pd_router.sim.tokens import PromptError, chat_tokens, completion_tokens
from tests.sim.helpers import MODEL, body_for, sse_events

BLOCK_SIZE = 4
DEFAULT_CONFIG: dict[str, Any] = {
    "prefill_delay": 0.0,
    "prefill_per_token": 0.0,
    "accept_delay": 0.0,
    "ttft": 0.0,
    "itl": 0.0,
    "default_max_tokens": 16,
    "fail_after_tokens": None,
    "fail_status": None,
    "fail_message": None,
}


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(
        1, 1, prefill_args=["--block-size", str(BLOCK_SIZE)], decode_args=["--slots", "2"]
    ) as started:
        yield started


@pytest.fixture(autouse=True)
def clean(fleet: SimFleet) -> None:
    for engine in fleet.engines:
        engine.configure(**DEFAULT_CONFIG)
        engine.reset()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as started:
        yield started


def path_for(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def do_prefill(
    client: httpx.Client,
    fleet: SimFleet,
    prompt: str,
    chat: bool = False,
    request_id: str | None = None,
) -> dict[str, Any]:
    headers = {"X-Request-Id": request_id} if request_id else {}
    body = body_for(prompt, chat, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    response = client.post(fleet.prefill[0].url + path_for(chat), json=body, headers=headers)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def do_decode(
    client: httpx.Client,
    fleet: SimFleet,
    prompt: str,
    kv: dict[str, Any] | None,
    chat: bool = False,
    **extra: Any,
) -> httpx.Response:
    body = body_for(prompt, chat, **extra)
    if kv is not None:
        body["kv_transfer_params"] = kv
    return client.post(fleet.decode[0].url + path_for(chat), json=body)


def expected_text(tokens: list[str], count: int) -> str:
    return "".join(" " + tokens[i % len(tokens)] for i in range(count))


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# Pure parts.


def test_tokenization() -> None:
    assert completion_tokens({"prompt": "a  b\nc"}) == ["a", "b", "c"]
    assert completion_tokens({"prompt": [1, 2, 3]}) == ["1", "2", "3"]
    assert completion_tokens({"prompt": ["x y"]}) == ["x", "y"]
    assert completion_tokens({"prompt": [[7, 8]]}) == ["7", "8"]
    with pytest.raises(PromptError, match="batched"):
        completion_tokens({"prompt": ["a", "b"]})
    with pytest.raises(PromptError):
        completion_tokens({"prompt": [True]})
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}],
        },
    ]
    assert chat_tokens({"messages": messages}) == ["system:", "be", "brief", "user:", "hi", "there"]


def test_pinned_blocks_lease_and_pull() -> None:
    now = [0.0]
    blocks = PinnedBlocks(block_size=4, lease=10.0, clock=lambda: now[0])
    first = blocks.pin("a", ["t"] * 9)
    assert len(first) == 3 and blocks.blocks_pinned == 3
    second = blocks.pin("b", ["t"] * 4)
    assert second == [3]
    assert blocks.pull("a", [0, 1]) is None
    assert blocks.pull("a", first) == ["t"] * 9
    assert blocks.pull("a", first) is None
    now[0] = 11.0
    assert blocks.expire() == 1 and blocks.blocks_pinned == 0


def cached(cache: PrefixCache, tokens: list[str]) -> int:
    """A prefill: what was cached, then its blocks are."""
    hits, hashes = cache.lookup(tokens)
    cache.insert(hashes)
    return hits


def test_prefix_cache_counts_leading_full_blocks() -> None:
    cache = PrefixCache(block_size=2)
    assert cached(cache, ["a", "b", "c", "d", "e"]) == 0
    assert cached(cache, ["a", "b", "c", "d", "e"]) == 4
    assert cached(cache, ["a", "b", "x", "d"]) == 2
    assert cached(cache, ["z", "b", "c", "d"]) == 0
    assert cache.lookup(["a", "b", "c", "d"])[0] == 4, "a lookup alone inserts nothing"


def test_prefix_cache_evicts_the_least_recently_used_blocks() -> None:
    cache = PrefixCache(block_size=2, capacity=4)
    cached(cache, list("abcd"))  # 2 blocks
    cached(cache, list("wxyz"))  # 4: full
    assert cached(cache, list("ab")) == 2  # "ab" is now the most recent
    cached(cache, list("pq"))  # evicts the oldest: the block "cd"
    assert cache.blocks == 4
    assert cached(cache, list("abcd")) == 2, "ab kept, cd evicted"
    # As vLLM frees a request's blocks last to first: a prompt's tail goes before its
    # opening.
    assert cached(cache, list("wxyz")) == 2, "yz was the oldest when cd came back, not wx"
    cache.clear()
    assert cache.blocks == 0 and cached(cache, list("ab")) == 0


# Engines over HTTP.


def test_health_and_models(client: httpx.Client, fleet: SimFleet) -> None:
    for engine in fleet.engines:
        assert client.get(engine.url + "/health").json() == {"status": "ok"}
        models = client.get(engine.url + "/v1/models").json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == MODEL
        assert models["data"][0]["owned_by"] == "pd-router-sim"


def test_prefill_response_is_a_vllm_handshake(client: httpx.Client, fleet: SimFleet) -> None:
    prefill = fleet.prefill[0]
    result = do_prefill(client, fleet, "one two three four five", request_id="req-1")
    assert result["id"] == "cmpl-req-1"
    assert result["object"] == "text_completion"
    assert result["choices"][0]["text"] == " one"
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["usage"]["prompt_tokens"] == 5
    assert result["usage"]["completion_tokens"] == 1
    kv = result["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert len(kv["remote_block_ids"]) == 2  # ceil(5 / 4)
    assert kv["remote_engine_id"] == prefill.engine_id
    assert kv["remote_request_id"] == "req-1"
    assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", prefill.port)
    assert kv["tp_size"] == 1
    assert prefill.stats()["request_ids"] == ["req-1"]


def test_completion_non_streaming(client: httpx.Client, fleet: SimFleet) -> None:
    prompt = "alpha beta gamma"
    kv = do_prefill(client, fleet, prompt)["kv_transfer_params"]
    response = do_decode(client, fleet, prompt, kv, max_tokens=5)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "text_completion"
    assert result["choices"][0]["text"] == " alpha beta gamma alpha beta"
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 8,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_completion_streaming(client: httpx.Client, fleet: SimFleet) -> None:
    prompt = "red green blue"
    kv = do_prefill(client, fleet, prompt)["kv_transfer_params"]
    response = do_decode(
        client, fleet, prompt, kv, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.content)
    assert events[-1] == "[DONE]"
    tokens, usage_event = events[:4], events[4]
    assert [e["choices"][0]["text"] for e in tokens] == [" red", " green", " blue", " red"]
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None, None, None, "length"]
    assert all(e["object"] == "text_completion" for e in tokens)
    assert usage_event["choices"] == []
    assert usage_event["usage"]["completion_tokens"] == 4
    assert usage_event["usage"]["prompt_tokens_details"]["cached_tokens"] == 3


def test_chat_non_streaming(client: httpx.Client, fleet: SimFleet) -> None:
    kv = do_prefill(client, fleet, "hello world", chat=True)["kv_transfer_params"]
    response = do_decode(client, fleet, "hello world", kv, chat=True, max_completion_tokens=4)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"] == {
        "role": "assistant",
        "content": " user: hello world user:",
    }
    assert result["usage"]["prompt_tokens"] == 3


def test_chat_streaming(client: httpx.Client, fleet: SimFleet) -> None:
    kv = do_prefill(client, fleet, "hello world", chat=True)["kv_transfer_params"]
    response = do_decode(client, fleet, "hello world", kv, chat=True, max_tokens=2, stream=True)
    events = sse_events(response.content)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": " user:"},
        {"content": " hello"},
    ]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_output_comes_from_the_pulled_prefill(client: httpx.Client, fleet: SimFleet) -> None:
    kv_y = do_prefill(client, fleet, "why yes indeed")["kv_transfer_params"]
    response = do_decode(client, fleet, "x marks the spot", kv_y, max_tokens=3)
    assert response.json()["choices"][0]["text"] == " why yes indeed"


def test_blocks_pinned_until_pulled_once(client: httpx.Client, fleet: SimFleet) -> None:
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    before = prefill.stats()["blocks_pinned"]
    kv = do_prefill(client, fleet, " ".join(f"w{i}" for i in range(10)))["kv_transfer_params"]
    assert prefill.stats()["blocks_pinned"] == before + 3
    assert do_decode(client, fleet, "ignored", kv, max_tokens=1).status_code == 200
    assert prefill.stats()["blocks_pinned"] == before
    assert prefill.stats()["transfers"] == 1

    again = do_decode(client, fleet, "ignored", kv, max_tokens=1)
    assert again.status_code == 500
    assert again.json()["error"]["message"].startswith("KV transfer failed")
    stats = decode.stats()
    assert (stats["transfers"], stats["pull_failures"], stats["failed"]) == (1, 1, 1)


def test_pull_from_a_dead_prefill_fails(client: httpx.Client, fleet: SimFleet) -> None:
    kv = do_prefill(client, fleet, "a b c")["kv_transfer_params"]
    kv["remote_port"] = 1  # nothing listens there
    response = do_decode(client, fleet, "a b c", kv, max_tokens=1)
    assert response.status_code == 500
    assert "KV transfer failed" in response.json()["error"]["message"]


def test_missing_or_invalid_handshake_is_refused(client: httpx.Client, fleet: SimFleet) -> None:
    for kv in (None, {"do_remote_prefill": True}, dict(PREFILL_KV_PARAMS)):
        response = do_decode(client, fleet, "a b", kv, max_tokens=1)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["message"] == "missing or invalid kv_transfer_params"
        assert error["type"] == "BadRequestError"
    response = client.post(fleet.prefill[0].url + "/v1/completions", json=body_for("a b", False))
    assert response.status_code == 400


def test_the_vllm_dialect_has_no_bootstrap(client: httpx.Client, fleet: SimFleet) -> None:
    url = fleet.prefill[0].url
    assert client.post(url + "/sglang/bootstrap", json={"room": 1}).status_code == 404
    body = body_for("a", False, bootstrap_host="h", bootstrap_port=1, bootstrap_room=1)
    refused = client.post(url + "/v1/completions", json=body)
    assert refused.json()["error"]["param"] == "kv_transfer_params"


def test_bad_requests(client: httpx.Client, fleet: SimFleet) -> None:
    url = fleet.prefill[0].url
    long_prompt = " ".join(["w"] * 4097)
    body = body_for(long_prompt, False, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    response = client.post(url + "/v1/completions", json=body)
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]
    response = client.post(url + "/v1/completions", content=b"{not json")
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    body = body_for("a", False, max_tokens="3", kv_transfer_params=dict(PREFILL_KV_PARAMS))
    assert client.post(url + "/v1/completions", json=body).status_code == 400
    response = client.post(url + "/sim/config", json={"warp_speed": 9})
    assert response.status_code == 400
    assert client.post(url + "/sim/config", json={"ttft": "fast"}).status_code == 400
    response = client.post(url + "/v1/completions", json={**body, "model": "other"})
    assert response.status_code == 404


def test_lease_expiry_frees_blocks(client: httpx.Client, fleet: SimFleet) -> None:
    with EngineProcess("prefill", ["--kv-lease", "0.5"]) as prefill:
        body = body_for(
            "soon gone", False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_PARAMS)
        )
        kv = client.post(prefill.url + "/v1/completions", json=body).json()["kv_transfer_params"]
        assert prefill.stats()["blocks_pinned"] == 1
        # Nothing else happens on the engine: reading stats alone must expire the lease.
        wait_for(lambda: prefill.stats()["blocks_expired"] == 1)
        stats = prefill.stats()
        assert (stats["blocks_pinned"], stats["blocks_expired"]) == (0, 1)
        response = do_decode(client, fleet, "soon gone", kv, max_tokens=1)
        assert response.status_code == 500


def test_cached_tokens_on_a_repeated_prompt(client: httpx.Client, fleet: SimFleet) -> None:
    prompt = "the same long prompt arrives twice from two users"  # 9 tokens: 2 full blocks
    first = do_prefill(client, fleet, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    second = do_prefill(client, fleet, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (first, second) == (0, 8)


def test_prefill_time_follows_the_uncached_tokens_and_reset_empties_the_cache(
    client: httpx.Client, fleet: SimFleet
) -> None:
    prefill = fleet.prefill[0]
    prefill.configure(prefill_per_token=0.01)
    prompt = " ".join(f"w{index}" for index in range(40))  # 10 blocks of 4

    def timed() -> tuple[float, int]:
        started = time.monotonic()
        usage = do_prefill(client, fleet, prompt)["usage"]
        return time.monotonic() - started, usage["prompt_tokens_details"]["cached_tokens"]

    cold, nothing = timed()
    warm, everything = timed()
    assert (nothing, everything) == (0, 40)
    assert cold >= 0.4 and warm < 0.2, (cold, warm)
    stats = prefill.stats()
    assert (stats["prompt_tokens"], stats["cached_tokens"]) == (80, 40)
    assert stats["prefix_cache_blocks"] == 10
    prefill.reset()
    assert prefill.stats()["prefix_cache_blocks"] == 0
    assert timed()[1] == 0


def test_client_disconnect_mid_stream_aborts(client: httpx.Client, fleet: SimFleet) -> None:
    decode = fleet.decode[0]
    decode.configure(itl=0.05)
    kv = do_prefill(client, fleet, "keep talking")["kv_transfer_params"]
    body = body_for("keep talking", False, max_tokens=200, stream=True, kv_transfer_params=kv)
    with client.stream("POST", decode.url + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_for(lambda: decode.stats()["aborted"] == 1)
    stats = decode.stats()
    assert (stats["active"], stats["completed"]) == (0, 0)


def test_client_disconnect_before_headers_aborts(client: httpx.Client, fleet: SimFleet) -> None:
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    decode.configure(accept_delay=2.0)
    kv = do_prefill(client, fleet, "never pulled")["kv_transfer_params"]
    pinned = prefill.stats()["blocks_pinned"]
    body = body_for("never pulled", False, max_tokens=1, stream=True, kv_transfer_params=kv)
    with httpx.Client(timeout=0.2) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(decode.url + "/v1/completions", json=body)
    wait_for(lambda: decode.stats()["aborted"] == 1)
    assert prefill.stats()["blocks_pinned"] == pinned  # the pull never happened


def test_client_disconnect_during_prefill_pins_nothing(fleet: SimFleet) -> None:
    prefill = fleet.prefill[0]
    prefill.configure(prefill_delay=2.0)
    pinned = prefill.stats()["blocks_pinned"]
    body = body_for("too slow", False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    with httpx.Client(timeout=0.2) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(prefill.url + "/v1/completions", json=body)
    wait_for(lambda: prefill.stats()["aborted"] == 1)
    assert prefill.stats()["blocks_pinned"] == pinned


def test_fail_after_tokens_cuts_the_stream(client: httpx.Client, fleet: SimFleet) -> None:
    decode = fleet.decode[0]
    decode.configure(fail_after_tokens=2)
    kv = do_prefill(client, fleet, "one two three")["kv_transfer_params"]
    body = body_for("one two three", False, max_tokens=5, stream=True, kv_transfer_params=kv)
    received: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        with client.stream("POST", decode.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    received.append(line)
    assert len(received) == 2
    assert "data: [DONE]" not in received
    assert decode.stats()["failed"] == 1


def test_fail_status_answers_every_request(client: httpx.Client, fleet: SimFleet) -> None:
    decode = fleet.decode[0]
    decode.configure(fail_status=503, fail_message="overloaded")
    response = do_decode(client, fleet, "a", None, max_tokens=1)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "overloaded"
    assert response.json()["error"]["type"] == "ServiceUnavailableError"


def test_requests_queue_for_slots(client: httpx.Client, fleet: SimFleet) -> None:
    decode = fleet.decode[0]
    decode.configure(accept_delay=0.5)
    handshakes = [do_prefill(client, fleet, f"p{i}")["kv_transfer_params"] for i in range(3)]
    statuses: list[int] = []

    def send(kv: dict[str, Any]) -> None:
        statuses.append(do_decode(client, fleet, "q", kv, max_tokens=1).status_code)

    threads = [threading.Thread(target=send, args=(kv,)) for kv in handshakes]
    for thread in threads:
        thread.start()
    # Two requests hold the two slots while the third waits its turn.
    wait_for(lambda: operator.itemgetter("active", "queued")(decode.stats()) == (3, 1))
    for thread in threads:
        thread.join()
    assert statuses == [200, 200, 200]


def test_standalone_decode_serves_plain_requests(client: httpx.Client) -> None:
    with EngineProcess("decode", ["--standalone", "--default-max-tokens", "3"]) as decode:
        response = client.post(decode.url + "/v1/completions", json=body_for("just me", False))
        assert response.status_code == 200, response.text
        result = response.json()
        assert result["choices"][0]["text"] == " just me just"
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_prefill_engine_computes_at_most_its_concurrency_at_once() -> None:
    args = ["--prefill-concurrency", "1", "--prefill-per-token", "0.01", "--block-size", "4"]
    with EngineProcess("prefill", args) as engine, httpx.Client(timeout=10) as client:
        done: list[float] = []

        def prefill(word: str) -> None:
            body = body_for(
                f"{word} " * 20, False, max_tokens=1, kv_transfer_params=PREFILL_KV_PARAMS
            )
            assert client.post(engine.url + "/v1/completions", json=body).status_code == 200
            done.append(time.monotonic())

        started = time.monotonic()
        threads = [threading.Thread(target=prefill, args=(word,)) for word in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # 20 uncached tokens at 10 ms: 0.2 s each, one after the other: the last ends 0.4 s
        # after the start at the earliest (at once, both would end after 0.2 s). How far apart
        # they end is not checked: a loaded machine delays when a client sees its answer.
        assert max(done) - started >= 0.4, (started, done)


def test_a_server_on_a_port_taken_first_is_not_taken_for_this_one() -> None:
    """Another test's server can take the port picked for this one before it binds: its
    200 on /health must not pass for this engine's (a CI run sent a router's prefill
    requests to a decode engine that way, and got its 400). A port asked for fails loudly;
    a picked one is given up for another."""
    with EngineProcess("decode") as other:
        asked = EngineProcess("prefill", port=other.port)
        with pytest.raises(RuntimeError, match="address already in use"):
            with asked:
                pass
        picked = EngineProcess("prefill")
        picked.port = other.port  # as if the other had won the race for it
        with picked, httpx.Client(timeout=10) as client:
            assert picked.port != other.port
            body = body_for("mine", False, max_tokens=1, kv_transfer_params=PREFILL_KV_PARAMS)
            answer = client.post(picked.url + "/v1/completions", json=body)
            assert answer.status_code == 200, answer.text

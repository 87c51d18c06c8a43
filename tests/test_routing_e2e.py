"""Where prompts are computed, end to end: a real router process (``--prefill-policy cost``,
``--max-local-prefill``) in front of simulated engines, the ``openai`` SDK as the client."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
import zmq

from pd_router.sim.fleet import EngineProcess, SimFleet, free_port
from tests.helpers import RawClient, RouterProcess, wait_for
from tests.lying_engine import STREAM, LyingEngine, chunk, error_event, events, http, then

ENGINE = ["--block-size", "4"]
# A decode engine that serves a request with no kv_transfer_params by computing it itself,
# as a vLLM kv_consumer does.
DECODE = [*ENGINE, "--standalone", "--default-max-tokens", "4"]


def urls(engines: list[EngineProcess]) -> list[str]:
    return [engine.url for engine in engines]


def client_for(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{index}" for index in range(count))


def test_a_short_prompt_is_computed_by_its_decode_engine_alone() -> None:
    with SimFleet(1, 1, prefill_args=ENGINE, decode_args=DECODE) as fleet:
        args = ["--prefill-policy", "cost", "--max-local-prefill", "100", "--log-level", "info"]
        with RouterProcess(urls(fleet.prefill), urls(fleet.decode), *args) as router:
            client = client_for(router)
            short = client.completions.create(model="sim-model", prompt="a b c", max_tokens=4)
            # The decode engine's own answer: its output comes from the prompt it computed.
            assert short.choices[0].text == " a b c a"
            assert fleet.prefill[0].stats()["requests"] == 0
            long = words("w", 400)
            first = client.completions.create(model="sim-model", prompt=long, max_tokens=4)
            assert first.choices[0].text == " w0 w1 w2 w3"
            assert fleet.prefill[0].stats()["requests"] == 1, "a long prompt is disaggregated"
            # The decode engine holds what it pulled: the next turn's new words are few (the
            # router sees prompts in chunks of ~64 tokens: what is uncached includes the
            # pulled prompt's partial last chunk).
            turn = client.completions.create(
                model="sim-model", prompt=long + " more words", max_tokens=4
            )
            assert fleet.prefill[0].stats()["requests"] == 1
            assert turn.usage is not None and turn.usage.prompt_tokens_details is not None
            assert turn.usage.prompt_tokens_details.cached_tokens == 400
            metrics = router.metrics()
            assert metrics["pd_router_prompt_placements_total{source=prediction,where=local}"] == 2
            assert metrics["pd_router_prompt_placements_total{source=prediction,where=remote}"] == 1
            router.assert_idle()
            lines = [line for line in router.log().splitlines() if "request_id=" in line]
        assert [("local_prefill=True" in line) for line in lines] == [True, False, True]
        assert "prefill_node=None" in lines[0] and "predicted_cached=0" in lines[0]
        # The tokens counted as predicted cached are those the lines say, where they say.
        predicted = [int(line.split(" predicted_cached=")[1].split()[0]) for line in lines]
        assert predicted[2] > 0
        tokens = "pd_router_predicted_cached_tokens_total{{source=prediction,where={}}}"
        assert metrics[tokens.format("local")] == predicted[0] + predicted[2]
        assert metrics[tokens.format("remote")] == predicted[1]


@pytest.mark.parametrize("policy", ["prefix", "cost"])
def test_max_local_prefill_counts_engine_tokens_under_every_policy(policy: str) -> None:
    """The sim counts a word ("a ": 2 bytes) as a token, the router's first guess 4 bytes:
    once prefill answers have taught it, a 190-token prompt is not short for a limit of 100.
    Before, under ``prefix`` (the default) nothing calibrated, and it was computed locally;
    and a completion with a stray (ignored) ``messages`` was described by it, 3,000 tokens
    computed by a decode engine whatever the limit."""
    with SimFleet(1, 1, prefill_args=ENGINE, decode_args=DECODE) as fleet:
        args = ["--prefill-policy", policy, "--max-local-prefill", "100", "--log-level", "info"]
        with RouterProcess(urls(fleet.prefill), urls(fleet.decode), *args) as router:
            client = client_for(router)
            for index in range(3):
                client.completions.create(
                    model="sim-model", prompt=f"{index} " + "a " * 1000, max_tokens=2
                )
            client.completions.create(model="sim-model", prompt="b " * 190, max_tokens=2)
            client.completions.create(
                model="sim-model", prompt="c " * 3000, max_tokens=2, extra_body={"messages": []}
            )
            assert fleet.prefill[0].stats()["requests"] == 5
            lines = [line for line in router.log().splitlines() if "request_id=" in line]
            assert all("local_prefill=False" in line for line in lines), lines


def test_without_max_local_prefill_every_prompt_goes_to_a_prefill_engine() -> None:
    with SimFleet(1, 1, prefill_args=ENGINE, decode_args=DECODE) as fleet:
        with RouterProcess(urls(fleet.prefill), urls(fleet.decode)) as router:
            client_for(router).completions.create(model="sim-model", prompt="a b", max_tokens=2)
            assert fleet.prefill[0].stats()["requests"] == 1


def test_cost_sends_each_turn_where_the_conversation_is_cached() -> None:
    """Two prefill engines: every later turn is served from the cache of the engine that
    computed the turn before (round robin would miss half of them)."""
    with SimFleet(2, 1, prefill_args=ENGINE, decode_args=ENGINE) as fleet:
        args = ["--prefill-policy", "cost"]
        with RouterProcess(urls(fleet.prefill), urls(fleet.decode), *args) as router:
            client = client_for(router)
            system = {"role": "system", "content": words("s", 60)}
            for conversation in range(6):
                messages = [system]
                computed = 0
                for turn in range(3):
                    text = words(f"c{conversation}t{turn}x", 30)
                    messages.append({"role": "user", "content": text})
                    answer = client.chat.completions.create(
                        model="sim-model", messages=messages, max_tokens=4  # type: ignore
                    )
                    usage = answer.usage
                    assert usage is not None and usage.prompt_tokens_details is not None
                    cached = usage.prompt_tokens_details.cached_tokens or 0
                    if turn:
                        assert cached >= computed - 4, (conversation, turn, cached, computed)
                    computed = usage.prompt_tokens
                    content = answer.choices[0].message.content or ""
                    messages.append({"role": "assistant", "content": content})
            router.assert_idle()


TOKEN = "routing"


def stream_of(router: RouterProcess) -> dict[str, Any]:
    answer = httpx.get(
        f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )
    node = next(node for node in answer.json()["nodes"] if node["role"] == "prefill")
    return node["kv_events"]  # type: ignore[no-any-return]


def test_the_router_follows_an_engines_kv_events_and_forgets_what_it_cleared() -> None:
    port = free_port()
    prefill_args = [*ENGINE, "--kv-events-port", str(port)]
    with SimFleet(1, 1, prefill_args=prefill_args, decode_args=ENGINE) as fleet:
        engines = [f"{fleet.prefill[0].url},kv_events={port}"], urls(fleet.decode)
        args = ["--prefill-policy", "cost", "--admin-token", TOKEN]
        with RouterProcess(*engines, *args) as router:
            client = client_for(router)
            wait_for(lambda: stream_of(router)["endpoint"] is not None, what="a subscriber")
            long = words("w", 400)
            turns = [long, long + " more", long + " more and more"]
            # ZMQ subscribers join late: send until the engine's events are seen.
            deadline = time.monotonic() + 30
            while stream_of(router)["state"] != "live" and time.monotonic() < deadline:
                client.completions.create(model="sim-model", prompt=turns[0], max_tokens=2)
                time.sleep(0.2)
            stream = stream_of(router)
            assert stream["state"] == "live" and stream["blocks"] >= 100, stream
            # The router links an answer's token ids to its text once it knows the engine's
            # block size (from its first BlockStored): the next turns are then read from
            # the events.
            client.completions.create(model="sim-model", prompt=turns[0], max_tokens=2)
            client.completions.create(model="sim-model", prompt=turns[1], max_tokens=2)
            fleet.prefill[0].reset()  # the engine's cache is emptied: AllBlocksCleared
            wait_for(lambda: stream_of(router)["clears"] == 1, what="the clear seen")
            client.completions.create(model="sim-model", prompt=turns[2], max_tokens=2)
            metrics = router.metrics()
            assert (
                metrics[
                    "pd_router_kv_event_stream{node=0,state=live,url=%s}" % (fleet.prefill[0].url)
                ]
                == 1
            )
            lines = [line for line in router.log().splitlines() if "request_id=" in line]
        second, third = lines[-2], lines[-1]
        assert "cache_source=events" in second and "predicted_cached=0 " not in second
        # The router forgot what the engine said it no longer holds.
        assert "cache_source=events" in third and "predicted_cached=0 " in third


def test_garbage_on_an_event_stream_degrades_it_and_requests_go_on() -> None:
    context: zmq.Context[Any] = zmq.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    try:
        with SimFleet(1, 1, prefill_args=ENGINE, decode_args=ENGINE) as fleet:
            engines = [f"{fleet.prefill[0].url},kv_events={port}"], urls(fleet.decode)
            args = ["--prefill-policy", "cost", "--admin-token", TOKEN]
            with RouterProcess(*engines, *args) as router:

                def degraded() -> bool:
                    publisher.send_multipart([b"kv-events", b"\x00" * 8, b"\xc1 not msgpack"])
                    return bool(stream_of(router)["state"] == "degraded")

                wait_for(degraded, timeout=30, what="the stream degraded")
                answer = client_for(router).completions.create(
                    model="sim-model", prompt="still served", max_tokens=2
                )
                assert answer.choices[0].text
                url = fleet.prefill[0].url
                faults = router.metrics()[
                    f"pd_router_kv_event_faults_total{{kind=garbage,node=0,url={url}}}"
                ]
                assert faults >= 1
                assert stream_of(router)["last_fault"]
    finally:
        publisher.close(linger=0)
        context.term()


def test_a_request_of_several_sequences_is_computed_by_its_decode_engine() -> None:
    """``n`` samples (or a batch of prompts: ``hands_over``): vLLM's prefill answers one
    set of ``kv_transfer_params`` for all of them, so handed over, the others would be
    decoded from the wrong blocks and theirs left pinned. The decode engine computes the
    request whole instead, without ``--max-local-prefill`` too; and so it does beam search
    and required tool calls, which a one-token prefill cannot hand over either."""
    with SimFleet(1, 1, prefill_args=ENGINE, decode_args=DECODE) as fleet:
        with RouterProcess(
            urls(fleet.prefill), urls(fleet.decode), "--log-level", "info"
        ) as router:
            client = client_for(router)
            samples = client.completions.create(
                model="sim-model", prompt="a b c", max_tokens=2, n=2
            )
            chat = client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=3
            )
            # The decode engine's own answers: computed from the prompt it was sent.
            assert samples.choices[0].text == " a b"
            assert chat.choices[0].message.content == " user: hi"
            assert fleet.prefill[0].stats()["requests"] == 0
            beam = {"use_beam_search": True}
            client.completions.create(model="sim-model", prompt="a", max_tokens=2, extra_body=beam)
            client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                tool_choice="required",
            )
            assert fleet.prefill[0].stats()["requests"] == 0
            # One sequence, a prompt of token ids in a batch of one, is disaggregated.
            client.completions.create(model="sim-model", prompt=[[5, 6, 7]], max_tokens=2, n=1)
            assert fleet.prefill[0].stats()["requests"] == 1
            router.assert_idle()
            lines = [line for line in router.log().splitlines() if "request_id=" in line]
        assert [("local_prefill=True" in line) for line in lines] == [True] * 4 + [False]


def test_a_request_the_decode_engine_refuses_leaves_no_kv_pinned_on_the_prefill_engine() -> None:
    """``max_tokens`` over the decode engine's context: the prefill (one token) passed, the
    decode engine answers 400. The client gets that 400, and the blocks the prefill pinned
    for the hand-off are pulled (a drain) rather than held until the engine's lease ends:
    any client could have filled a prefill engine's cache that way."""
    decode = [*DECODE, "--max-model-len", "64"]
    with SimFleet(1, 1, prefill_args=ENGINE, decode_args=decode) as fleet:
        with RouterProcess(urls(fleet.prefill), urls(fleet.decode)) as router:
            client = client_for(router)
            for stream in (False, True):
                try:
                    client.completions.create(
                        model="sim-model", prompt="a b c d e f", max_tokens=100, stream=stream
                    )
                except openai.BadRequestError as refused:
                    assert "max_model_len" in refused.message
                else:
                    raise AssertionError("the decode engine's 400 was not passed on")
            router.assert_idle()
            stats = fleet.prefill[0].stats()
            assert (stats["requests"], stats["transfers"], stats["blocks_pinned"]) == (2, 2, 0)


def test_a_client_that_leaves_while_the_refused_kv_is_drained_leaves_none_pinned() -> None:
    """The drain is the engines' business, like a hand-off: shielded from the client's
    leaving within ``--handoff-grace``. Before, a client gone mid-drain cancelled it, and
    the blocks stayed pinned for the prefill engine's lease."""
    decode = [*DECODE, "--max-model-len", "64"]
    with SimFleet(1, 1, prefill_args=ENGINE, decode_args=decode) as fleet:
        fleet.decode[0].configure(accept_delay=1.0)  # the drain's pull waits this long
        with RouterProcess(urls(fleet.prefill), urls(fleet.decode)) as router:
            body = {"model": "sim-model", "prompt": "a b c d e f", "max_tokens": 100}
            client = RawClient(router.url, "/v1/completions", body)
            wait_for(lambda: fleet.prefill[0].stats()["blocks_pinned"] > 0, what="the prefill")
            wait_for(
                lambda: fleet.decode[0].stats()["requests"] == 2,
                what="the decode engine's refusal, and its drain under way",
            )
            client.hang_up()
            router.assert_idle()
            wait_for(lambda: fleet.prefill[0].stats()["blocks_pinned"] == 0, what="the KV pulled")
            assert fleet.prefill[0].stats()["transfers"] == 1


def test_a_decode_engine_that_failed_a_request_is_not_predicted_to_hold_its_prompt() -> None:
    """Only a decode engine that answered 200 holds what it was sent: one that failed the
    request is not credited with the prompt, so the next turn is not computed there as if
    its history were cached."""
    with SimFleet(1, 1, prefill_args=ENGINE, decode_args=DECODE) as fleet:
        args = ["--prefill-policy", "cost", "--max-local-prefill", "100"]
        with RouterProcess(urls(fleet.prefill), urls(fleet.decode), *args) as router:
            client = client_for(router)
            long = words("w", 400)
            fleet.decode[0].configure(fail_status=500)
            try:
                client.completions.create(model="sim-model", prompt=long, max_tokens=2)
            except openai.InternalServerError:
                pass
            else:
                raise AssertionError("the failing decode engine's 500 was not passed on")
            fleet.decode[0].configure(fail_status=None)
            before = fleet.prefill[0].stats()["requests"]
            client.completions.create(model="sim-model", prompt=long + " more", max_tokens=2)
            assert fleet.prefill[0].stats()["requests"] == before + 1, "computed locally"
            router.assert_idle()


def test_a_decode_engine_whose_stream_begins_with_an_error_is_not_credited() -> None:
    """vLLM reports a failure after its 200 (a KV load that failed) as an error event first:
    the engine holds nothing of the prompt, and the next turn is not computed there as if
    its history were cached."""
    long = words("w", 400)
    with SimFleet(1, 0, prefill_args=ENGINE) as fleet, LyingEngine() as liar:
        liar.lies[f"x {long}"] = then(0, chunk(events(error_event(500), b"[DONE]")) + b"0\r\n\r\n")
        liar.lies[f"x {long} more"] = http(200, STREAM, "content-type: text/event-stream")
        args = ["--prefill-policy", "cost", "--max-local-prefill", "100"]
        with RouterProcess(urls(fleet.prefill), [liar.url], *args) as router:
            url = f"{router.url}/v1/completions"
            body = {"model": "sim-model", "max_tokens": 2, "stream": True}
            failed = httpx.post(url, json={**body, "prompt": f"lie:x {long}"}, timeout=30)
            assert failed.status_code == 500, failed.text
            before = fleet.prefill[0].stats()["requests"]
            answer = httpx.post(url, json={**body, "prompt": f"lie:x {long} more"}, timeout=30)
            assert answer.status_code == 200
            assert fleet.prefill[0].stats()["requests"] == before + 1, "computed locally"
            router.assert_idle()

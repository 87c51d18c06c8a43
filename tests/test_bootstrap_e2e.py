"""SGLang's dialect end to end: a real router process (``--dialect sglang``) in front of
simulated engines speaking it (``python -m pd_router.sim ... --dialect sglang``: the
prefill holds the KV under its room until a decode engine takes it, and answers then), the
``openai`` SDK as the client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from pd_router.sim.fleet import EngineProcess, SimFleet, free_port
from tests.helpers import RouterProcess, wait_for
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

SGLANG = ["--dialect", "sglang"]


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    # A decode engine whose room never comes gives up after the prefill's default 30 s.
    with SimFleet(1, 2, prefill_args=SGLANG, decode_args=SGLANG) as sims:
        yield sims


def router_for(fleet: SimFleet, *args: str, env: dict[str, str] | None = None) -> RouterProcess:
    # The sim serves its bootstrap on its HTTP port: each node says so.
    prefill = [f"{engine.url},bootstrap_port={engine.port}" for engine in fleet.prefill]
    decode = [engine.url for engine in fleet.decode]
    return RouterProcess(prefill, decode, *SGLANG, "--decode-slots", "4", *args, env=env)


def client_for(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def test_completions_and_chat_are_served_by_both_engines_at_once(fleet: SimFleet) -> None:
    fleet.reset()
    with router_for(fleet) as router:
        client = client_for(router)
        answer = client.completions.create(model="sim-model", prompt="a b c d", max_tokens=3)
        # The decode engine generates from the tokens it took from the prefill's room.
        assert answer.choices[0].text == " a b c"
        stream = client.completions.create(
            model="sim-model", prompt="e f g", max_tokens=4, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == " e f g e"
        chat = client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=2,
            stream=True,
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices)
        prefill = fleet.prefill[0].stats()
        taken = sum(engine.stats()["transfers"] for engine in fleet.decode)
        assert prefill["rooms_taken"] == taken == 3, prefill
        # Each prefill answered once its room was taken, and the router read it whole.
        wait_for(lambda: fleet.prefill[0].stats()["completed"] == 3, what="prefill answers")
        router.assert_idle()
        metrics = router.metrics()
        assert metrics["pd_router_requests_total{endpoint=completions,outcome=ok}"] == 2
        assert metrics["pd_router_requests_total{endpoint=chat,outcome=ok}"] == 1


def test_a_request_for_more_sequences_than_rooms_are_given_is_refused_and_nothing_else(
    fleet: SimFleet,
) -> None:
    """A chat's ``n`` of 10^8 (one short line: before, the router built three lists of
    10^8 for each engine, and ran out of memory) and a batch of 1,025 prompts: a 400 with
    OpenAI's error body, at once; no engine heard of them, and the next request is
    served."""
    fleet.reset()
    with router_for(fleet) as router:
        client = client_for(router)
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=2,
                n=10**8,
            )
        assert time.monotonic() - started < 10
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "n", error
        assert "at most 1024 sequences" in error["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="sim-model", prompt=["a b"] * 1025, max_tokens=1)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "prompt"
        assert [engine.stats()["requests"] for engine in fleet.engines] == [0, 0, 0]
        answer = client.completions.create(model="sim-model", prompt="a b", max_tokens=2)
        assert answer.choices[0].text == " a b"
        router.assert_idle()
        metrics = router.metrics()
        assert metrics["pd_router_requests_total{endpoint=chat,outcome=bad_request}"] == 1
        assert metrics["pd_router_requests_total{endpoint=completions,outcome=bad_request}"] == 1


def test_a_failing_prefill_fails_its_request_at_once_not_at_the_decode_timeout(
    fleet: SimFleet,
) -> None:
    """The decode engine would wait 30 s for a room that never comes; the router ends the
    request as soon as the prefill engine answers its error, and closes the decode's."""
    fleet.reset()
    (prefill,) = fleet.prefill
    with router_for(fleet, "--unhealthy-after", "100") as router:
        client = client_for(router)
        prefill.configure(fail_status=503)
        try:
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as failed:
                client.completions.create(model="sim-model", prompt="x y", max_tokens=2)
            took = time.monotonic() - started
        finally:
            prefill.configure(fail_status=None)
        assert failed.value.status_code == 503
        assert f"- prefill engine {prefill.url}/v1/completions: " in failed.value.message
        assert took < 15, f"the request waited {took:.1f} s"
        # The decode engine's request was closed: it takes no room, and frees its slot.
        wait_for(lambda: all(e.stats()["active"] == 0 for e in fleet.decode), what="decode")
        assert all(e.stats()["transfers"] == 0 for e in fleet.decode)
        router.assert_idle()
        # And the next request is served.
        answer = client.completions.create(model="sim-model", prompt="x y", max_tokens=2)
        assert answer.choices[0].text == " x y"
        metrics = router.metrics()
        assert metrics["pd_router_requests_total{endpoint=completions,outcome=prefill_error}"] == 1


def test_concurrent_requests_each_get_their_own_room(fleet: SimFleet) -> None:
    fleet.reset()
    with router_for(fleet, "--queue-timeout", "30") as router:
        client = client_for(router)

        def ask(index: int) -> str:
            answer = client.completions.create(
                model="sim-model", prompt=f"q{index} w{index}", max_tokens=2
            )
            return answer.choices[0].text

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(ask, range(24)))
        assert texts == [f" q{index} w{index}" for index in range(24)]
        assert fleet.prefill[0].stats()["rooms_taken"] == 24
        router.assert_idle()


def test_traced_the_prefill_runs_beside_the_decode_and_carries_its_own_failure(
    fleet: SimFleet,
) -> None:
    """Its span runs beside the decode's (both requests go at once), and a prefill's
    failure is marked on it, not on the decode's (before: the decode's spans got the
    prefill's 503, blaming the node that answered nothing wrong)."""
    fleet.reset()
    (prefill,) = fleet.prefill
    quick = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    with OtlpReceiver() as receiver:
        args = ["--otlp-traces-endpoint", receiver.url, "--unhealthy-after", "100"]
        with router_for(fleet, *args, env=quick) as router:
            client = client_for(router)
            client.completions.create(
                model="sim-model",
                prompt="a b",
                max_tokens=2,
                extra_headers={"x-request-id": "ok-1"},
            )
            spans = {span.name: span for span in receiver.request_trace("ok-1", 5)}
            assert sorted(spans) == [
                "POST /v1/completions",
                "decode",
                "kv_handoff",
                "prefill",
                "queue",
            ]
            root, beside, decode = spans["POST /v1/completions"], spans["prefill"], spans["decode"]
            assert beside.parent_span_id == decode.parent_span_id == root.span_id
            assert beside.start_ns <= decode.start_ns <= beside.end_ns <= root.end_ns
            assert not any(span.error for span in spans.values())

            def failed_on(
                engines: list[EngineProcess], request_id: str, count: int
            ) -> dict[str, ReceivedSpan]:
                """The spans of a request while ``engines`` answer 503."""
                for engine in engines:
                    engine.configure(fail_status=503)
                try:
                    with pytest.raises(openai.APIStatusError):
                        client.completions.create(
                            model="sim-model",
                            prompt=request_id,
                            max_tokens=2,
                            extra_headers={"x-request-id": request_id},
                        )
                finally:
                    for engine in engines:
                        engine.configure(fail_status=None)
                return {span.name: span for span in receiver.request_trace(request_id, count)}

            spans = failed_on([prefill], "failed-1", 5)
            assert spans["prefill"].error
            assert spans["prefill"].attributes["http.response.status_code"] == 503
            assert "http.response.status_code" not in spans["decode"].attributes
            assert spans["POST /v1/completions"].error
            # And the other way round: the decode engine's failure is the decode span's,
            # never the prefill's beside it, which was let go.
            spans = failed_on(fleet.decode, "decode-failed-1", 4)
            assert spans["decode"].error
            assert spans["decode"].attributes["http.response.status_code"] == 503
            assert not spans["prefill"].error, spans["prefill"].status_message
            assert "http.response.status_code" not in spans["prefill"].attributes


def test_a_failing_prefill_engine_is_tried_once_more_on_another() -> None:
    """The decode engine's first request, waiting for a room that will never be computed,
    is closed; it gets the request again with the other prefill engine's room."""
    with SimFleet(2, 1, prefill_args=SGLANG, decode_args=SGLANG) as fleet:
        broken, working = fleet.prefill
        broken.configure(fail_status=503)
        args = ["--unhealthy-after", "100", "--prefill-policy", "round_robin"]
        with router_for(fleet, *args) as router:
            client = client_for(router)
            texts = [
                client.completions.create(model="sim-model", prompt=f"p{i} q", max_tokens=2)
                .choices[0]
                .text
                for i in range(4)
            ]
            assert texts == [f" p{i} q" for i in range(4)]
            assert working.stats()["rooms_taken"] == 4
            assert broken.stats()["rooms_taken"] == 0
            (decode,) = fleet.decode
            wait_for(lambda: decode.stats()["active"] == 0, what="the decode engine idle")
            router.assert_idle()
            assert "retrying on node" in router.log()


def test_a_prefill_engine_whose_bootstrap_port_takes_no_connection_is_taken_out(
    fleet: SimFleet,
) -> None:
    """Its /health answers, but every decode engine would fail to take its rooms (and be
    blamed): the prober connects to the bootstrap port too, and the node goes dead with
    the reason at the first refusal, while one whose port answers serves."""
    fleet.reset()
    (prefill,) = fleet.prefill
    nowhere = free_port()
    decode = [engine.url for engine in fleet.decode]
    # One refusal is enough (the decode engines would take the blame for every request in
    # the meantime), not --unhealthy-after in a row: ten would take 45 s at least.
    probes = ["--health-interval", "5", "--unhealthy-after", "10"]
    args = [*SGLANG, "--admin-token", "t", *probes]
    wrong = f"{prefill.url},bootstrap_port={nowhere}"
    # Not `with`: it waits for the router's /health, which says no prefill node serves once
    # the first probe round took the only one out (at once, with no request yet).
    router = RouterProcess([wrong], decode, *args).start()

    def prefill_node() -> dict[str, Any]:
        answer = httpx.get(
            f"{router.url}/admin/nodes", headers={"Authorization": "Bearer t"}, timeout=10
        )
        return next(n for n in answer.json()["nodes"] if n["role"] == "prefill")

    def dead() -> bool:
        try:
            return bool(prefill_node()["state"] == "dead")
        except httpx.TransportError:
            return False  # not listening yet

    try:
        wait_for(dead, timeout=30, what="the prefill node dead")
        node = prefill_node()
        assert node["reason"] == "bootstrap refused"
        assert f"bootstrap server 127.0.0.1:{nowhere}" in node["last_error"]
        # No request reaches the decode engines to fail there.
        with pytest.raises(openai.APIStatusError) as refused:
            client_for(router).completions.create(model="sim-model", prompt="a", max_tokens=1)
        assert refused.value.status_code == 503
        assert all(engine.stats()["requests"] == 0 for engine in fleet.decode)
    finally:
        router.stop()
    right = f"{prefill.url},bootstrap_port={prefill.port}"
    with RouterProcess([right], decode, *args) as router:
        answer = client_for(router).completions.create(model="sim-model", prompt="a", max_tokens=1)
        assert answer.choices[0].text == " a"
        # The port in use is shown, a label's or --bootstrap-port's.
        assert prefill_node()["bootstrap_port"] == prefill.port


def test_the_dialect_is_said_at_start_and_sglang_ports_given_to_vllms_are_warned_of(
    fleet: SimFleet,
) -> None:
    """A fleet of SGLang engines behind a router speaking vLLM's dialect fails every
    request with the prefill engine's 400 (bootstrap_host is missing), counted as the
    clients' bad requests: the start says what the router speaks, and warns."""
    with router_for(fleet) as router:
        assert "engines' dialect: sglang, bootstrap port 8998 unless a node says" in router.log()
    (prefill,) = fleet.prefill
    decode = [engine.url for engine in fleet.decode]
    with RouterProcess([f"{prefill.url},bootstrap_port={prefill.port}"], decode) as router:
        wait_for(lambda: "SGLang's: this router speaks vLLM's dialect" in router.log(), what="it")
        assert f"bootstrap_port labels ({prefill.url})" in router.log()


def test_a_prefill_slower_than_the_read_timeout_is_one_504_naming_both_engines(
    fleet: SimFleet,
) -> None:
    """Both engines silent, no KV handed over: whose fault is not known (the decode engine
    waits for the prefill's KV, the prefill engine for a decode engine to take its room),
    so nothing counts against either node. Before, the 504 named the decode engine."""
    fleet.reset()
    (prefill,) = fleet.prefill
    # Long enough that the healthy request after it never waits that long on a slow machine.
    with router_for(fleet, "--read-timeout", "5", "--admin-token", "t") as router:
        prefill.configure(prefill_delay=30)
        try:
            with pytest.raises(openai.APIStatusError) as silent:
                client_for(router).completions.create(model="sim-model", prompt="a", max_tokens=1)
        finally:
            prefill.configure(prefill_delay=0)
        assert silent.value.status_code == 504
        assert f"no KV went from prefill engine {prefill.url} to decode engine" in str(
            silent.value.message
        )
        nodes = httpx.get(
            f"{router.url}/admin/nodes", headers={"Authorization": "Bearer t"}, timeout=10
        ).json()["nodes"]
        assert all(n["consecutive_failures"] == 0 and n["state"] == "serving" for n in nodes)
        router.assert_idle()
        answer = client_for(router).completions.create(model="sim-model", prompt="b", max_tokens=1)
        assert answer.choices[0].text == " b"

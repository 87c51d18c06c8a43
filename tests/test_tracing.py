"""OpenTelemetry tracing end to end: the router's CLI in front of simulated engines (which
record the trace context each request brought), the ``openai`` SDK as the client, and a
real OTLP/HTTP receiver decoding the protobuf the router exports."""

from __future__ import annotations

import os
import subprocess  # nosec B404
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pd_router.ops.tracing import INSTALL
from pd_router.sim.fleet import EngineProcess, SimFleet
from tests.helpers import RawClient, RouterProcess, streamed_text, wait_for
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

# Spans reach the receiver within a tenth of a second instead of the SDK's default 5 s.
QUICK = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
TRACESTATE = "vendor=abc123,other=x"
SERVER, CLIENT = 2, 3  # OTLP's SpanKind values
QUIET = {"fail_status": None, "prefill_delay": 0}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=2, decode=1, decode_args=["--itl", "0.005"]) as fleet:
        yield fleet


@pytest.fixture
def sims(fleet: SimFleet) -> Iterator[SimFleet]:
    for engine in fleet.engines:
        engine.configure(**QUIET)
        engine.reset()
    yield fleet


@pytest.fixture(scope="module")
def router(fleet: SimFleet, receiver: OtlpReceiver) -> Iterator[RouterProcess]:
    prefill, decode = [e.url for e in fleet.prefill], [e.url for e in fleet.decode]
    args = ["--otlp-traces-endpoint", receiver.url, "--prefill-policy", "round_robin"]
    with RouterProcess(prefill, decode, *args, env=QUICK) as router:
        yield router


def client_for(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    named: dict[str, list[ReceivedSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        named.setdefault(span.name, []).append(span)
    return named


def received(engine: EngineProcess, request_id: str) -> dict[str, str | None]:
    """The trace context ``engine`` got with the request ``request_id``."""
    contexts = [c for c in engine.stats()["trace_contexts"] if c["request_id"] == request_id]
    assert len(contexts) == 1, contexts
    return contexts[0]


def continued(engine: EngineProcess, request_id: str) -> tuple[str, str]:
    """The trace and parent span ids of the ``traceparent`` ``engine`` got, which was
    sampled (the random-id flag, 02, may be set too)."""
    version, trace_id, span_id, flags = str(received(engine, request_id)["traceparent"]).split("-")
    assert version == "00" and int(flags, 16) & 1
    return trace_id, span_id


def logged_trace_id(router: RouterProcess, request_id: str) -> str:
    lines = [line for line in router.log().splitlines() if f"request_id={request_id} " in line]
    assert len(lines) == 1, lines
    return lines[0].split(" trace_id=")[1].split()[0]


def test_a_streamed_request_is_one_trace_continuing_the_clients(
    router: RouterProcess, sims: SimFleet, receiver: OtlpReceiver
) -> None:
    stream = client_for(router).chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "trace me all the way"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={
            "traceparent": TRACEPARENT,
            "tracestate": TRACESTATE,
            "x-request-id": "streamed-1",
        },
    )
    text = streamed_text(stream)
    assert text
    spans = by_name(receiver.request_trace("streamed-1", 5))
    assert sorted(spans) == [
        "POST /v1/chat/completions",
        "decode",
        "kv_handoff",
        "prefill",
        "queue",
    ]
    [root] = spans["POST /v1/chat/completions"]
    [queue], [prefill], [decode], [handoff] = (
        spans[name] for name in ("queue", "prefill", "decode", "kv_handoff")
    )
    # The client's trace, continued: same trace id, the root's parent is the client's span.
    assert {s.trace_id for spans_ in spans.values() for s in spans_} == {CLIENT_TRACE}
    assert root.parent_span_id == CLIENT_SPAN and root.kind == SERVER
    assert {s.trace_state for spans_ in spans.values() for s in spans_} == {TRACESTATE}
    assert (queue.parent_span_id, prefill.parent_span_id, decode.parent_span_id) == (
        root.span_id,
        root.span_id,
        root.span_id,
    )
    assert handoff.parent_span_id == decode.span_id
    assert prefill.kind == decode.kind == CLIENT
    # In order, each inside the request's span.
    assert root.start_ns <= queue.start_ns <= queue.end_ns <= prefill.start_ns
    assert prefill.end_ns <= decode.start_ns <= handoff.start_ns <= handoff.end_ns
    assert handoff.end_ns <= decode.end_ns <= root.end_ns
    assert not any(s.error for spans_ in spans.values() for s in spans_)

    assert root.attributes == {
        "http.request.method": "POST",
        "http.route": "/v1/chat/completions",
        "http.response.status_code": 200,
        "pd_router.request_id": "streamed-1",
        "pd_router.outcome": "ok",
        "gen_ai.request.model": "sim-model",
        "pd_router.stream": True,
    }
    [engine] = [e for e in sims.prefill if e.stats()["requests"] == 1]
    assert prefill.attributes["url.full"] == engine.url + "/v1/chat/completions"
    assert prefill.attributes["pd_router.attempt"] == 1
    assert prefill.attributes["pd_router.cached_tokens"] == 0
    assert prefill.attributes["http.response.status_code"] == 200
    [decoder] = sims.decode
    assert decode.attributes["url.full"] == decoder.url + "/v1/chat/completions"
    assert decode.attributes["pd_router.outcome"] == "ok"
    assert decode.attributes["gen_ai.usage.output_tokens"] == 6
    assert decode.attributes["pd_router.events"] >= 6
    assert 0 < decode.attributes["pd_router.time_to_first_token_s"] < 30
    assert queue.attributes["pd_router.decode_node"] == decode.attributes["pd_router.node"]

    # Each engine got its own phase span as the parent to continue, and the client's state.
    assert received(engine, "streamed-1") == {
        "request_id": "streamed-1",
        "traceparent": f"00-{CLIENT_TRACE}-{prefill.span_id}-01",
        "tracestate": TRACESTATE,
    }
    assert continued(decoder, "streamed-1") == (CLIENT_TRACE, decode.span_id)
    assert received(decoder, "streamed-1")["tracestate"] == TRACESTATE
    assert logged_trace_id(router, "streamed-1") == CLIENT_TRACE


def test_a_failed_request_is_an_error_span_with_its_kind(
    router: RouterProcess, sims: SimFleet, receiver: OtlpReceiver
) -> None:
    [decoder] = sims.decode
    decoder.configure(fail_status=503, fail_message="engine overloaded")
    with pytest.raises(openai.APIStatusError) as failure:
        client_for(router).completions.create(
            model="sim-model",
            prompt="this one fails",
            max_tokens=4,
            extra_headers={"x-request-id": "failed-1"},
        )
    assert failure.value.status_code == 503
    spans = by_name(receiver.request_trace("failed-1", 5))
    [root] = spans["POST /v1/completions"]
    [prefill], [decode], [handoff] = (spans[n] for n in ("prefill", "decode", "kv_handoff"))
    # No traceparent from the client: a trace of the router's own.
    assert root.parent_span_id == "" and root.trace_id != CLIENT_TRACE
    assert root.error and root.status_message == "http_5xx"
    assert root.attributes["error.type"] == "http_5xx"
    assert root.attributes["pd_router.outcome"] == "decode_error"
    assert root.attributes["http.response.status_code"] == 503
    assert decode.error and decode.status_message == "http_5xx"
    assert decode.attributes["http.response.status_code"] == 503
    assert decode.attributes["error.type"] == "http_5xx"
    assert handoff.error and not prefill.error
    assert continued(decoder, "failed-1") == (root.trace_id, decode.span_id)
    assert logged_trace_id(router, "failed-1") == root.trace_id


def test_a_prefill_retry_is_a_second_prefill_span(
    router: RouterProcess, sims: SimFleet, receiver: OtlpReceiver
) -> None:
    failing, healthy = sims.prefill
    failing.configure(fail_status=500)
    client = client_for(router)
    # Round robin: one of two requests goes to the failing engine first.
    for index in range(2):
        client.completions.create(
            model="sim-model",
            prompt="retry me",
            max_tokens=2,
            extra_headers={"x-request-id": f"retry-{index}"},
        )
    traces = [by_name(receiver.request_trace(f"retry-{i}", 5)) for i in range(2)]
    retried = next(spans for spans in traces if len(spans["prefill"]) == 2)
    first, second = retried["prefill"]
    assert first.error and first.attributes["error.type"] == "http_5xx"
    assert first.attributes["http.response.status_code"] == 500
    assert first.attributes["url.full"] == failing.url + "/v1/completions"
    assert (first.attributes["pd_router.attempt"], second.attributes["pd_router.attempt"]) == (1, 2)
    assert not second.error and second.attributes["url.full"] == healthy.url + "/v1/completions"
    assert first.end_ns <= second.start_ns
    [root] = retried["POST /v1/completions"]
    assert not root.error and root.attributes["pd_router.outcome"] == "ok"
    # Each attempt's engine was told its own span.
    request_id = root.attributes["pd_router.request_id"]
    assert continued(failing, request_id) == (root.trace_id, first.span_id)
    assert continued(healthy, request_id) == (root.trace_id, second.span_id)


def test_refused_requests_are_error_spans_with_their_code(
    router: RouterProcess, sims: SimFleet, receiver: OtlpReceiver
) -> None:
    body = {"model": "sim-model", "prompt": "hold the slot", "max_tokens": 400, "stream": True}
    # The router has one decode slot (--decode-slots 1) and no queue: a stream holds it.
    holder = RawClient(router.url, "/v1/completions", body)
    holder.read_until(b'"text"')
    client = client_for(router)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(
            model="sim-model", prompt="busy", max_tokens=2, extra_headers={"x-request-id": "busy-1"}
        )
    holder.hang_up()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model="sim-model",
            prompt="x",
            max_tokens=2,
            extra_body={"n": "many"},
            extra_headers={"x-request-id": "bad-1"},
        )
    busy = by_name(receiver.request_trace("busy-1", 2))
    assert sorted(busy) == ["POST /v1/completions", "queue"]
    [root], [queue] = busy["POST /v1/completions"], busy["queue"]
    assert root.error and root.status_message == "decode_nodes_busy"
    assert root.attributes["error.type"] == "decode_nodes_busy"
    assert root.attributes["http.response.status_code"] == 429
    assert queue.error and queue.status_message == "decode_nodes_busy"
    assert queue.parent_span_id == root.span_id
    [bad] = receiver.request_trace("bad-1", 1)
    assert bad.error and bad.attributes["error.type"] == "invalid_request_error"
    assert bad.attributes["http.response.status_code"] == 400
    assert bad.attributes["pd_router.outcome"] == "bad_request"
    router.assert_idle()


def test_a_trace_the_client_does_not_sample_is_not_recorded_but_passed_on(
    router: RouterProcess, sims: SimFleet, receiver: OtlpReceiver
) -> None:
    trace_id = "a3ce929d0e0e47364bf92f3577b34da6"
    for index in range(2):
        client_for(router).completions.create(
            model="sim-model",
            prompt="not sampled",
            max_tokens=2,
            # Flags 00: the client's sampler left this trace out; so does the router's
            # default (parent-based) one.
            extra_headers={
                "traceparent": f"00-{trace_id}-{CLIENT_SPAN}-00",
                "x-request-id": f"unsampled-{index}",
            },
        )
    # A sampled request after them: once its spans are in, the earlier ones would be.
    client_for(router).completions.create(
        model="sim-model", prompt="sampled", max_tokens=2, extra_headers={"x-request-id": "after"}
    )
    receiver.request_trace("after", 5)
    assert receiver.trace(trace_id) == []
    for index in range(2):
        contexts = [
            context
            for engine in sims.engines
            for context in engine.stats()["trace_contexts"]
            if context["request_id"] == f"unsampled-{index}"
        ]
        assert len(contexts) == 2  # the prefill's and the decode's
        for context in contexts:
            _, got_trace, _, flags = str(context["traceparent"]).split("-")
            assert (got_trace, int(flags, 16) & 1) == (trace_id, 0)
    assert logged_trace_id(router, "unsampled-0") == trace_id


def test_a_client_that_leaves_mid_stream_ends_its_spans(
    router: RouterProcess, sims: SimFleet, receiver: OtlpReceiver
) -> None:
    body = {"model": "sim-model", "prompt": "leave early", "max_tokens": 400, "stream": True}
    leaver = RawClient(router.url, "/v1/completions", body, ["X-Request-Id: leaver-1"])
    leaver.read_until(b'"text"', count=2)
    leaver.hang_up()
    spans = by_name(receiver.request_trace("leaver-1", 5))
    [root], [decode] = spans["POST /v1/completions"], spans["decode"]
    assert root.error and root.status_message == "client_aborted"
    assert root.attributes["pd_router.outcome"] == "client_aborted"
    assert decode.error and decode.attributes["pd_router.outcome"] == "client_aborted"
    assert decode.end_ns <= root.end_ns
    router.assert_idle()


def test_a_client_gone_during_prefill_has_its_drain_marked_on_the_decode_span(
    router: RouterProcess, sims: SimFleet, receiver: OtlpReceiver
) -> None:
    """The client hangs up while its prefill runs: the router still hands the KV to the
    decode engine, in a one-token request only to free it, and that decode span says so
    (``pd_router.drain``); a served request's decode span does not."""
    client_for(router).with_options(default_headers={"X-Request-Id": "kept-1"}).completions.create(
        model="sim-model", prompt="stay", max_tokens=2
    )
    for engine in sims.prefill:
        engine.configure(prefill_delay=1)
    body = {"model": "sim-model", "prompt": "leave during prefill", "max_tokens": 40}
    leaver = RawClient(router.url, "/v1/completions", body, ["X-Request-Id: drained-1"])
    wait_for(lambda: sum(e.stats()["active"] for e in sims.prefill) == 1, what="the prefill")
    leaver.hang_up()
    spans = by_name(receiver.request_trace("drained-1", 4))
    [root], [decode] = spans["POST /v1/completions"], spans["decode"]
    assert root.attributes["pd_router.outcome"] == "client_aborted"
    assert decode.attributes.get("pd_router.drain") is True, decode.attributes
    [kept] = by_name(receiver.request_trace("kept-1", 4))["decode"]
    assert "pd_router.drain" not in kept.attributes
    wait_for(lambda: router.in_use() == 0, what="the drain's slot")
    router.assert_idle()


def test_the_otel_environment_turns_tracing_on_and_nothing_else_does(
    sims: SimFleet, receiver: OtlpReceiver
) -> None:
    prefill, decode = [e.url for e in sims.prefill], [e.url for e in sims.decode]
    # A trace of its own: the receiver keeps the other tests' spans.
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    with RouterProcess(prefill, decode) as plain:
        client_for(plain).completions.create(
            model="sim-model",
            prompt="not traced",
            max_tokens=2,
            extra_headers={**headers, "x-request-id": "untraced-1"},
        )
        assert "trace_id=" not in plain.log()
    # Off: the client's trace context is not passed on either.
    for engine in sims.engines:
        contexts = [c for c in engine.stats()["trace_contexts"] if c["request_id"] == "untraced-1"]
        assert all(c["traceparent"] is None and c["tracestate"] is None for c in contexts)
    base = receiver.url.removesuffix("/v1/traces")
    env = {**QUICK, "OTEL_EXPORTER_OTLP_ENDPOINT": base, "OTEL_SERVICE_NAME": "edge-router"}
    with RouterProcess(prefill, decode, env=env) as traced:
        client_for(traced).completions.create(
            model="sim-model",
            prompt="traced",
            max_tokens=2,
            extra_headers={**headers, "x-request-id": "env-1"},
        )
        spans = receiver.request_trace("env-1", 5)
    assert {span.resource["service.name"] for span in spans} == {"edge-router"}
    assert {span.trace_id for span in spans} == {trace_id}
    # The untraced router's request, sent first, never reached the receiver.
    assert not [
        s for s in receiver.spans if s.attributes.get("pd_router.request_id") == "untraced-1"
    ]


def test_spans_still_queued_are_exported_on_shutdown(
    sims: SimFleet, receiver: OtlpReceiver
) -> None:
    prefill, decode = [e.url for e in sims.prefill], [e.url for e in sims.decode]
    # A schedule no test waits out: only the flush at shutdown can send these spans.
    env = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}
    # With the collector's Basic credentials in the URL: used, and never logged.
    endpoint = receiver.url.replace("http://", "http://collector:S3cretT0ken@")
    args = ("--otlp-traces-endpoint", endpoint, "--log-level", "info")
    with RouterProcess(prefill, decode, *args, env=env) as router:
        client_for(router).completions.create(
            model="sim-model",
            prompt="last words",
            max_tokens=2,
            extra_headers={"x-request-id": "last-1"},
        )
        posts = receiver.posts
        logged = router.log()
        assert router.stop(timeout=30) == 0
    spans = receiver.request_trace("last-1", 5)
    assert "S3cretT0ken" not in logged and "OTLP/HTTP to http://***@127.0.0.1:" in logged
    assert receiver.posts > posts
    assert {span.name for span in spans} >= {"POST /v1/completions", "prefill", "decode"}


@pytest.mark.parametrize(
    "setting",
    [["--otlp-traces-endpoint", "http://127.0.0.1:9/v1/traces"], ["OTEL_EXPORTER_OTLP_ENDPOINT"]],
)
def test_tracing_without_its_packages_says_what_to_install(setting: list[str]) -> None:
    # Python's own way to make a package absent: None in sys.modules fails its import.
    code = (
        "import sys; sys.modules['opentelemetry'] = None; " "from pd_router.cli import main; main()"
    )
    argv = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--port", "0"]
    env = {}
    if setting[0].startswith("--"):
        argv += setting
    else:
        env[setting[0]] = "http://127.0.0.1:9"
    done = subprocess.run(  # nosec B603
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={**_environ(), **env},
    )
    source = setting[0]
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"pd-router: error: tracing is on ({source}) but OpenTelemetry is not installed "
        f"(opentelemetry): {INSTALL}; or unset {source} to run without tracing\n"
    )


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PD_ROUTER_", "OTEL_"))}


def test_a_non_streamed_answer_s_usage_and_the_service_are_on_its_spans(
    router: RouterProcess, sims: SimFleet, receiver: OtlpReceiver
) -> None:
    answer = client_for(router).completions.create(
        model="sim-model",
        prompt="count these words for the usage please, all nine",
        max_tokens=3,
        extra_headers={"x-request-id": "usage-1"},
    )
    assert answer.usage is not None
    usage = answer.usage
    assert usage.prompt_tokens != usage.completion_tokens == 3
    spans = by_name(receiver.request_trace("usage-1", 5))
    [decode] = spans["decode"]
    assert decode.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert decode.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    # No OTEL_SERVICE_NAME: the router names itself, not the SDK's "unknown_service".
    assert {s.resource["service.name"] for named in spans.values() for s in named} == {"pd-router"}


def test_a_keyed_request_s_span_names_its_key_and_never_holds_the_key(
    sims: SimFleet, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    secret = "sk-traced-0123456789abcdef"
    keys = tmp_path / "keys"
    keys.write_text(f"tracer {secret}\n")
    prefill, decode = [e.url for e in sims.prefill], [e.url for e in sims.decode]
    args = ["--otlp-traces-endpoint", receiver.url, "--api-keys-file", str(keys)]
    with RouterProcess(prefill, decode, *args, env=QUICK) as keyed:
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=secret, max_retries=0).completions.create(
            model="sim-model", prompt="keyed", max_tokens=2, extra_headers={"x-request-id": "key-1"}
        )
        spans = receiver.request_trace("key-1", 5)
        # Refused before its relay began (not JSON): named all the same, as its metric is.
        headers = {"authorization": f"Bearer {secret}", "x-request-id": "key-2"}
        refused = httpx.post(f"{keyed.url}/v1/completions", content=b"{nope", headers=headers)
        assert refused.status_code == 400
        [refused_root] = receiver.request_trace("key-2", 1)
    [root] = [s for s in spans if s.name == "POST /v1/completions"]
    assert root.attributes["pd_router.key"] == "tracer"
    assert secret not in repr(spans)
    assert refused_root.attributes["pd_router.outcome"] == "bad_request"
    assert refused_root.attributes["pd_router.key"] == "tracer"
    assert secret not in repr(refused_root)

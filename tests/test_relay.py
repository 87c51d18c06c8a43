"""The relay in-process, under asyncio and trio, with scripted engines.

The windows a real server can't hit on demand (a client gone in the very tick prefill
answered; a decode engine that never takes the request) are driven here step by step.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
import pytest

from pd_router.errors import Evidence, Unavailable, UpstreamError
from pd_router.fleet.holdings import describe
from pd_router.fleet.nodes import Failure, Node
from pd_router.fleet.registry import Fleet
from pd_router.relay import Relay, Router, Settings

pytestmark = pytest.mark.anyio

KV = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [7]}
PREFILL_ANSWER = orjson.dumps(
    {"kv_transfer_params": KV, "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}
)
DECODE_ANSWER = orjson.dumps({"choices": [{"text": " hi"}], "usage": {"prompt_tokens": 2}})


class ScriptedResponse:
    def __init__(self, url: str, body: bytes, before_read: Callable[[], Awaitable[None]]) -> None:
        self.status = 200
        self.url = url
        self._body = body
        self._before_read = before_read
        self.closed = False
        self.close_error: Exception | None = None
        self.chunks_read = 0

    def close(self) -> None:
        if self.close_error is not None:
            raise self.close_error
        self.closed = True

    async def read(self) -> bytes:
        await self._before_read()
        await anyio.lowlevel.checkpoint()  # a real read waits for bytes: cancellable
        return self._body

    async def next_chunk(self) -> bytes:
        assert not self.closed, "read after close"
        await anyio.lowlevel.checkpoint()
        self.chunks_read += 1
        body, self._body = self._body, b""
        return body

    async def error(self) -> UpstreamError:
        kind = "http_4xx" if self.status < 500 else "http_5xx"
        return UpstreamError(f"{self.url}: HTTP {self.status}", status=self.status, kind=kind)


async def nothing() -> None:
    pass


class ScriptedUpstream:
    """Records what each engine was sent; ``on_prefill_read`` / ``decode_headers`` script timing."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.responses: list[ScriptedResponse] = []
        self.on_prefill_read: Callable[[], Awaitable[None]] = nothing
        self.prefill_headers: Callable[[], Awaitable[None]] = nothing
        self.decode_headers: Callable[[], Awaitable[None]] = nothing
        self.on_decode_read: Callable[[], Awaitable[None]] = nothing
        self.status: dict[str, int] = {}
        self.close_error: Exception | None = None
        self.decode_answer = DECODE_ANSWER
        self.read_timeout = 600.0  # as Upstream's: what the relay says a silence lasted
        # Origins that raise this error instead of answering, as Upstream.post does when
        # it could not connect.
        self.unreachable: dict[str, UpstreamError] = {}

    async def post(
        self,
        url: str,
        body: Any,
        request_id: str,
        via: bytes = b"",
        headers: bytes = b"",
        *,
        first_bytes: bool = False,
    ) -> ScriptedResponse:
        # A real post waits for its connection: a cancellation lands here (a request the
        # fleet failed, for one).
        await anyio.lowlevel.checkpoint()
        self.sent.append((url, body))
        error = self.unreachable.get(url.split("/v1")[0])
        if error is not None:
            raise error
        if url.startswith("http://prefill"):
            await self.prefill_headers()
            response = ScriptedResponse(url, PREFILL_ANSWER, self.on_prefill_read)
        else:
            await self.decode_headers()
            response = ScriptedResponse(url, self.decode_answer, self.on_decode_read)
        response.status = self.status.get(url.split("/v1")[0], 200)
        if not url.startswith("http://prefill"):
            response.close_error = self.close_error  # closing the decode stream fails
        self.responses.append(response)
        return response


class Client:
    """The ASGI side: a client that can leave when the test says so."""

    def __init__(self) -> None:
        self.gone = anyio.Event()
        self.messages: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.gone.set()  # as ASGI servers do: receive() reports a disconnect from now on


def outcomes(router: Router) -> dict[tuple[str, str], int]:
    """By endpoint and outcome (these requests carry no client key)."""
    counts = router.telemetry.outcomes.items()
    return {(endpoint, outcome): n for (endpoint, outcome, _), n in counts if n}


def make_router(
    upstream: ScriptedUpstream, grace: float = 5.0, prefills: int = 1, decodes: int = 1
) -> Router:
    fleet = Fleet(
        [Node(id=i, url=f"http://prefill{i}", slots=1, role="prefill") for i in range(prefills)],
        [
            Node(id=prefills + i, url="http://decode" + (str(i) if decodes > 1 else ""), slots=1)
            for i in range(decodes)
        ],
    )
    return Router(
        fleet=fleet,
        upstream=upstream,  # type: ignore[arg-type]
        settings=Settings(handoff_grace=grace),
    )


BODY = {"model": "m", "prompt": "hi there", "max_tokens": 20, "stream": False}


async def served(router: Router, body: dict[str, Any]) -> Client:
    """One request through the relay, start to end; the client, with what it was sent."""
    client = Client()
    await Relay(router, "completions", body, "r")(
        {}, client.receive, client.send  # type: ignore[arg-type]
    )
    return client


async def test_a_whole_request_releases_its_slot_and_reports_prefill_usage() -> None:
    upstream = ScriptedUpstream()
    router = make_router(upstream)
    client = await served(router, dict(BODY))
    body = orjson.loads(client.messages[-1]["body"])
    assert body["usage"] == {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
    assert [url for url, _ in upstream.sent] == ["http://prefill0/v1/completions"] + [
        "http://decode/v1/completions"
    ]
    assert upstream.sent[1][1] == {**BODY, "kv_transfer_params": KV}
    assert router.fleet.pool.in_use == 0 and router.fleet.pool.released == 1
    assert outcomes(router) == {("completions", "ok"): 1}


async def test_client_gone_as_prefill_answers_still_hands_the_kv_over() -> None:
    upstream = ScriptedUpstream()
    router = make_router(upstream)
    client = Client()

    async def leave_while_the_answer_is_read() -> None:
        with anyio.CancelScope(shield=True):
            client.gone.set()
            await anyio.sleep(0.05)  # the watcher runs and cancels the relay

    upstream.on_prefill_read = leave_while_the_answer_is_read
    await Relay(router, "completions", {**BODY, "stream": True}, "r2")(
        {}, client.receive, client.send  # type: ignore[arg-type]
    )
    assert len(upstream.sent) == 2, "the decode request was sent although the client left"
    drain = upstream.sent[1][1]
    assert drain["max_tokens"] == 1 and drain["stream"] is False
    assert drain["kv_transfer_params"] == KV
    assert all(response.closed for response in upstream.responses)
    assert client.messages == [], "nothing is sent to a client that left"
    assert router.fleet.pool.in_use == 0 and router.fleet.pool.released == 1
    assert outcomes(router) == {("completions", "client_aborted"): 1}


def decode_that_never_answers(upstream: ScriptedUpstream) -> anyio.Event:
    """The decode engine takes the request and answers nothing; set once it has it."""
    has_it = anyio.Event()

    async def never() -> None:
        has_it.set()
        await anyio.sleep(3600)

    upstream.decode_headers = never
    return has_it


async def test_a_decode_engine_that_never_takes_the_kv_is_dropped_after_the_grace() -> None:
    upstream = ScriptedUpstream()
    router = make_router(upstream, grace=0.2)
    client = Client()
    in_decode = decode_that_never_answers(upstream)
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            Relay(router, "completions", dict(BODY), "r3"), {}, client.receive, client.send
        )
        await in_decode.wait()
        started = anyio.current_time()
        client.gone.set()
    assert 0.15 < anyio.current_time() - started < 2
    assert router.fleet.pool.in_use == 0 and router.fleet.pool.released == 1
    assert outcomes(router) == {("completions", "client_aborted"): 1}


async def test_a_client_gone_during_decode_headers_waits_for_them_then_closes() -> None:
    upstream = ScriptedUpstream()
    router = make_router(upstream)
    client = Client()

    async def slow_accept() -> None:
        client.gone.set()
        await anyio.sleep(0.1)  # shielded: the client leaving does not interrupt this

    upstream.decode_headers = slow_accept
    await Relay(router, "completions", {**BODY, "stream": True}, "r4")(
        {}, client.receive, client.send  # type: ignore[arg-type]
    )
    assert upstream.sent[1][1]["stream"] is True, "the real decode request, not a drain"
    # A stream's headers come before the engine pulls the KV; its first bytes after.
    assert upstream.responses[1].chunks_read == 1, "hung up before the engine had the KV"
    assert all(response.closed for response in upstream.responses)
    assert client.messages == []
    assert router.fleet.pool.in_use == 0 and router.fleet.pool.released == 1


def failing_prefill0(upstream: ScriptedUpstream, refused: bool) -> None:
    """prefill0 refuses the connection, or answers 503: an engine's fault either way."""
    if refused:
        upstream.unreachable["http://prefill0"] = UpstreamError(
            "http://prefill0: unreachable: refused", kind="unreachable"
        )
    else:
        upstream.status["http://prefill0"] = 503


@pytest.mark.parametrize("refused", [False, True], ids=["503", "refused"])
async def test_prefill_retries_once_on_another_node_after_an_engine_failure(
    refused: bool,
) -> None:
    """A refusal makes the node dead, which fails the requests bound to it: not the one
    that saw it, which goes to the other node like after a 503."""
    upstream = ScriptedUpstream()
    failing_prefill0(upstream, refused)
    router = make_router(upstream, prefills=2)
    client = await served(router, dict(BODY))
    assert [url for url, _ in upstream.sent] == [
        "http://prefill0/v1/completions",
        "http://prefill1/v1/completions",
        "http://decode/v1/completions",
    ]
    assert client.messages[0]["status"] == 200
    assert outcomes(router) == {("completions", "ok"): 1}
    p0, p1 = router.fleet.prefill.nodes
    assert p0.failures == 1 and p1.failures == 0
    assert p0.serving is not refused and p1.serving
    assert router.fleet.pool.in_use == 0
    assert not p0.bound and not p1.bound, "the prefill policy's load counts are released"
    assert router.telemetry.prefill_picks == {("prefix", "miss"): 2}


async def test_a_prefill_that_fails_after_the_client_left_is_not_tried_again() -> None:
    """The client gone while its prefill engine answers 503: nobody waits for the prompt
    any more, so it is not computed on a second engine (whose KV only a drain or its lease
    would free), and the failure says nothing against the engine."""
    upstream = ScriptedUpstream()
    upstream.status["http://prefill0"] = 503
    router = make_router(upstream, prefills=2)
    client = Client()

    async def leave() -> None:
        with anyio.CancelScope(shield=True):
            client.gone.set()
            await anyio.sleep(0.05)  # the watcher runs and marks the client gone

    upstream.prefill_headers = leave
    await Relay(router, "completions", dict(BODY), "r8")(
        {}, client.receive, client.send  # type: ignore[arg-type]
    )
    assert [url for url, _ in upstream.sent] == ["http://prefill0/v1/completions"]
    assert outcomes(router) == {("completions", "client_aborted"): 1}
    p0, p1 = router.fleet.prefill.nodes
    assert p0.failures == 0 and router.telemetry.upstream_errors == {}
    assert router.fleet.pool.in_use == 0


@pytest.mark.parametrize(
    "error, dead",
    [
        (UpstreamError("http://decode0: unreachable: refused", kind="unreachable"), True),
        (UpstreamError("http://decode0: unreachable: timed out", kind="connect_timeout"), False),
    ],
    ids=["refused", "connect_timeout"],
)
async def test_a_decode_engine_out_of_reach_hands_the_request_to_another(
    error: UpstreamError, dead: bool, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = ScriptedUpstream()
    upstream.unreachable["http://decode0"] = error
    router = make_router(upstream, decodes=2)
    with caplog.at_level(logging.WARNING, logger="pd_router"):
        client = await served(router, dict(BODY))
    # Said, as a prefill's retry is (before, nothing said the request moved).
    said = f"decode node 1 not reached (decode engine {error.message}), handing over to node 2"
    assert said in caplog.text
    assert [url for url, _ in upstream.sent] == [
        "http://prefill0/v1/completions",
        "http://decode0/v1/completions",
        "http://decode1/v1/completions",
    ]
    # The same KV, still waiting on the prefill engine, goes to the other node.
    assert upstream.sent[2][1] == upstream.sent[1][1] == {**BODY, "kv_transfer_params": KV}
    assert client.messages[0]["status"] == 200
    assert outcomes(router) == {("completions", "ok"): 1}
    d0, d1 = router.fleet.pool.nodes
    # A refusal: the engine is gone. A connect timeout: one failure, the node stays.
    assert d0.serving is not dead and d0.failures == 1
    assert d0.in_use == d1.in_use == 0
    assert not d0.bound and not d1.bound, "bound to the node it went to, then released"
    pool = router.fleet.pool
    assert pool.acquired == pool.released == 2


@pytest.mark.parametrize("there", ["nothing", "the prompt", "no prefill node"])
async def test_a_request_moved_to_another_decode_node_decides_again_where_it_is_computed(
    there: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``--max-local-prefill``: short for what the first decode node holds, so that node
    was to compute it; out of reach, the request moves to a node that may hold none of it.
    There a prefill engine computes it (before, the other node computed 400 tokens alone),
    and the log says so; a node that holds it too computes it itself, and so does one with
    no prefill engine live to take it (as the first was to)."""
    upstream = ScriptedUpstream()
    upstream.unreachable["http://decode0"] = UpstreamError(
        "http://decode0: unreachable: refused", kind="unreachable"
    )
    router = make_router(upstream, decodes=2)
    router.settings.max_local_prefill = 64  # a chunk: what is held ends at a whole one
    body = {**BODY, "prompt": " ".join(f"w{index}" for index in range(400))}
    d0, d1 = router.fleet.pool.nodes
    kv = router.fleet.kv
    for node in (d0, d1) if there == "the prompt" else (d0,):
        kv.placed(node.id, node.role, node.url, describe(body, kv.ratio))
    if there == "no prefill node":
        (p0,) = router.fleet.prefill.nodes
        router.fleet.failed(p0, Failure("unreachable", "refused", Evidence.FATAL))
    with caplog.at_level(logging.INFO, logger="pd_router.access"):
        client = await served(router, dict(body))
    sent = [url for url, _ in upstream.sent]
    assert "kv_transfer_params" not in upstream.sent[0][1], "decode0 was to compute it"
    local = there != "nothing"
    if local:
        assert sent == ["http://decode0/v1/completions", "http://decode1/v1/completions"]
        assert "kv_transfer_params" not in upstream.sent[1][1]
    else:
        assert sent == [
            "http://decode0/v1/completions",
            "http://prefill0/v1/completions",
            "http://decode1/v1/completions",
        ]
        assert upstream.sent[2][1] == {**body, "kv_transfer_params": KV}
    assert client.messages[0]["status"] == 200
    assert outcomes(router) == {("completions", "ok"): 1}
    assert router.fleet.pool.in_use == 0 and not d0.bound and not d1.bound
    (line,) = (
        record.getMessage() for record in caplog.records if record.name == "pd_router.access"
    )
    assert f"local_prefill={local}" in line and f"decode_node={d1.id}" in line
    assert ("prefill_node=None" in line) is local
    # Predicted cached where it was computed: decode1's (``prefix`` predicts no prefill's).
    expected = {"nothing": "None", "the prompt": "448", "no prefill node": "0"}[there]
    assert f"predicted_cached={expected} " in line


async def test_a_connect_timeout_with_no_other_decode_node_is_reported() -> None:
    upstream = ScriptedUpstream()
    upstream.unreachable["http://decode"] = UpstreamError(
        "http://decode: unreachable: connect timed out after 5 s", kind="connect_timeout"
    )
    router = make_router(upstream)
    client = await served(router, dict(BODY))
    # Not sent to the same node again: it just failed to connect.
    assert [url for url, _ in upstream.sent].count("http://decode/v1/completions") == 1
    assert client.messages[0]["status"] == 502
    message = orjson.loads(client.messages[1]["body"])["error"]["message"]
    assert message == "decode engine http://decode: unreachable: connect timed out after 5 s"
    assert router.fleet.pool.in_use == 0


async def test_an_engine_4xx_is_passed_on_and_does_not_count_against_the_node() -> None:
    upstream = ScriptedUpstream()
    upstream.status["http://decode"] = 400
    router = make_router(upstream)
    client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 400
    assert all(node.failures == 0 for node in router.fleet.nodes)
    assert outcomes(router) == {
        ("completions", "bad_request"): 1
    }  # the request's, not the engine's
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}


async def test_abort_is_two_phase_and_keeps_the_binding_when_closing_upstream_fails() -> None:
    from pd_router.errors import Aborted

    upstream = ScriptedUpstream()
    router = make_router(upstream)
    client = Client()
    reading = anyio.Event()

    async def generate_forever() -> None:
        reading.set()
        await anyio.sleep(3600)

    upstream.on_decode_read = generate_forever
    upstream.close_error = OSError("injected: cannot close")
    relay = Relay(router, "completions", dict(BODY), "r7")
    async with anyio.create_task_group() as tg:
        tg.start_soon(relay, {}, client.receive, client.send)
        await reading.wait()
        with pytest.raises(OSError):
            relay.close_upstream()
        assert "r7" in router.fleet.bindings, "nothing committed: the abort can be retried"
        assert client.messages == [] and router.fleet.pool.in_use == 1
        for response in relay._open:
            response.close_error = None
        relay.close_upstream()
        assert all(response.closed for response in upstream.responses)
        relay.fail(Aborted("request aborted by an operator"))
    body = orjson.loads(client.messages[-1]["body"])
    assert body["error"]["code"] == "abort"
    assert router.fleet.bindings == {} and router.fleet.pool.in_use == 0
    assert outcomes(router) == {("completions", "aborted"): 1}


async def test_a_decode_stream_that_breaks_before_its_first_event_gets_an_error_status() -> None:
    upstream = ScriptedUpstream()  # its decode answer is JSON, not one SSE event
    router = make_router(upstream)
    client = await served(router, {**BODY, "stream": True})
    # The response had not started: a real status, not a 200 with an error event.
    assert client.messages[0]["status"] == 502
    assert "ended without [DONE]" in orjson.loads(client.messages[-1]["body"])["error"]["message"]
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}
    assert outcomes(router) == {("completions", "decode_error"): 1}


async def test_the_request_is_let_go_once_the_decode_engine_has_it() -> None:
    upstream = ScriptedUpstream()
    router = make_router(upstream)
    client = Client()
    relay = Relay(router, "completions", {**BODY, "prompt": "long " * 1000}, "r9")
    held: list[dict[str, Any]] = []

    async def look_while_the_answer_is_read() -> None:
        held.append(relay.body)

    upstream.on_decode_read = look_while_the_answer_is_read
    await relay({}, client.receive, client.send)  # type: ignore[arg-type]
    # Held for the whole answer, long prompts would set the memory each open stream costs.
    assert held == [{}]
    assert client.messages[0]["status"] == 200
    assert upstream.sent[1][1]["prompt"] == "long " * 1000


async def test_a_conversation_returns_to_its_prefill_node_and_the_log_says_hit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream = ScriptedUpstream()
    router = make_router(upstream, prefills=4)
    opening = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turns = [
        {"model": "m", "messages": opening},
        {"model": "m", "messages": [*opening, {"role": "assistant", "content": "yes"}]},
    ]
    caplog.set_level("INFO", logger="pd_router.access")
    for body in turns:
        client = Client()
        await Relay(router, "chat", body, "r")({}, client.receive, client.send)  # type: ignore
    prefills = [url for url, _ in upstream.sent if url.startswith("http://prefill")]
    assert len(prefills) == 2 and prefills[0] == prefills[1]
    node = prefills[0].split("/v1")[0][len("http://prefill") :]
    lines = [record.getMessage() for record in caplog.records]
    assert f"prefill_node={node} prefix_hit=False" in lines[0]
    assert f"prefill_node={node} prefix_hit=True" in lines[1]
    assert router.telemetry.prefill_picks == {("prefix", "miss"): 1, ("prefix", "hit"): 1}
    assert not any(node.bound for node in router.fleet.prefill.nodes), "no prefill outstanding"


async def test_a_model_name_cannot_forge_fields_or_lines_in_the_request_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = make_router(ScriptedUpstream())
    caplog.set_level("INFO", logger="pd_router.access")
    body = {"model": "m outcome=ok\nrequest 2", "prompt": "hi"}
    client = Client()
    await Relay(router, "completions", body, "r")({}, client.receive, client.send)  # type: ignore
    (line,) = (record.getMessage() for record in caplog.records)
    assert "\n" not in line
    assert ' model="m outcome=ok\\nrequest 2" outcome=ok ' in line


async def test_a_failure_from_outside_interrupts_a_shielded_prefill_at_once() -> None:
    """A verdict on the node (it died), a stall or the end of the shutdown bound ``fail`` a
    request: the prefill's shield (the client's leaving must not strand the KV) must not
    hold it until the engine answers (a hung one: ``--read-timeout``, 600 s)."""
    upstream = ScriptedUpstream()
    router = make_router(upstream)
    client = Client()
    in_prefill = anyio.Event()

    async def hung() -> None:
        in_prefill.set()
        await anyio.sleep(10)  # shielded: only ``fail`` ends it sooner

    upstream.on_prefill_read = hung
    relay = Relay(router, "completions", dict(BODY), "r-fail")
    async with anyio.create_task_group() as tg:
        tg.start_soon(relay, {}, client.receive, client.send)
        await in_prefill.wait()
        started = anyio.current_time()
        relay.fail(Unavailable("prefill node 0 is dead"))
        relay.fail(Unavailable("shutting down"))  # the first failure is the one told
    assert anyio.current_time() - started < 5
    assert [m["type"] for m in client.messages] == ["http.response.start", "http.response.body"]
    assert client.messages[0]["status"] == 503
    assert orjson.loads(client.messages[1]["body"])["error"]["message"] == (
        "prefill node 0 is dead"
    )
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}


async def test_a_client_gone_before_the_hand_off_gives_the_decode_engine_the_grace_only() -> None:
    """The client left while the prefill was computed: the drain that hands the KV over is
    bounded by ``--handoff-grace`` from the start, not by the read timeout."""
    upstream = ScriptedUpstream()
    router = make_router(upstream, grace=0.2)
    client = Client()

    async def leave() -> None:
        with anyio.CancelScope(shield=True):
            client.gone.set()
            await anyio.sleep(0.05)

    async def never() -> None:
        await anyio.sleep(10)  # shielded: only the grace ends it sooner

    upstream.on_prefill_read = leave
    upstream.decode_headers = never
    started = anyio.current_time()
    await Relay(router, "completions", dict(BODY), "r-grace")(
        {}, client.receive, client.send  # type: ignore[arg-type]
    )
    assert anyio.current_time() - started < 5
    assert router.fleet.pool.in_use == 0 and router.fleet.pool.released == 1
    assert outcomes(router) == {("completions", "client_aborted"): 1}


async def test_a_request_handed_to_another_decode_node_gives_the_first_its_slot_back() -> None:
    """Out of reach, the first node's slot is released as the request moves, not when the
    request ends: its queue would wait for the whole stream on the other node."""
    upstream = ScriptedUpstream()
    upstream.unreachable["http://decode0"] = UpstreamError(
        "http://decode0: unreachable: refused", kind="unreachable"
    )
    router = make_router(upstream, decodes=2)
    d0, d1 = router.fleet.pool.nodes
    seen: list[tuple[int, int]] = []

    async def look() -> None:
        seen.append((d0.in_use, d1.in_use))

    upstream.on_decode_read = look
    await served(router, dict(BODY))
    assert seen == [(0, 1)]

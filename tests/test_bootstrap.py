"""SGLang's dialect (``--dialect sglang``): what both engines are sent (no I/O), and the
relay in-process under asyncio and trio with scripted engines: one request to both at
once, the decode engine's answer relayed, a prefill failure ending the request at once."""

from __future__ import annotations

import gc
import sys
from typing import Any

import anyio
import orjson
import pytest

from pd_router.engines import bootstrap
from pd_router.errors import BadRequest, Evidence, UpstreamError
from pd_router.fleet.nodes import Failure, State
from pd_router.fleet.prefill import POLICIES, Cost
from pd_router.relay import Relay, Router
from tests.test_relay import (
    BODY,
    Client,
    ScriptedUpstream,
    decode_that_never_answers,
    failing_prefill0,
    make_router,
    nothing,
    outcomes,
    served,
)

EVENTS = b'data: {"choices":[{"text":" hi"}]}\n\ndata: [DONE]\n\n'

FIELDS = set(bootstrap.FIELDS)


def test_both_engines_get_the_body_with_the_prefill_engines_host_port_and_a_room() -> None:
    body = {**BODY, "bootstrap_host": "evil.example", "bootstrap_room": 7}
    sent = bootstrap.request(body, "10.0.0.5", 8998)
    assert sent == {**BODY, "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998,
                    "bootstrap_room": sent["bootstrap_room"]}  # fmt: skip
    assert body["bootstrap_host"] == "evil.example", "the client's body is left as it was"
    rooms = {bootstrap.request(BODY, "h", 1)["bootstrap_room"] for _ in range(1000)}
    assert len(rooms) == 1000 and all(0 <= room < 2**63 for room in rooms)


def test_a_batch_gets_one_room_per_sequence() -> None:
    prompts = {**BODY, "prompt": ["a", "b", "c"]}
    assert bootstrap.sequences(prompts, chat=False) == 3
    assert bootstrap.sequences({**BODY, "prompt": [[1, 2], [3]]}, chat=False) == 2
    assert bootstrap.sequences({**BODY, "prompt": [1, 2, 3]}, chat=False) is None, "token ids"
    assert bootstrap.sequences({**BODY, "n": 2}, chat=False) is None, "as sgl-router counts"
    assert bootstrap.sequences({"messages": [], "n": 4}, chat=True) == 4
    assert bootstrap.sequences({"messages": [], "n": 1}, chat=True) is None
    sent = bootstrap.request(prompts, "h", 9, batch=3)
    assert sent["bootstrap_host"] == ["h"] * 3 and sent["bootstrap_port"] == [9] * 3
    assert len(set(sent["bootstrap_room"])) == 3


def test_a_batch_of_more_sequences_than_the_bound_is_the_clients_error() -> None:
    """Each sequence gets a room, and both engines three lists as long: a chat's ``n`` of
    10^8, one short line, would take the router's memory. At the bound it is served."""
    limit = bootstrap.MAX_SEQUENCES
    assert bootstrap.sequences({"messages": [], "n": limit}, chat=True) == limit
    prompts = {**BODY, "prompt": ["a"] * limit}
    assert bootstrap.sequences(prompts, chat=False) == limit
    for body, chat, param in (
        ({"messages": [], "n": 10**8}, True, "n"),
        ({**BODY, "prompt": [""] * (limit + 1)}, False, "prompt"),
        ({**BODY, "prompt": [[1]] * (limit + 1)}, False, "prompt"),
    ):
        with pytest.raises(BadRequest) as refused:
            bootstrap.sequences(body, chat=chat)
        assert refused.value.status == 400 and refused.value.param == param
        assert f"at most {limit} sequences" in str(refused.value)


def test_an_ipv6_host_is_bracketed_as_sglang_dials_it() -> None:
    assert bootstrap.host_of("http://[fd00::1]:30000") == "[fd00::1]"
    assert bootstrap.host_of("https://prefill-0.prefill.svc:30000/v") == "prefill-0.prefill.svc"


def sglang_router(upstream: ScriptedUpstream, **kwargs: Any) -> Router:
    router = make_router(upstream, **kwargs)
    router.settings.dialect = "sglang"
    return router


def test_a_request_over_the_sequence_bound_is_refused_before_it_is_admitted() -> None:
    """Refused as the relay is made, before the fleet registers the request: nothing to
    leave behind (a request registered and never run would keep its id taken)."""
    router = sglang_router(ScriptedUpstream())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1025}
    with pytest.raises(BadRequest):
        Relay(router, "chat", body, "too-many")
    assert router.fleet.requests == {}
    prompts = {**BODY, "prompt": ["a"] * (bootstrap.MAX_SEQUENCES + 1)}
    with pytest.raises(BadRequest):
        Relay(router, "completions", prompts, "too-many")
    assert router.fleet.requests == {}
    # vLLM's dialect hands a batch to the decode engine whole: no room, no bound.
    router.settings.dialect = "vllm"
    assert Relay(router, "chat", body, "many").request_id in router.fleet.requests


def sent_to(upstream: ScriptedUpstream, origin: str) -> list[dict[str, Any]]:
    return [body for url, body in upstream.sent if url.startswith(origin)]


def paired(upstream: ScriptedUpstream) -> ScriptedUpstream:
    """Engines as SGLang's pair: the decode engine answers once the prefill engine has the
    request (it takes the KV from it), the prefill engine once a decode engine took it."""
    computing, taken = anyio.Event(), anyio.Event()

    async def compute() -> None:
        computing.set()

    async def take() -> None:
        await computing.wait()
        taken.set()

    async def answer_once_taken() -> None:
        await taken.wait()

    upstream.prefill_headers, upstream.decode_headers = compute, take
    upstream.on_prefill_read = answer_once_taken
    return upstream


@pytest.mark.anyio
async def test_one_request_goes_to_both_engines_and_the_decode_answer_to_the_client() -> None:
    upstream = paired(ScriptedUpstream())
    router = sglang_router(upstream)
    router.fleet.prefill.nodes[0].labels["bootstrap_port"] = "31000"
    client = await served(router, dict(BODY))
    (prefill,) = sent_to(upstream, "http://prefill0")
    (decode,) = sent_to(upstream, "http://decode")
    assert prefill == decode, "one request, to both"
    assert {key: prefill[key] for key in FIELDS} == {
        "bootstrap_host": "prefill0",
        "bootstrap_port": 31000,  # the node's label over --bootstrap-port
        "bootstrap_room": prefill["bootstrap_room"],
    }
    assert "kv_transfer_params" not in prefill and prefill["max_tokens"] == BODY["max_tokens"]
    assert client.messages[0]["status"] == 200
    # The decode engine's usage is its own: nothing of the prefill's is put in it.
    assert orjson.loads(client.messages[-1]["body"])["usage"] == {"prompt_tokens": 2}
    assert outcomes(router) == {("completions", "ok"): 1}
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}
    assert not router.fleet.prefill.nodes[0].bound, "the prefill placement was released"
    assert all(response.closed for response in upstream.responses)


@pytest.mark.anyio
async def test_without_a_label_the_prefill_engine_is_dialled_on_the_bootstrap_port() -> None:
    upstream = ScriptedUpstream()
    router = sglang_router(upstream)
    router.settings.bootstrap_port = 8999
    await served(router, dict(BODY))
    assert sent_to(upstream, "http://decode")[0]["bootstrap_port"] == 8999


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["500", "refused"])
async def test_a_prefill_that_fails_before_the_answer_began_fails_the_request_at_once(
    how: str,
) -> None:
    """The decode engine would wait for KV that never comes (until SGLang's own timeout,
    minutes): the request ends as soon as the prefill failed, its decode request closed."""
    upstream = ScriptedUpstream()
    if how == "500":
        upstream.status["http://prefill0"] = 500
    else:
        upstream.unreachable["http://prefill0"] = UpstreamError(
            "http://prefill0: unreachable: refused", kind="unreachable"
        )

    decode_that_never_answers(upstream)
    router = sglang_router(upstream)
    with anyio.fail_after(10):
        client = await served(router, {**BODY, "stream": True})
    assert client.messages[0]["status"] == (500 if how == "500" else 502), "as for vLLM's"
    error = orjson.loads(client.messages[-1]["body"])["error"]
    assert error["message"].startswith("prefill engine http://prefill0"), error
    assert outcomes(router) == {("completions", "prefill_error"): 1}
    p0 = router.fleet.prefill.nodes[0]
    assert p0.failures == 1 and not p0.bound
    assert router.fleet.pool.nodes[0].failures == 0, "nothing said against the decode engine"
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}
    assert all(response.closed for response in upstream.responses)


@pytest.mark.anyio
async def test_a_prefill_that_fails_once_the_answer_began_leaves_the_answer_whole() -> None:
    upstream = ScriptedUpstream()
    upstream.decode_answer = b'data: {"choices":[{"text":" hi"}]}\n\ndata: [DONE]\n\n'
    upstream.status["http://prefill0"] = 500
    started = anyio.Event()
    client = Client()
    router = sglang_router(upstream)
    p0 = router.fleet.prefill.nodes[0]

    async def fail_once_the_answer_began() -> None:
        await started.wait()

    async def send(message: dict[str, Any]) -> None:
        await client.send(message)
        if message["type"] == "http.response.start":
            started.set()
            with anyio.fail_after(5):  # the answer goes on once the prefill has failed
                while not p0.failures:
                    await anyio.sleep(0.001)

    upstream.prefill_headers = fail_once_the_answer_began
    await Relay(router, "completions", {**BODY, "stream": True}, "r")(
        {}, client.receive, send  # type: ignore[arg-type]
    )
    assert client.messages[0]["status"] == 200
    assert b"".join(m.get("body", b"") for m in client.messages) == upstream.decode_answer
    assert outcomes(router) == {("completions", "ok"): 1}
    assert p0.failures == 1, "the engine's failure still counts"
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}


@pytest.mark.anyio
async def test_the_prefill_answer_is_not_waited_for_once_the_decode_answer_is_whole() -> None:
    upstream = paired(ScriptedUpstream())

    async def never() -> None:
        await anyio.sleep(3600)

    upstream.on_prefill_read = never
    router = sglang_router(upstream)
    p0 = router.fleet.prefill.nodes[0]
    p0.failures = p0.request_failures = 2
    with anyio.fail_after(10):
        client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 200
    assert outcomes(router) == {("completions", "ok"): 1}
    assert all(response.closed for response in upstream.responses), "the prefill closed"
    assert not p0.bound and router.fleet.pool.in_use == 0
    # The decode engine answered from the KV it computed: a success of the prefill node's
    # too (before, not counted, and its failure streak went on).
    assert p0.failures == p0.request_failures == 0


@pytest.mark.anyio
async def test_a_decode_engine_out_of_reach_hands_the_same_room_to_another() -> None:
    """The prefill engine waits for whichever decode engine asks for its room."""
    upstream = paired(ScriptedUpstream())
    upstream.unreachable["http://decode0"] = UpstreamError(
        "http://decode0: unreachable: refused", kind="unreachable"
    )
    router = sglang_router(upstream, decodes=2)
    client = await served(router, dict(BODY))
    first, second = sent_to(upstream, "http://decode")
    assert first == second == sent_to(upstream, "http://prefill0")[0]
    assert client.messages[0]["status"] == 200
    assert router.fleet.pool.in_use == 0


@pytest.mark.anyio
async def test_a_client_gone_closes_both_requests_at_once() -> None:
    """SGLang's engines let go of a request's KV when it is closed: no grace, no drain."""
    upstream = ScriptedUpstream()
    client = Client()
    decode_sent = decode_that_never_answers(upstream)
    router = sglang_router(upstream, grace=60)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(Relay(router, "completions", dict(BODY), "r"), {}, client.receive,
                          client.send)  # fmt: skip
            await decode_sent.wait()
            client.gone.set()
    assert len(upstream.sent) == 2, "nothing more was sent (no drain)"
    assert all(response.closed for response in upstream.responses)
    assert outcomes(router) == {("completions", "client_aborted"): 1}
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}


@pytest.mark.anyio
@pytest.mark.parametrize(("status", "stream"), [(500, False), (503, True), (400, False)])
async def test_a_decode_engine_error_is_the_clients_and_closes_the_prefill(
    status: int, stream: bool
) -> None:
    """As in vLLM's dialect: the engine's status, its message named with the decode engine
    (before, an error raised inside the task group reached the client as a 500, "internal
    router error"); a 5xx counts against the decode node only, and the prefill engine,
    waiting for a decode engine to take its room, is closed."""
    upstream = paired(ScriptedUpstream())
    upstream.status["http://decode"] = status
    router = sglang_router(upstream)
    with anyio.fail_after(10):
        client = await served(router, {**BODY, "stream": stream})
    assert client.messages[0]["status"] == status
    error = orjson.loads(client.messages[-1]["body"])["error"]
    assert error["message"].startswith("decode engine http://decode"), error
    outcome = "bad_request" if status < 500 else "decode_error"
    assert outcomes(router) == {("completions", outcome): 1}
    assert router.fleet.pool.nodes[0].failures == (status >= 500)
    assert router.fleet.prefill.nodes[0].failures == 0
    assert all(response.closed for response in upstream.responses)
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}
    assert not router.fleet.prefill.nodes[0].bound


@pytest.mark.anyio
@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_the_prompt_is_not_held_while_the_answer_streams(dialect: str) -> None:
    """A long prompt held for as long as its answer streams would set the memory each open
    stream costs. SGLang's request (the body with the bootstrap fields) was held by the
    relay, the prefill task and what the decode engine was handed."""
    upstream = ScriptedUpstream() if dialect == "vllm" else paired(ScriptedUpstream())
    upstream.decode_answer = EVENTS
    router = make_router(upstream) if dialect == "vllm" else sglang_router(upstream)
    post = upstream.post

    async def post_recording_no_prompt(url: str, body: Any, *args: Any, **kwargs: Any) -> Any:
        answer = await post(url, body, *args, **kwargs)
        # The script's own records of what was sent (in SGLang's dialect both engines get
        # one body; the other request's record may come later).
        upstream.sent[:] = [
            (to, {**sent, "prompt": "..."} if sent is body else sent) for to, sent in upstream.sent
        ]
        return answer

    upstream.post = post_recording_no_prompt  # type: ignore[method-assign]
    prompt = "x" * 1_000_000
    body = {**BODY, "prompt": prompt, "stream": True}
    client = Client()
    holders: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        await client.send(message)
        if message["type"] == "http.response.start":
            gc.collect()
            holders.append(sys.getrefcount(prompt))

    await Relay(router, "completions", dict(body), "r")(
        {}, client.receive, send  # type: ignore[arg-type]
    )
    # The test's own: ``prompt``, ``body`` and getrefcount's argument.
    assert holders == [3]
    assert client.messages[0]["status"] == 200


@pytest.mark.anyio
@pytest.mark.parametrize("refused", [False, True], ids=["503", "refused"])
async def test_a_failed_prefill_is_tried_once_more_on_another_node_with_a_new_room(
    refused: bool,
) -> None:
    """As in vLLM's dialect: an engine's fault, before the answer began, is worth another
    prefill node; the decode engine's first request (waiting for a room that will never be
    computed) is closed and it gets the request again, with the other node's room."""
    upstream = ScriptedUpstream()
    failing_prefill0(upstream, refused)
    second = anyio.Event()

    async def computing() -> None:
        if upstream.sent[-1][0].startswith("http://prefill1"):
            second.set()

    async def takes_the_second_room() -> None:
        await second.wait()

    upstream.prefill_headers, upstream.decode_headers = computing, takes_the_second_room
    router = sglang_router(upstream, prefills=2)
    with anyio.fail_after(10):
        client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 200
    assert outcomes(router) == {("completions", "ok"): 1}
    p0, p1 = router.fleet.prefill.nodes
    (first,), (again,) = sent_to(upstream, "http://prefill0"), sent_to(upstream, "http://prefill1")
    assert first["bootstrap_room"] != again["bootstrap_room"]
    assert first["bootstrap_host"] == "prefill0" and again["bootstrap_host"] == "prefill1"
    assert [body["bootstrap_room"] for body in sent_to(upstream, "http://decode")][-1] == (
        again["bootstrap_room"]
    )
    assert p0.failures == 1 and p1.failures == 0
    assert not p0.bound and not p1.bound and router.fleet.pool.in_use == 0
    assert all(response.closed for response in upstream.responses)


@pytest.mark.anyio
@pytest.mark.parametrize("first", ["decode", "prefill"])
async def test_a_silence_before_the_answer_is_no_nodes_fault_and_names_both_engines(
    first: str,
) -> None:
    """No KV went from the prefill engine to the decode engine within the read timeout,
    both silent: the prefill waits for a decode engine to take its room (one whose memory
    is full takes none), the decode for the prefill's KV (a prefill behind in its queue
    sends none). Before, the client's 504 named whichever engine's timeout came first, and
    a prefill's counted against it (and was tried again elsewhere, behind the same decode
    engine): now one 504 names both, nothing is said against either, nothing is retried."""
    upstream = ScriptedUpstream()
    upstream.read_timeout = 3.0
    silence = UpstreamError("no byte from the engine for 3 s", status=504, kind="timeout")

    async def prefill_silent() -> None:
        if first == "decode":
            await anyio.sleep(3600)
        raise silence

    async def decode_silent() -> None:
        if first == "prefill":
            await anyio.sleep(3600)
        await anyio.sleep(0.05)
        raise silence

    upstream.prefill_headers, upstream.decode_headers = prefill_silent, decode_silent
    router = sglang_router(upstream, prefills=2)
    with anyio.fail_after(10):
        client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 504
    error = orjson.loads(client.messages[-1]["body"])["error"]
    assert error["message"] == (
        "no KV went from prefill engine http://prefill0 to decode engine http://decode "
        "within 3 s"
    )
    assert outcomes(router) == {("completions", "timeout"): 1}
    assert len(sent_to(upstream, "http://prefill")) == 1, "no other prefill node tried"
    p0, _ = router.fleet.prefill.nodes
    assert p0.failures == 0 and router.fleet.pool.nodes[0].failures == 0
    assert not p0.bound and router.fleet.pool.in_use == 0


@pytest.mark.anyio
async def test_a_chat_of_several_choices_gets_a_room_for_each_at_both_engines() -> None:
    """A chat's ``n`` over 1 is a batch to SGLang's engines, as a list of prompts is: one
    host, port and room per sequence, at both engines."""
    upstream = paired(ScriptedUpstream())
    router = sglang_router(upstream)
    client = Client()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 3}
    with anyio.fail_after(10):
        await Relay(router, "chat", body, "r")(
            {}, client.receive, client.send  # type: ignore[arg-type]
        )
    assert client.messages[0]["status"] == 200
    (prefill,) = sent_to(upstream, "http://prefill0")
    assert sent_to(upstream, "http://decode") == [prefill]
    assert prefill["bootstrap_host"] == ["prefill0"] * 3
    assert prefill["bootstrap_port"] == [bootstrap.DEFAULT_PORT] * 3
    assert len(set(prefill["bootstrap_room"])) == 3


@pytest.mark.anyio
async def test_when_the_other_prefill_node_fails_too_its_failure_is_the_clients() -> None:
    """Tried once more and failed again: the client gets the second engine's error (not a
    silence, nor a success), each node's failure counted once, nothing tried a third time."""
    upstream = ScriptedUpstream()
    upstream.status["http://prefill0"] = 503
    upstream.status["http://prefill1"] = 500

    decode_that_never_answers(upstream)
    router = sglang_router(upstream, prefills=2)
    with anyio.fail_after(10):
        client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 500
    error = orjson.loads(client.messages[-1]["body"])["error"]
    assert error["message"].startswith("prefill engine http://prefill1"), error
    assert outcomes(router) == {("completions", "prefill_error"): 1}
    assert len(sent_to(upstream, "http://prefill")) == 2, "one retry, not more"
    p0, p1 = router.fleet.prefill.nodes
    assert p0.failures == p1.failures == 1
    assert router.fleet.pool.nodes[0].failures == 0, "nothing said against the decode engine"
    assert not p0.bound and not p1.bound
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}
    assert all(response.closed for response in upstream.responses)


@pytest.mark.anyio
async def test_the_prefill_policy_forgets_each_placement_whatever_the_attempt_did() -> None:
    """``--prefill-policy cost`` counts the work placed on each prefill node until its
    placement is released: a placement never released would weigh against its node for
    ever. A success, an attempt that failed and its retry all release theirs."""
    upstream = paired(ScriptedUpstream())

    router = sglang_router(upstream, prefills=2)
    fleet = router.fleet
    policy = fleet.prefill = POLICIES["cost"](fleet.prefill.nodes, fleet.kv)
    assert isinstance(policy, Cost)
    with anyio.fail_after(10):
        client = await served(router, dict(BODY))
        assert client.messages[0]["status"] == 200
        assert not policy.waiting and not policy._inflight
        upstream.status["http://prefill0"] = upstream.status["http://prefill1"] = 503
        upstream.prefill_headers = upstream.on_prefill_read = nothing
        decode_that_never_answers(upstream)
        client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 503
    assert len(sent_to(upstream, "http://prefill")) == 3, "the failed attempt was retried"
    assert not policy.waiting and not policy._inflight, "every placement released"
    assert fleet.pool.in_use == 0 and fleet.bindings == {}


@pytest.mark.anyio
async def test_a_prefill_node_that_dies_once_its_answer_came_fails_no_request_on_it() -> None:
    """Once the prefill engine answered (its KV gone to the decode engine), the request no
    longer depends on its node: the node's death, as the prober sees it, leaves the decode
    engine's answer alone (it was bound to the node for as long as the request lasted)."""
    upstream = paired(ScriptedUpstream())
    router = sglang_router(upstream)
    fleet = router.fleet
    p0 = fleet.prefill.nodes[0]
    dead: list[State] = []

    async def prefill_dies_meanwhile() -> None:
        (prefill,) = (r for r in upstream.responses if r.url.startswith("http://prefill0"))
        while not prefill.closed:  # the prefill engine's answer was read whole
            await anyio.sleep(0.001)
        gone = Failure("refused", "injected: connection refused", Evidence.HARD)
        for _ in range(fleet.policy.unhealthy_after):  # refused probes: the node is dead
            fleet.failed(p0, gone, probe=True)
        dead.append(p0.state)

    upstream.on_decode_read = prefill_dies_meanwhile
    with anyio.fail_after(10):
        client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 200
    assert dead == [State.DEAD]
    assert orjson.loads(client.messages[-1]["body"])["choices"] == [{"text": " hi"}]
    assert outcomes(router) == {("completions", "ok"): 1}
    assert fleet.pool.in_use == 0 and fleet.bindings == {}


@pytest.mark.anyio
async def test_the_decode_request_of_a_failed_attempt_is_closed_before_the_retry() -> None:
    """The decode engine's first request waits for a room no prefill engine will compute:
    closed as soon as its prefill failed, not held open (a slot of the decode engine's)
    while the other prefill node is tried."""
    upstream = ScriptedUpstream()
    upstream.status["http://prefill0"] = 503
    decode_started, first_closed_at_retry = anyio.Event(), []

    async def fails_once_the_decode_engine_has_the_request() -> None:
        if upstream.sent[-1][0].startswith("http://prefill0"):
            await decode_started.wait()

    decodes = 0

    async def second_decode_request() -> None:
        nonlocal decodes
        decodes += 1
        if decodes == 2:
            first_closed_at_retry.append(upstream.responses[0].closed)

    reads = 0

    async def first_waits_for_its_room() -> None:
        nonlocal reads
        reads += 1
        if reads == 1:
            decode_started.set()
            await anyio.sleep(3600)

    upstream.prefill_headers = fails_once_the_decode_engine_has_the_request
    upstream.decode_headers = second_decode_request
    upstream.on_decode_read = first_waits_for_its_room
    router = sglang_router(upstream, prefills=2)
    with anyio.fail_after(10):
        client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 200
    assert upstream.responses[0].url.startswith("http://decode")
    assert first_closed_at_retry == [True], "the first decode request closed before the retry"
    assert all(response.closed for response in upstream.responses)
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}


@pytest.mark.anyio
async def test_a_retry_after_the_decode_engine_answered_sends_the_whole_request_again() -> None:
    """The decode engine's error head came first (one that can take no KV answers so when
    its prefill engine died mid-prefill), then the prefill engine's failure: the request
    goes to another prefill node whole. Before, the relay had let go of the body at the
    decode engine's answer head, both engines were sent the bootstrap fields alone, and
    the client got the decode engine's 400 ("prompt must be a string...") as its own."""
    upstream = ScriptedUpstream()
    upstream.status["http://prefill0"] = 503
    decode_answered, prefill_failed = anyio.Event(), anyio.Event()
    post = upstream.post

    async def first_decode_answer_fails(url: str, body: Any, *args: Any, **kwargs: Any) -> Any:
        response = await post(url, body, *args, **kwargs)
        if url.startswith("http://decode") and not decode_answered.is_set():
            response.status = 500
            error = response.error

            async def error_once_the_prefill_failed() -> UpstreamError:
                await prefill_failed.wait()
                await anyio.lowlevel.checkpoint()
                return await error()

            response.error = error_once_the_prefill_failed
            decode_answered.set()
        return response

    second = anyio.Event()

    async def prefill0_fails_after_the_decode_answer() -> None:
        if upstream.sent[-1][0].startswith("http://prefill0"):
            await decode_answered.wait()
            prefill_failed.set()
        else:
            second.set()

    async def the_second_decode_takes_the_second_room() -> None:
        if decode_answered.is_set():
            await second.wait()

    upstream.post = first_decode_answer_fails  # type: ignore[method-assign]
    upstream.prefill_headers = prefill0_fails_after_the_decode_answer
    upstream.decode_headers = the_second_decode_takes_the_second_room
    router = sglang_router(upstream, prefills=2)
    with anyio.fail_after(10):
        client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 200, client.messages
    (again,) = sent_to(upstream, "http://prefill1")
    decoded = sent_to(upstream, "http://decode")
    assert len(decoded) == 2 and decoded[1]["bootstrap_room"] == again["bootstrap_room"]
    for sent in (again, decoded[1]):
        assert {key: sent[key] for key in BODY} == BODY, sent
    assert outcomes(router) == {("completions", "ok"): 1}
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}


@pytest.mark.anyio
async def test_a_prefill_that_refuses_the_request_is_not_tried_on_another_node() -> None:
    """A 4xx is the client's request, not the engine's fault: not worth another node."""
    upstream = ScriptedUpstream()
    upstream.status["http://prefill0"] = 400

    decode_that_never_answers(upstream)
    router = sglang_router(upstream, prefills=2)
    with anyio.fail_after(10):
        client = await served(router, dict(BODY))
    assert client.messages[0]["status"] == 400
    assert len(sent_to(upstream, "http://prefill")) == 1
    assert outcomes(router) == {("completions", "bad_request"): 1}
    assert all(node.failures == 0 for node in router.fleet.nodes)
    assert router.fleet.pool.in_use == 0 and router.fleet.bindings == {}

"""Slow is not dead, end to end: a real router (its CLI) in front of simulated engines whose
``/health`` stalls, whose streams stall while ``/health`` says 200, whose answers outlast
``--read-timeout``; clients that stall the router's own loop; bad admin input.

Every case checks what a client sees, what the other clients see (nothing), and the
node's state as the admin API shows it."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from pd_router.sim.fleet import EngineProcess, SimFleet
from tests.fleet.test_fleet_e2e import Stream, admin, echo, node_states
from tests.fleet.test_fleet_e2e import router_for as fleet_router
from tests.helpers import RawClient, RouterProcess, complete, wait_for

# Probes every 0.2 s, a probe slower than 1 s is a (soft) failure, 3 in a row make a node
# unhealthy, 2 good ones readmit it. A healthy engine answers in milliseconds: the second
# is for a loaded machine (0.3 s was seen to run out), and the slow engines of these tests
# are slow by far more than the timeout, or by less than a third of it.
TIMEOUT = 1.0
PROBES = ("--health-interval", "0.2", "--health-timeout", str(TIMEOUT), "--unhealthy-after", "3")


# Prompts that stall the router, sent until one caught a probe.
CATCH_TRIES = 10


def router_for(fleet: SimFleet, *args: str) -> RouterProcess:
    # The fleet tests' router (admin token, fast probes), with these probes: later flags win.
    return fleet_router(fleet, "--decode-slots", "8", *PROBES, *args)


def node_ids(router: RouterProcess) -> dict[str, int]:
    return {n["url"]: n["id"] for n in admin(router, "GET", "/nodes").json()["nodes"]}


def streaming(router: RouterProcess, tag: str, count: int, tokens: int) -> list[Stream]:
    """``count`` streams of ``tokens`` tokens, started, each with its first event in; the
    prompts are ``f"{tag} {i} on"``, the request ids ``f"{tag}{i}"``."""
    streams = [Stream(router, f"{tag} {i} on", tokens, f"{tag}{i}") for i in range(count)]
    for stream in streams:
        stream.start()
    wait_for(lambda: all(s.events for s in streams), what=f"{count} {tag} streams flowing")
    return streams


def bound_to(router: RouterProcess, url: str) -> set[str]:
    """The ids of the requests bound to the node at ``url``, as the admin API shows them."""
    nodes = admin(router, "GET", "/nodes").json()["nodes"]
    return set(next(n for n in nodes if n["url"] == url)["bound_requests"])


def outcomes(router: RouterProcess) -> dict[str, float]:
    prefix = "pd_router_requests_total{endpoint=completions,outcome="
    metrics = router.metrics()
    return {k[len(prefix) : -1]: v for k, v in metrics.items() if k.startswith(prefix) and v}


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=2, decode_args=["--slots", "64", "--itl", "0.05"]) as fleet:
        yield fleet


def test_a_slow_health_makes_a_node_unhealthy_and_its_streams_finish(fleet: SimFleet) -> None:
    slow, other = fleet.decode
    with router_for(fleet) as router:
        ids = node_ids(router)
        # 1000 tokens at 50 ms (50 s) each, spread over both nodes: they outlast the verdict
        # however slow the machine; then the engines finish them at full speed.
        streams = streaming(router, "flow", 6, 1000)
        on_slow = slow.stats()["requests"]
        assert on_slow >= 1
        slow.configure(health_delay=20 * TIMEOUT)
        wait_for(
            lambda: node_states(router)[ids[slow.url]] == "unhealthy", timeout=60, what="unhealthy"
        )
        view = admin(router, "GET", "/nodes").json()
        victim = next(n for n in view["nodes"] if n["url"] == slow.url)
        assert victim["reason"] == "probe timeout" and victim["bound_requests"]
        for i in range(6):
            assert complete(router, f"new {i}").status_code == 200
        assert slow.stats()["requests"] == on_slow, "no new request went to the unhealthy node"
        for engine in fleet.decode:
            engine.configure(itl=0)
        for stream in streams:
            stream.join(60)
            assert stream.completed(), (stream.rid, stream.events[-2:])
            assert stream.text == echo(stream.prompt, 1000)
        slow.configure(health_delay=0)
        wait_for(
            lambda: node_states(router)[ids[slow.url]] == "serving", timeout=60, what="readmitted"
        )
        assert outcomes(router) == {"ok": 12}
        assert node_states(router)[ids[other.url]] == "serving"
        router.assert_idle()


# Streams silent this long are stalled, and their node is then held out as long: the test's
# requests elsewhere must fit in that hold (2 s did not, on a loaded machine).
STALL = 8


def test_a_hung_engine_ends_its_stalled_streams_once_and_is_readmitted(fleet: SimFleet) -> None:
    hung, other = fleet.decode
    with router_for(fleet, "--stall-timeout", str(STALL)) as router:
        ids = node_ids(router)
        streams = streaming(router, "stall", 6, 200)
        wait_for(lambda: all(len(s.events) > 2 for s in streams), what="a few events each")
        on_hung = bound_to(router, hung.url)
        assert on_hung and len(on_hung) < 6
        hung.configure(stall=True)  # no more tokens; /health still answers 200 at once
        for stream in streams:
            if stream.rid in on_hung:
                stream.join(STALL + 60)
                assert stream.status == 200 and [e["code"] for e in stream.errors] == ["stalled"]
                assert stream.events[-1] == "data: [DONE]" and stream.errors[0]["message"]
        wait_for(lambda: node_states(router)[ids[hung.url]] == "unhealthy", what="unhealthy")
        assert admin(router, "GET", "/nodes").json()["nodes"][ids[hung.url]]["reason"] == "stalled"
        before = hung.stats()["requests"]
        for i in range(4):
            assert complete(router, f"elsewhere {i}").status_code == 200
        assert hung.stats()["requests"] == before, "new requests went elsewhere"
        for stream in streams:
            if stream.rid not in on_hung:
                stream.join(60)
                assert stream.completed() and stream.text == echo(stream.prompt, 200)
        wait_for(lambda: hung.stats()["active"] == 0, what="the engine saw the aborts")
        hung.configure(stall=False)
        # Held out for --stall-timeout, then readmitted by its good probes.
        wait_for(
            lambda: node_states(router)[ids[hung.url]] == "serving",
            timeout=STALL + 60,
            what="readmitted",
        )
        for i in range(4):
            assert complete(router, f"back {i}").status_code == 200
        assert hung.stats()["requests"] > before, "the readmitted node takes traffic"
        assert outcomes(router) == {"ok": 8 + 6 - len(on_hung), "stalled": len(on_hung)}
        router.assert_idle()


def test_an_answer_longer_than_the_read_timeout_is_a_504_not_a_verdict(fleet: SimFleet) -> None:
    # The stream's tokens come 50 ms apart, the long answers' first byte after 12 s: a
    # second's lateness either way changes nothing.
    with router_for(fleet, "--read-timeout", "3") as router:
        (stream,) = streaming(router, "flowing", 1, 160)
        results: list[httpx.Response] = []

        def long_answer(i: int) -> None:
            # Not streamed: nothing comes until its 240 tokens are done, ~12 s.
            results.append(complete(router, f"long {i}", 240))

        threads = [threading.Thread(target=long_answer, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert [r.status_code for r in results] == [504] * 6
        error = results[0].json()["error"]
        assert error["code"] == "timeout"
        # As README's Errors table gives it: the connection was not lost, the router gave up.
        decode_url = error["message"].split(" ")[2]
        assert decode_url.endswith("/v1/completions:")
        assert error["message"] == f"decode engine {decode_url} no byte from the engine for 3 s"
        stream.join(60)
        assert stream.completed() and stream.text == echo(stream.prompt, 160)
        view = admin(router, "GET", "/nodes").json()["nodes"]
        assert [n["state"] for n in view] == ["serving"] * 3
        assert all(n["consecutive_failures"] == 0 for n in view)
        assert outcomes(router) == {"ok": 1, "timeout": 6}
        router.assert_idle()


def test_a_prefill_engine_silent_past_the_read_timeout_is_unhealthy_and_held_out() -> None:
    """A prefill engine that answers ``/health`` but no prefill (vLLM's hung scheduler): a
    prefill is one token, so its silence for the whole read timeout is a soft failure.
    After ``--unhealthy-after`` of them the node takes no new requests, its good probes
    readmit it only after a hold, and the requests it held were each tried once on the
    other prefill node. Before, every request sent there waited the read timeout (600 s by
    default), and the node stayed serving."""
    with SimFleet(prefill=2, decode=1, decode_args=["--slots", "64"]) as fleet:
        hung, healthy = fleet.prefill
        hung.configure(prefill_delay=120.0)
        args = ("--read-timeout", "2", "--prefill-policy", "round_robin")
        with router_for(fleet, *args) as router:
            ids = node_ids(router)
            for index in range(6):
                assert complete(router, f"turn {index}", 2).status_code == 200
            states = node_states(router)
            assert states[ids[hung.url]] == "unhealthy", states
            assert states[ids[healthy.url]] == "serving", states
            # Held out: no new request is sent to it (to wait there), though its probes
            # answer. (What was a wall-clock bound is the state it stood for.)
            sent = hung.stats()["requests"]
            for index in range(4):
                assert complete(router, f"after {index}", 2).status_code == 200
            assert hung.stats()["requests"] == sent
            assert node_states(router)[ids[hung.url]] == "unhealthy"
            view = next(
                n for n in admin(router, "GET", "/nodes").json()["nodes"] if n["url"] == hung.url
            )
            assert "no byte from the engine for 2 s" in view["last_error"], view
            router.assert_idle()


def test_clients_that_hang_up_mid_stream_say_nothing_against_the_engine(fleet: SimFleet) -> None:
    """Clients leaving in the middle of their streams (more of them than --unhealthy-after)
    are their own outcome, ``client_aborted``: the decode node's failure streak and the
    engine error metric do not move, and it stays serving for everyone else."""
    with router_for(fleet) as router:
        before = router.metrics()
        body = {"model": "sim-model", "prompt": "leaving", "max_tokens": 80, "stream": True}
        for _ in range(5):
            client = RawClient(router.url, "/v1/completions", body)
            client.read_until(b"data: ", count=3)
            client.hang_up()
        wait_for(lambda: outcomes(router).get("client_aborted", 0) >= 5, what="5 aborted")
        router.assert_idle()
        view = admin(router, "GET", "/nodes").json()["nodes"]
        assert [n["state"] for n in view] == ["serving"] * 3
        assert all(n["consecutive_failures"] == 0 for n in view), view
        errors = {
            k: v
            for k, v in router.metrics().items()
            if k.startswith("pd_router_upstream_errors") and v != before.get(k, 0)
        }
        assert errors == {}


def test_a_stream_whose_engine_goes_silent_mid_answer_ends_in_one_timeout_error(
    fleet: SimFleet,
) -> None:
    # Its first events out, the rest of a stream is poured from the engine connection's
    # callback (relay.py): the read timeout must still end it, once, and free its slot.
    with router_for(fleet, "--read-timeout", "3") as router:
        (stream,) = streaming(router, "silenced", 1, 400)
        wait_for(lambda: len(stream.events) >= 3, what="the stream poured")
        for engine in fleet.decode:
            engine.configure(itl=30)  # the next token comes long after the read timeout
        stream.join(60)
        assert stream.status == 200 and stream.events[-1:] == ["data: [DONE]"]
        assert [e["code"] for e in stream.errors] == ["timeout"], stream.errors
        assert outcomes(router) == {"timeout": 1}
        for engine in fleet.decode:
            engine.configure(itl=0)
        router.assert_idle()


BAD_URLS = [
    "http://127.0.0.1:99999",
    "http://127.0.0.1:0",
    "http://127.0.0.1:1:2",
    "http://engine-\u00e9.local:8200",
    "http://127.0.0.1:8200\r\nX-Evil: 1",
    "http://user:secret@127.0.0.1:8200",
    "http://exa mple:8200",
    "ftp://127.0.0.1:8200",
    "http://127.0.0.1:8200/?q=1",
    # No name a resolver takes: every probe failed in the name's encoding (a traceback).
    "http://a..b:8200",
    "http://" + "a" * 64 + ".local:8200",
    42,
]


def test_admin_nodes_with_bad_urls_are_refused_and_the_prober_lives_on(fleet: SimFleet) -> None:
    with router_for(fleet) as router, EngineProcess("decode", ["--slots", "8"]) as extra:
        for url in BAD_URLS:
            answer = admin(router, "POST", "/nodes", json={"url": url, "role": "decode"})
            assert answer.status_code == 400, (url, answer.text)
            error = answer.json()["error"]
            assert error["param"] == "url" and error["message"].startswith("url: "), error
            assert "secret" not in answer.text
        assert len(node_states(router)) == 3
        # Slots no engine has (with --state, the shared pool could not count them), and a
        # KV event port that is not one ("²" passed isdigit(), then crashed the subscriber
        # of every node, once a second).
        for bad, param in [
            ({"slots": 10**15}, "slots"),
            ({"role": "prefill", "labels": {"kv_events": "²"}}, "labels"),
            ({"role": "prefill", "labels": {"kv_events": "70000"}}, "labels"),
        ]:
            answer = admin(
                router, "POST", "/nodes", json={"url": extra.url, "role": "decode", **bad}
            )
            assert answer.status_code == 400, (bad, answer.text)
            assert answer.json()["error"]["param"] == param
        assert len(node_states(router)) == 3
        added = admin(router, "POST", "/nodes", json={"url": extra.url, "role": "decode"})
        assert added.status_code == 201
        # The prober still runs: a killed engine goes dead, and comes back when restarted.
        victim = fleet.decode[0]
        victim_id = node_ids(router)[victim.url]
        victim.kill()
        wait_for(lambda: node_states(router)[victim_id] == "dead", what="dead")
        victim.start().wait_healthy()
        wait_for(lambda: node_states(router)[victim_id] == "serving", what="readmitted")
        assert node_states(router)[added.json()["id"]] == "serving"


def test_a_client_that_stalls_the_router_gets_no_engine_blamed(fleet: SimFleet) -> None:
    """A 64 MB prompt of 32M token ids keeps the router's loop busy for about a second
    (parsing and checking it) before its 429. Every engine's /health takes 0.3 of the 1 s
    allowed, so a probe out when that happens times out: void, since the router lagged.
    One counted failure would make the node unhealthy here. Such prompts are sent until a
    probe was caught (each catches one with a good chance, not for sure)."""
    with router_for(
        fleet, "--decode-slots", "1", "--unhealthy-after", "1", "--max-body-bytes", str(80 << 20)
    ) as router:
        streams = streaming(router, "meanwhile", 2, 100)  # both slots
        for engine in fleet.engines:
            engine.configure(itl=0.5)  # the streams outlast the prompts
        for engine in fleet.engines:
            engine.configure(health_delay=0.3 * TIMEOUT)
        body = orjson.dumps({"model": "sim-model", "prompt": [7] * 32_000_000, "max_tokens": 1})
        for _ in range(CATCH_TRIES):
            answer = httpx.post(
                f"{router.url}/v1/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=60,
            )
            assert answer.status_code == 429, answer.text[:300]
            if "void: the router's own loop ran" in router.log():
                break
        for engine in fleet.engines:
            engine.configure(health_delay=0, itl=0)
        for stream in streams:
            stream.join(60)
            assert stream.completed() and stream.text == echo(stream.prompt, 100)
        view = admin(router, "GET", "/nodes").json()["nodes"]
        assert [n["state"] for n in view] == ["serving"] * 3, view
        log = router.log()
        assert "is unhealthy" not in log and "is dead" not in log, "a verdict, since readmitted"
        assert "void: the router's own loop ran" in log, "no probe was caught: nothing tested"
        router.assert_idle()


def test_an_engine_url_with_credentials_is_refused_at_start_without_printing_them(
    fleet: SimFleet,
) -> None:
    router = RouterProcess(["http://user:pw@127.0.0.1:1"], [fleet.decode[0].url])
    router.start()
    try:
        assert router.wait_exit(timeout=20) == 2
        assert "credentials in an engine URL are not supported" in router.log()
        assert "user:pw" not in router.log(), "credentials are never printed"
    finally:
        router.stop()


def huge_head(router: RouterProcess, size: int) -> tuple[int, bytes]:
    """A request whose one header is ``size`` bytes, sent until the router answers or stops
    reading: how many bytes of it went out by then (the router reads no faster than it is
    sent to, so this says how much it took before it refused), and what it answered, if
    anything arrived before the connection's end."""
    host, port = router.url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        chunk = b"x" * (1 << 20)
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Big: ")
            for _ in range(size // len(chunk)):
                sock.sendall(chunk)
                sent += len(chunk)
                if select.select([sock], [], [], 0)[0]:
                    break  # an answer (or the end) came
        except OSError:
            pass  # closed on us, as it should be
        try:
            return sent, sock.recv(65536)
        except OSError:
            return sent, b""


def test_a_128_mib_header_is_refused_early_and_stalls_nobody(fleet: SimFleet) -> None:
    with router_for(fleet) as router:
        (stream,) = streaming(router, "meanwhile", 1, 100)
        sent, answer = huge_head(router, 128 << 20)
        # The socket buffers hold a few MiB more than the router has read.
        assert sent < 32 << 20, f"{sent} bytes sent before the refusal: not refused early"
        if answer:  # the 431 can be lost to the reset of a connection closed mid-upload
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
            assert b'"code":"request_header_fields_too_large"' in answer
        small = complete(router, "after the big one")
        assert small.status_code == 200
        stream.join(30)
        assert stream.completed() and stream.text == echo(stream.prompt, 100)
        log = router.log()
        assert "is unhealthy" not in log and "is dead" not in log
        router.assert_idle()


def test_a_head_just_under_the_limit_is_served_and_just_over_is_431(fleet: SimFleet) -> None:
    with router_for(fleet, "--max-header-bytes", "4096") as router:
        body = {"model": "sim-model", "prompt": "fits", "max_tokens": 2}
        url = f"{router.url}/v1/completions"
        fits = httpx.post(url, json=body, headers={"x-pad": "p" * 3500}, timeout=10)
        assert fits.status_code == 200
        over = httpx.post(url, json=body, headers={"x-pad": "p" * 5000}, timeout=10)
        assert over.status_code == 431
        assert over.json()["error"]["code"] == "request_header_fields_too_large"
        # Keep-alive: many requests on one connection, each head counted on its own.
        with httpx.Client(timeout=10) as client:
            for i in range(20):
                pad = {"x-pad": "p" * 3000}
                assert client.post(url, json=body, headers=pad).status_code == 200
        router.assert_idle()

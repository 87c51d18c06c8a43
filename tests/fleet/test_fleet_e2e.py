"""Fault isolation and a live fleet, end to end: real router, simulated engines killed,
restarted, drained and added while requests stream."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from pd_router.sim.fleet import EngineProcess, SimFleet
from tests.helpers import FAST_HEALTH, RouterProcess, admin_router, complete, wait_for

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def echo(prompt: str, tokens: int) -> str:
    words = prompt.split()
    return "".join(" " + words[i % len(words)] for i in range(tokens))


def router_for(fleet: SimFleet, *args: str) -> RouterProcess:
    return admin_router(fleet, TOKEN, *args)


def admin(router: RouterProcess, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{router.url}/admin{path}", headers=AUTH, timeout=10, **kwargs)


def node_states(router: RouterProcess) -> dict[int, str]:
    return {n["id"]: n["state"] for n in admin(router, "GET", "/nodes").json()["nodes"]}


class Stream(threading.Thread):
    """One streaming client in a thread; keeps every SSE event it received."""

    def __init__(self, router: RouterProcess, prompt: str, tokens: int, rid: str) -> None:
        super().__init__(daemon=True)
        self.router, self.prompt, self.tokens, self.rid = router, prompt, tokens, rid
        self.events: list[str] = []
        self.status = 0
        self.failure: Exception | None = None

    def run(self) -> None:
        body = {"model": "sim-model", "prompt": self.prompt, "max_tokens": self.tokens}
        try:
            with httpx.stream(
                "POST",
                f"{self.router.url}/v1/completions",
                json={**body, "stream": True},
                headers={"X-Request-Id": self.rid},
                timeout=60,
            ) as response:
                self.status = response.status_code
                buffer = ""
                for text in response.iter_text():
                    buffer += text
                    *done, buffer = buffer.split("\n\n")
                    self.events.extend(done)
        except Exception as exc:  # the test asserts there are none
            self.failure = exc

    @property
    def text(self) -> str:
        return "".join(
            json.loads(e[6:])["choices"][0]["text"] for e in self.events if '"choices"' in e
        )

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [json.loads(e[6:])["error"] for e in self.events if e.startswith('data: {"error"')]

    def completed(self) -> bool:
        return self.status == 200 and self.events[-1:] == ["data: [DONE]"] and not self.errors


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=2, decode_args=["--slots", "64", "--itl", "0.05"]) as fleet:
        yield fleet


def test_a_dead_decode_engine_fails_only_its_own_streams(fleet: SimFleet) -> None:
    with router_for(fleet, "--decode-slots", "8") as router:
        streams = [Stream(router, f"w{i} x{i} y{i}", 60, f"s{i}") for i in range(16)]
        for stream in streams:
            stream.start()
        wait_for(lambda: all(d.stats()["active"] == 8 for d in fleet.decode), what="8 + 8")
        nodes = admin(router, "GET", "/nodes").json()["nodes"]
        victim_node = next(n for n in nodes if n["url"] == fleet.decode[0].url)
        on_victim = set(victim_node["bound_requests"])
        assert len(on_victim) == 8
        fleet.decode[0].kill()
        for stream in streams:
            stream.join(90)
        for stream in streams:
            assert stream.failure is None, (stream.rid, stream.events[-2:], router.log()[-2000:])
            if stream.rid in on_victim and stream.status != 200:
                # It died before its first byte went out: one JSON error instead of an event.
                assert stream.status == 502 and not stream.events
                continue
            assert stream.status == 200
            if stream.rid in on_victim:
                assert len(stream.errors) == 1, stream.events
                assert stream.events[-1] == "data: [DONE]"
                assert stream.events.count("data: [DONE]") == 1
            else:
                assert stream.completed(), stream.events
                assert stream.text == echo(stream.prompt, 60)
        router.assert_idle()
        wait_for(lambda: node_states(router)[victim_node["id"]] == "dead", what="victim dead")
        assert admin(router, "GET", "/nodes").json()["in_flight"] == 0
        survivor = fleet.decode[1]
        before = survivor.stats()["completed"]
        for i in range(4):
            assert complete(router, f"after {i}").status_code == 200
        assert survivor.stats()["completed"] == before + 4, "the dead node is not picked"
        fleet.decode[0].start().wait_healthy()
        wait_for(lambda: node_states(router)[victim_node["id"]] == "serving", what="readmission")
        for i in range(4):
            complete(router, f"back {i}").raise_for_status()
        assert fleet.decode[0].stats()["completed"] > 0, "the readmitted node takes traffic"


def test_a_request_refused_by_a_dead_decode_engine_goes_to_another(fleet: SimFleet) -> None:
    """Killed between health probes: the first request that picks it is refused, before
    anything reached it, so it goes to the other decode node with the prefill's KV, and
    the node is dead from then on. No client sees an error."""
    with router_for(fleet, "--decode-slots", "8", "--health-interval", "3600") as router:
        victim, survivor = fleet.decode
        victim.kill()
        # The router's idle keep-alive connection to it (from the start-up probe) closes
        # too; a request that picked it before the router saw that would fail "no answer"
        # by design (no request is sent twice). Let the FIN arrive.
        time.sleep(0.5)
        before = survivor.stats()["completed"]
        for i in range(4):
            prompt = f"moved {i} along"
            answer = complete(router, prompt, 3)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == echo(prompt, 3)
        assert survivor.stats()["completed"] == before + 4
        victim_id = next(
            n["id"]
            for n in admin(router, "GET", "/nodes").json()["nodes"]
            if n["url"] == victim.url
        )
        assert node_states(router)[victim_id] == "dead"
        refusals = {
            key: value
            for key, value in router.metrics().items()
            if key.startswith("pd_router_upstream_errors_total{") and value
        }
        assert list(refusals.values()) == [1.0], refusals
        assert "kind=unreachable" in next(iter(refusals)) and "role=decode" in next(iter(refusals))
        assert router.metrics()["pd_router_requests_total{endpoint=completions,outcome=ok}"] == 4
        router.assert_idle()


def test_with_no_live_decode_node_queued_requests_fail_at_once(fleet: SimFleet) -> None:
    # One failure is enough here: the holder's broken stream must mark the node dead before
    # its slot could be handed to a waiter (with a higher threshold that waiter would be
    # bound to the dying node and get that node's 502 instead).
    with RouterProcess(
        [fleet.prefill[0].url],
        [fleet.decode[0].url],
        *FAST_HEALTH,
        "--unhealthy-after",
        "1",
        "--queue-timeout",
        "60",
    ) as router:
        holder = Stream(router, "hold it", 100, "holder")
        holder.start()
        wait_for(lambda: router.in_use() == 1, what="the holder's slot")
        results: list[httpx.Response] = []

        def queued() -> None:
            results.append(complete(router, "q"))

        waiters = [threading.Thread(target=queued) for _ in range(3)]
        for waiter in waiters:
            waiter.start()
        wait_for(lambda: router.metrics()["pd_router_queue_depth"] == 3, what="3 waiters")
        killed = time.monotonic()
        fleet.decode[0].kill()
        for waiter in waiters:
            waiter.join(30)
        assert time.monotonic() - killed < 10, "told at once, not after the 60 s queue timeout"
        assert [r.status_code for r in results] == [503, 503, 503], [r.text for r in results]
        assert results[0].json()["error"]["message"] == "no live decode node"
        holder.join(10)
        assert len(holder.errors) == 1
        assert complete(router, "x").status_code == 503
        assert httpx.get(f"{router.url}/health").status_code == 503
        router.assert_idle()


def test_an_engine_400_leaves_the_node_healthy(fleet: SimFleet) -> None:
    with router_for(fleet) as router:
        for engine in fleet.decode:
            engine.configure(fail_status=400, fail_message="This model's maximum context length")
        for _ in range(5):
            assert complete(router, "too long").status_code == 400
        nodes = admin(router, "GET", "/nodes").json()["nodes"]
        assert all(n["state"] == "serving" and n["consecutive_failures"] == 0 for n in nodes)
        # Counted as the client's (the engine refused the request), not as an engine's error.
        metrics = router.metrics()
        assert metrics["pd_router_requests_total{endpoint=completions,outcome=bad_request}"] == 5
        assert (
            metrics.get("pd_router_requests_total{endpoint=completions,outcome=decode_error}", 0)
            == 0
        )


def test_drain_remove_and_add_under_load(fleet: SimFleet) -> None:
    with router_for(fleet, "--decode-slots", "8") as router:
        d0, d1 = fleet.decode
        ids = {n["url"]: n["id"] for n in admin(router, "GET", "/nodes").json()["nodes"]}
        early = [Stream(router, f"early {i}", 100, f"e{i}") for i in range(4)]
        for stream in early:
            stream.start()
        wait_for(lambda: all(s.events for s in early), what="4 streams streaming")
        on_d0 = d0.stats()["requests"]
        assert on_d0 >= 1
        drained = admin(router, "POST", f"/nodes/{ids[d0.url]}/drain")
        assert drained.status_code == 202 and drained.json()["state"] == "draining"
        assert admin(router, "DELETE", f"/nodes/{ids[d0.url]}").status_code == 409
        late = [Stream(router, f"late {i}", 4, f"l{i}") for i in range(6)]
        for stream in late:
            stream.start()
        for stream in [*early, *late]:
            stream.join(30)
            assert stream.completed(), stream.events
        assert d0.stats()["requests"] == on_d0, "no new request landed on the draining node"
        assert admin(router, "DELETE", f"/nodes/{ids[d0.url]}").status_code == 200
        with EngineProcess("decode", ["--slots", "8"]) as d2:
            added = admin(
                router, "POST", "/nodes", json={"url": d2.url, "role": "decode", "slots": 8}
            )
            assert added.status_code == 201
            new_id = added.json()["id"]
            assert new_id not in ids.values()
            after = {n["url"]: n["id"] for n in admin(router, "GET", "/nodes").json()["nodes"]}
            assert after == {**{u: i for u, i in ids.items() if u != d0.url}, d2.url: new_id}
            for i in range(6):
                complete(router, f"n {i}").raise_for_status()
            assert d2.stats()["completed"] > 0
        router.assert_idle()
        # What the operator changed, a line each (before, none).
        log = router.log()
        assert f"admin: decode node {ids[d0.url]} ({d0.url}) drained" in log
        assert f"admin: decode node {ids[d0.url]} ({d0.url}) removed" in log
        assert f"admin: decode node {new_id} ({d2.url}) added, 8 slots, labels {{}}" in log


def test_abort_by_id_mid_stream(fleet: SimFleet) -> None:
    with router_for(fleet) as router:
        stream = Stream(router, "abort this one", 200, "abort-me")
        stream.start()
        wait_for(lambda: len(stream.events) >= 3, what="a few events")
        answer = admin(router, "POST", "/requests/abort-me/abort")
        assert answer.status_code == 200 and answer.json()["aborted"] is True
        assert answer.json()["bytes_sent"] > 0
        stream.join(10)
        assert [e["code"] for e in stream.errors] == ["abort"]
        assert stream.events[-1] == "data: [DONE]"
        wait_for(lambda: sum(d.stats()["aborted"] for d in fleet.decode) == 1, what="engine abort")
        router.assert_idle()
        assert admin(router, "POST", "/requests/abort-me/abort").status_code == 404


def test_admin_needs_its_token(fleet: SimFleet) -> None:
    with router_for(fleet) as router:
        assert httpx.get(f"{router.url}/admin/nodes").status_code == 401
        wrong = httpx.get(f"{router.url}/admin/nodes", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
        # The token parsed as a client key is: the scheme in any case, spaces before it.
        token = AUTH["Authorization"].removeprefix("Bearer ")
        for spelled in (f"bearer {token}", f"BEARER  {token}"):
            nodes = httpx.get(f"{router.url}/admin/nodes", headers={"Authorization": spelled})
            assert nodes.status_code == 200, spelled
        twice = [("authorization", AUTH["Authorization"]), ("authorization", "Bearer nope")]
        assert httpx.get(f"{router.url}/admin/nodes", headers=twice).status_code == 401
        # The valid one second of two; nothing near the token either: a part of it, more
        # than it, another case, another scheme.
        refused = [
            [*reversed(twice)],
            *(
                [("authorization", spelled)]
                for spelled in (
                    f"Bearer {token[:-1]}",
                    f"Bearer {token}x",
                    f"Bearer {token.upper()}",
                    f"Basic {token}",
                    f"Bearerx {token}",
                )
            ),
        ]
        for headers in refused:
            answer = httpx.get(f"{router.url}/admin/nodes", headers=headers)
            assert answer.status_code == 401, headers
        # Every route is behind it, and a refused call changes nothing.
        stream = Stream(router, "not yours to abort", 60, "keep-me")
        stream.start()
        wait_for(lambda: len(stream.events) >= 1, what="the stream begun")
        states = node_states(router)
        slots = {n["id"]: n["slots"] for n in admin(router, "GET", "/nodes").json()["nodes"]}
        decode_id = max(states)
        for method, path, body in (
            ("POST", f"/nodes/{decode_id}/drain", None),
            ("DELETE", f"/nodes/{decode_id}?force=true", None),
            ("POST", "/nodes", {"url": fleet.decode[0].url, "role": "decode", "slots": 5}),
            ("POST", "/requests/keep-me/abort", None),
        ):
            for headers in ({}, {"Authorization": "Bearer nope"}):
                answer = httpx.request(
                    method, f"{router.url}/admin{path}", headers=headers, json=body, timeout=10
                )
                assert answer.status_code == 401, (method, path, headers, answer.text)
                assert answer.json()["error"]["code"] == "unauthorized"
        after = node_states(router)
        assert after.keys() == states.keys() and "draining" not in after.values(), after
        assert {
            n["id"]: n["slots"] for n in admin(router, "GET", "/nodes").json()["nodes"]
        } == slots
        stream.join(60)
        assert stream.completed(), stream.events
    with RouterProcess([fleet.prefill[0].url], [fleet.decode[0].url]) as router:
        assert httpx.get(f"{router.url}/admin/nodes", headers=AUTH).status_code == 404


def test_admin_refuses_what_it_cannot_do_and_changes_nothing(fleet: SimFleet) -> None:
    with router_for(fleet) as router:
        states = node_states(router)
        serving = max(states)
        # Spellings Python's int() reads as that node's id, which name no node here.
        other_digits = quote("".join(chr(0x660 + int(digit)) for digit in str(serving)))
        for method, path in (
            ("POST", "/nodes/99/drain"),
            ("DELETE", "/nodes/99"),
            ("POST", "/nodes/one/drain"),
            ("DELETE", "/nodes/one"),
            ("POST", f"/nodes/0_{serving}/drain"),
            ("POST", f"/nodes/%20{serving}/drain"),
            ("POST", f"/nodes/{other_digits}/drain"),
            # More digits than int() reads (4,300): a ValueError, a 500, before.
            ("POST", f"/nodes/{'0' * 5000}{serving}/drain"),
            ("DELETE", f"/nodes/{'9' * 5000}"),
            ("POST", "/requests/nobody/abort"),
        ):
            answer = admin(router, method, path)
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "not_found"
        # Only force=true forces: a serving node is not removed.
        for query in ("", "?force=false", "?force=1"):
            refused = admin(router, "DELETE", f"/nodes/{serving}{query}")
            assert refused.status_code == 409, (query, refused.text)
            assert refused.json()["error"]["code"] == "not_drained"
        # A role or slots the fleet has no use for.
        for bad, param in [
            ({"role": "banana"}, "role"),
            ({"role": None}, "role"),
            ({"slots": 0}, "slots"),
            ({"slots": True}, "slots"),
            ({"slots": 1.5}, "slots"),
            ({"slots": "8"}, "slots"),
        ]:
            spec = {"url": "http://127.0.0.1:9", "role": "decode", **bad}
            answer = admin(router, "POST", "/nodes", json=spec)
            assert answer.status_code == 400, (bad, answer.text)
            assert answer.json()["error"]["param"] == param
        after = node_states(router)
        assert after.keys() == states.keys() and "draining" not in after.values(), after
        # The drain lands on the node named, and on no other.
        drained = admin(router, "POST", f"/nodes/{serving}/drain")
        assert drained.status_code == 202 and drained.json()["id"] == serving
        after = node_states(router)
        assert after.keys() == states.keys(), after
        assert [i for i, state in after.items() if state == "draining"] == [serving], after
        # Adding that engine again is no new node: 200, under its id, undrained.
        url = next(
            n["url"] for n in admin(router, "GET", "/nodes").json()["nodes"] if n["id"] == serving
        )
        again = admin(router, "POST", "/nodes", json={"url": url, "role": "decode"})
        assert again.status_code == 200 and again.json()["id"] == serving, again.text
        assert again.json()["state"] != "draining"
        assert node_states(router).keys() == states.keys()


def test_sigterm_lets_streams_finish_and_refuses_new_requests(fleet: SimFleet) -> None:
    router = router_for(fleet, "--decode-slots", "4", "--shutdown-timeout", "20")
    with router:
        streams = [Stream(router, f"finish {i}", 40, f"t{i}") for i in range(3)]
        for stream in streams:
            stream.start()
        wait_for(lambda: router.in_use() == 3, what="3 streams")
        assert router.pid is not None
        router._process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            complete(router, "x")
        for stream in streams:
            stream.join(30)
            assert stream.completed(), stream.events
            assert stream.text == echo(stream.prompt, 40)
        assert router.wait_exit(timeout=10) == 0, router.log()[-2000:]


def test_sigterm_ends_stragglers_with_one_error_each(fleet: SimFleet) -> None:
    router = router_for(fleet, "--decode-slots", "4", "--shutdown-timeout", "0.5")
    with router:
        streams = [Stream(router, f"long {i}", 400, f"u{i}") for i in range(2)]
        for stream in streams:
            stream.start()
        wait_for(lambda: all(s.events for s in streams), what="2 streams streaming")
        router._process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        for stream in streams:
            stream.join(15)
            assert [e["code"] for e in stream.errors] == ["shutting_down"]
            assert stream.events[-1] == "data: [DONE]"
        assert router.wait_exit(timeout=10) == 0, router.log()[-2000:]

"""Client keys (``--api-keys-file``), end to end: a real router through its CLI, simulated
engines, the openai SDK as the client, the file changed under the running router as
Kubernetes changes a mounted Secret."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pd_router.sim.fleet import SimFleet
from tests.helpers import RouterProcess, flush_state, wait_for
from tests.redis_server import RedisServer

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-fedcba9876543210"
CAROL = "sk-carol-limited-00000000"
DAVE = "sk-dave-added-later-0000"


def key_file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


KEYS = f"""\
# name key [max_in_flight=N]
alice   {ALICE}
bob     sha256:{hashlib.sha256(BOB.encode()).hexdigest()}   # only its digest is here
carol   {CAROL}  max_in_flight=1
"""


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    # Slow enough that a stream holds its key's place while the test looks.
    with SimFleet(1, 1, decode_args=["--itl", "0.05"]) as sims:
        yield sims


def router_for(fleet: SimFleet, keys: Path, *args: str) -> RouterProcess:
    return RouterProcess(
        [e.url for e in fleet.prefill],
        [e.url for e in fleet.decode],
        "--api-keys-file",
        str(keys),
        "--decode-slots",
        "8",
        *args,
    )


def client(router: RouterProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0)


def complete(router: RouterProcess, key: str, tokens: int = 2) -> str:
    answer = client(router, key).completions.create(
        model="sim-model", prompt="hello keys", max_tokens=tokens
    )
    return answer.choices[0].text


class Holder(threading.Thread):
    """A streamed completion that stays open until ``release`` is set."""

    def __init__(self, router: RouterProcess, key: str) -> None:
        super().__init__(daemon=True)
        self.router, self.key = router, key
        self.started = threading.Event()
        self.release = threading.Event()
        self.failure: Exception | None = None

    def run(self) -> None:
        try:
            stream = client(self.router, self.key).completions.create(
                model="sim-model", prompt="hold on", max_tokens=400, stream=True
            )
            for _ in stream:
                self.started.set()
                if self.release.is_set():
                    break
            stream.close()
        except Exception as exc:  # the test asserts there are none
            self.failure = exc
        finally:
            self.started.set()


def test_without_a_valid_key_every_v1_request_is_refused_before_anything(
    fleet: SimFleet, tmp_path: Path
) -> None:
    fleet.reset()
    with router_for(fleet, key_file(tmp_path / "keys", KEYS)) as router:
        digest = f"sha256:{hashlib.sha256(BOB.encode()).hexdigest()}"
        for key in ("sk-wrong", ALICE + "x", ALICE[:-1], digest):
            with pytest.raises(openai.AuthenticationError) as refused:
                complete(router, key)
            assert refused.value.status_code == 401
            assert refused.value.code == "invalid_api_key"
            assert refused.value.type == "invalid_request_error"
        # No header at all; another scheme; /v1/models; a /v1/ path that does not exist.
        assert httpx.post(f"{router.url}/v1/completions", json={}).status_code == 401
        basic = {"Authorization": f"Basic {ALICE}"}
        assert httpx.post(f"{router.url}/v1/completions", headers=basic, json={}).status_code == 401
        assert httpx.get(f"{router.url}/v1/models").status_code == 401
        missing = httpx.get(f"{router.url}/v1/nothing-here")
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        # Two Authorization headers, the valid key in either, on either kind of route:
        # refused alike (before, POST routes read the last, the others the first).
        for pair in ([f"Bearer {ALICE}", "Bearer sk-wrong"], [f"Bearer {ALICE}"] * 2):
            twice = [("authorization", value) for value in pair]
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                answer = httpx.request(method, f"{router.url}{path}", headers=twice, json={})
                assert answer.status_code == 401, (pair, path, answer.text)
                assert "more than one Authorization header" in answer.text
        # Probes and scrapers need no key.
        assert httpx.get(f"{router.url}/health").status_code == 200
        metrics = router.metrics()
        # Refused before a slot was taken, and no engine saw any of it.
        assert metrics["pd_router_slot_acquisitions_total"] == 0
        assert all(engine.stats()["requests"] == 0 for engine in fleet.engines)
        assert (
            metrics["pd_router_requests_total{endpoint=completions,key=,outcome=unauthorized}"] == 8
        )
        # The 401s at other /v1/ paths too (/v1/models, one that does not exist).
        assert metrics["pd_router_requests_total{endpoint=other,key=,outcome=unauthorized}"] == 4


def test_a_valid_key_is_served_and_named_never_shown(fleet: SimFleet, tmp_path: Path) -> None:
    fleet.reset()
    with router_for(fleet, key_file(tmp_path / "keys", KEYS)) as router:
        assert complete(router, ALICE) == " hello keys"
        assert complete(router, BOB)  # the file holds only its digest
        models = client(router, ALICE).models.list()
        assert [model.id for model in models.data] == ["sim-model"]
        metrics = router.metrics()
        assert metrics["pd_router_requests_total{endpoint=completions,key=alice,outcome=ok}"] == 1
        assert metrics["pd_router_requests_total{endpoint=completions,key=bob,outcome=ok}"] == 1
        wait_for(lambda: "key=bob " in router.log(), what="the request lines")
        log = router.log()
    assert "key=alice " in log
    for secret in (ALICE, BOB, CAROL):
        assert secret not in log


def test_a_key_past_its_max_in_flight_gets_429_and_nobody_else_is_affected(
    fleet: SimFleet, tmp_path: Path
) -> None:
    fleet.reset()
    with router_for(fleet, key_file(tmp_path / "keys", KEYS)) as router:
        holder = Holder(router, CAROL)
        holder.start()
        assert holder.started.wait(30)
        with pytest.raises(openai.RateLimitError) as limited:
            complete(router, CAROL)
        assert limited.value.code == "rate_limit_exceeded"
        assert "max_in_flight" in limited.value.message
        assert limited.value.response.headers["retry-after"] == "1"
        assert complete(router, ALICE)  # another key is not held back
        holder.release.set()
        holder.join(30)
        assert holder.failure is None
        # Its place is given back with the request.
        wait_for(lambda: _served(router, CAROL), timeout=20, what="carol served again")
        metrics = router.metrics()
        assert (
            metrics["pd_router_requests_total{endpoint=completions,key=carol,outcome=rate_limited}"]
            == 1
        )
        router.assert_idle()


def test_a_keys_place_is_given_back_however_its_request_ends(
    fleet: SimFleet, tmp_path: Path
) -> None:
    """carol may have one request in flight: after hers fails at the engine, or is refused
    for want of a slot, she is served again."""
    fleet.reset()
    decode = fleet.decode[0]
    with router_for(fleet, key_file(tmp_path / "keys", KEYS), "--decode-slots", "1") as router:
        decode.configure(fail_status=500, fail_message="engine exploded")
        try:
            with pytest.raises(openai.InternalServerError):
                complete(router, CAROL)
        finally:
            decode.configure(fail_status=None)
        wait_for(lambda: _served(router, CAROL), timeout=30, what="carol served after a 500")
        # alice holds the only slot: carol's request is refused for it, not for her key.
        holder = Holder(router, ALICE)
        holder.start()
        assert holder.started.wait(30)
        with pytest.raises(openai.RateLimitError) as busy:
            complete(router, CAROL)
        assert busy.value.code == "decode_nodes_busy"
        holder.release.set()
        holder.join(30)
        assert holder.failure is None
        wait_for(lambda: _served(router, CAROL), timeout=30, what="carol served after a 429")
        router.assert_idle()


def _served(router: RouterProcess, key: str) -> bool:
    try:
        complete(router, key)
    except openai.RateLimitError:
        return False
    return True


def _refused(router: RouterProcess, key: str) -> bool:
    try:
        complete(router, key)
    except openai.AuthenticationError:
        return True
    return False


def test_the_file_is_read_again_when_a_mounted_secret_changes(
    fleet: SimFleet, tmp_path: Path
) -> None:
    """Kubernetes mounts a Secret as ``keys -> ..data/keys``, ``..data -> ..2026_...`` and
    swaps ``..data`` in one rename: the path's own mtime never changes."""
    fleet.reset()
    mount = tmp_path / "secret"
    first = mount / "..v1"
    first.mkdir(parents=True)
    key_file(first / "keys", KEYS)
    (mount / "..data").symlink_to("..v1")
    (mount / "keys").symlink_to("..data/keys")
    with router_for(fleet, mount / "keys") as router:
        assert complete(router, ALICE)
        assert _refused(router, DAVE)
        second = mount / "..v2"
        second.mkdir()
        key_file(
            second / "keys",
            f"bob sha256:{hashlib.sha256(BOB.encode()).hexdigest()}\n" f"dave {DAVE}\n",
        )
        (mount / "..data_tmp").symlink_to("..v2")
        os.replace(mount / "..data_tmp", mount / "..data")
        wait_for(lambda: not _refused(router, DAVE), timeout=20, what="the new key accepted")
        assert _refused(router, ALICE)  # revoked, with no restart
        # A file that cannot be used keeps the last good keys, and says so once.
        third = mount / "..v3"
        third.mkdir()
        key_file(third / "keys", "dave\n")
        (mount / "..data_tmp").symlink_to("..v3")
        os.replace(mount / "..data_tmp", mount / "..data")
        wait_for(lambda: "keeping the last good keys" in router.log(), timeout=20, what="the error")
        time.sleep(2.5)  # two more looks at the unchanged bad file
        assert complete(router, DAVE)
        assert router.log().count("keeping the last good keys") == 1
        assert "line 1" in router.log()


def test_an_unusable_file_stops_the_router_at_start(fleet: SimFleet, tmp_path: Path) -> None:
    bad = key_file(tmp_path / "keys", f"alice {ALICE}\nbob {ALICE}\n")
    router = router_for(fleet, bad)
    router.start()
    try:
        assert router.wait_exit(30) == 2
        assert "line 2: key 'bob' is the same key as an earlier line's" in router.log()
        assert ALICE not in router.log()
    finally:
        router.stop()


@pytest.fixture(scope="module")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


def test_with_state_a_keys_limit_is_the_fleets_and_heals_when_a_router_dies(
    fleet: SimFleet, tmp_path: Path, redis_url: str
) -> None:
    flush_state(redis_url)
    fleet.reset()
    keys = key_file(tmp_path / "keys", KEYS)
    with (
        router_for(fleet, keys, "--state", redis_url) as first,
        router_for(fleet, keys, "--state", redis_url) as second,
    ):
        holder = Holder(first, CAROL)
        holder.start()
        assert holder.started.wait(30)
        # Held through the first router: the second refuses the same key.
        with pytest.raises(openai.RateLimitError):
            complete(second, CAROL)
        assert complete(second, ALICE)
        # The router holding it dies without a word: its count ends with its lease.
        first.kill()
        wait_for(lambda: _served(second, CAROL), timeout=30, what="the dead router's count gone")
        holder.join(30)


def test_a_request_refused_before_its_relay_is_logged_and_counted_under_its_key(
    fleet: SimFleet, tmp_path: Path
) -> None:
    """A keyed client's request refused for its body: its line and its count name the key
    (what an operator looks for when one client's requests are refused), never the key."""
    with router_for(fleet, key_file(tmp_path / "keys", KEYS)) as router:
        answer = httpx.post(
            f"{router.url}/v1/completions",
            content=b"{nope",
            headers={"Authorization": f"Bearer {ALICE}", "X-Request-Id": "refused-1"},
            timeout=30,
        )
        assert answer.status_code == 400
        wait_for(lambda: "request_id=refused-1 " in router.log(), what="the request's line")
        metrics = router.metrics()
        log = router.log()
    assert metrics["pd_router_requests_total{endpoint=completions,key=alice,outcome=bad_request}"]
    (line,) = (x for x in log.splitlines() if "request_id=refused-1 " in x)
    assert " key=alice " in line and "outcome=bad_request " in line
    assert ALICE not in log

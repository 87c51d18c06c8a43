"""The KV event path under attack, end to end: a real router process (``--prefill-policy
cost``) in front of simulated engines, its prefill node's events coming from a real ZMQ
publisher on 127.0.0.1 speaking vLLM 0.32's wire format: ``tests/kv_publisher.py``, a
process of its own, or the simulated engine's own (``--kv-events-port``). Whatever the
publisher does (floods, dies and comes back, stops answering, lies), the stream says so in
``/admin/nodes`` and the metrics, the router forgets what it can no longer know, and
requests are served meanwhile.

Each test waits for the state it is about (``WAIT``, which a stalled 2-core machine
meets) and runs well under 30 s.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from pd_router.engines.kvevents import MAX_MESSAGE, follow
from pd_router.fleet.holdings import KvView
from pd_router.fleet.kvevents import EventStreams
from pd_router.fleet.nodes import make_nodes
from pd_router.sim.fleet import EngineProcess, ServerProcess, SimFleet, free_port
from tests.dns_server import DnsServer
from tests.helpers import FAST_HEALTH, RouterProcess, wait_for
from tests.kv_publisher import PublisherProcess

TOKEN = "attack"
BLOCK = 16
ENGINE = ["--block-size", str(BLOCK)]
WAIT = 20.0
# A flood's batches: a scheduling step that stored 16,384 blocks (262,144 tokens, 1.3 MB
# of msgpack), far more than the router applies in the flood's time.
FLOOD_BLOCKS = 16384


def stream_of(router: RouterProcess) -> dict[str, Any]:
    answer = httpx.get(
        f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )
    node = next(node for node in answer.json()["nodes"] if node["role"] == "prefill")
    return node["kv_events"]  # type: ignore[no-any-return]


def state_metric(router: RouterProcess, url: str, state: str) -> float:
    key = f"pd_router_kv_event_stream{{node=0,state={state},url={url}}}"
    return router.metrics().get(key, 0.0)


def rss_mb(pid: int | None) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{index}" for index in range(count))


def assert_no_crash(router: RouterProcess) -> None:
    """Nothing escaped the subscriber task (``supervise`` would log it and start it again)."""
    assert "KV event subscribers failed" not in router.log(), router.log()[-3000:]
    assert "Traceback" not in router.log(), router.log()[-3000:]


class Requests:
    """Completions one after another in a thread, each with how long it took."""

    def __init__(self, router: RouterProcess) -> None:
        self.router = router
        self.stopping = threading.Event()
        self.took: list[float] = []
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        body = {"model": "sim-model", "prompt": words("q", 100), "max_tokens": 2}
        with httpx.Client(timeout=30) as client:
            while not self.stopping.is_set():
                start = time.monotonic()
                try:
                    answer = client.post(f"{self.router.url}/v1/completions", json=body)
                    self.statuses.append(answer.status_code)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                self.took.append(time.monotonic() - start)
                time.sleep(0.02)

    def __enter__(self) -> Requests:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopping.set()
        self.thread.join(40)


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    with SimFleet(1, 1, prefill_args=ENGINE, decode_args=ENGINE) as sims:
        yield sims


def router_for(fleet: SimFleet, port: int, *args: str) -> RouterProcess:
    return RouterProcess(
        [f"{fleet.prefill[0].url},kv_events={port}"],
        [fleet.decode[0].url],
        *("--prefill-policy", "cost", "--admin-token", TOKEN, *args),
    )


async def test_a_flood_keeps_the_event_loop_on_time(anyio_backend: str) -> None:
    """The subscribers as the router runs them (``follow``), in this process's event loop,
    whose lateness a ticker measures while a publisher floods: events take a bounded share
    of each tick and the rest waits (or is dropped: a gap). Before, the loop applied all a
    subscriber's inbox at once, and a flood held it for seconds."""
    port = free_port()
    with PublisherProcess(port) as publisher:
        nodes = make_nodes([f"http://127.0.0.1:1,kv_events={port}"], 1, role="prefill")
        streams = EventStreams(KvView())
        late: list[float] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow, nodes, streams)
            publisher.command("trickle 0.05")
            with anyio.fail_after(WAIT):
                while not streams.live(0):
                    await anyio.sleep(0.05)
            publisher.command(f"flood 5 {FLOOD_BLOCKS}")
            end = time.monotonic() + 5
            while time.monotonic() < end:
                start = time.monotonic()
                await anyio.sleep(0.01)
                late.append(time.monotonic() - start - 0.01)
            tg.cancel_scope.cancel()
    # A tick's budget (10 ms) and one message (~35 ms of work) late at most: 0.25-0.3 s
    # measured on a loaded machine (benchmarks/kv_events_flood.py), which adds its own
    # stalls. Before: 37-52 s.
    assert max(late) < 1.5, sorted(late)[-5:]
    assert streams.streams[0].faults.get("gap", 0) >= 1, "the flood was taken whole"


def test_a_flood_degrades_the_stream_and_requests_go_on(fleet: SimFleet) -> None:
    port = free_port()
    with PublisherProcess(port) as publisher, router_for(fleet, port) as router:
        url = fleet.prefill[0].url
        publisher.command("trickle 0.05")
        wait_for(lambda: stream_of(router)["state"] == "live", timeout=WAIT, what="live")
        before = rss_mb(router.pid)
        peak = before
        with Requests(router) as requests:
            # Until the trickle below: long enough for a stalled machine to see it.
            publisher.command(f"flood 25 {FLOOD_BLOCKS}")
            # The flood drops messages all along: the stream stays degraded (it is live
            # again only after a second in order), in the metric and /admin/nodes.
            wait_for(
                lambda: stream_of(router)["state"] == "degraded", timeout=WAIT, what="degraded"
            )
            assert state_metric(router, url, "degraded") == 1
            states = []
            end = time.monotonic() + 4
            while time.monotonic() < end:
                peak = max(peak, rss_mb(router.pid))
                states.append(stream_of(router)["state"])
                time.sleep(0.2)
            # (A stalled publisher, a second without a gap, is an end of the flood.)
            assert states.count("degraded") >= 0.75 * len(states), states
            faults = router.metrics()[
                f"pd_router_kv_event_faults_total{{kind=gap,node=0,url={url}}}"
            ]
            assert faults >= 1
            served = len(requests.statuses)
        assert served >= 3 and set(requests.statuses) == {200}, requests.statuses
        assert not requests.errors, requests.errors
        # Before, the loop applied the flood whole: /admin/nodes did not answer in 10 s.
        assert max(requests.took) < 2.5, sorted(requests.took)[-5:]
        # The inbox is bounded in bytes (16 MiB) and ZMQ's queue in messages.
        assert peak - before < 150, (before, peak)
        # The flood is over and messages come in order again: live.
        publisher.command("trickle 0.05")
        wait_for(lambda: stream_of(router)["state"] == "live", timeout=WAIT, what="live again")
        assert state_metric(router, url, "live") == 1
        assert_no_crash(router)
        router.assert_idle()


class Turns:
    """A conversation's turns as completions, with the router's log line of each."""

    def __init__(self, router: RouterProcess) -> None:
        self.router = router
        self.sdk = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)

    def send(self, prompt: str) -> tuple[int, dict[str, str]]:
        """The engine's cached tokens and the router's log line."""
        lines: list[str] = []
        before = -1

        def logged() -> bool:
            lines[:] = [ln for ln in self.router.log().splitlines() if "request_id=" in ln]
            return len(lines) > before

        # Every request's line counts (others' too, sent meanwhile): this one's is the next.
        logged()
        before = len(lines)
        answer = self.sdk.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None

        wait_for(logged, timeout=WAIT, what="the request's log line")
        cached = answer.usage.prompt_tokens_details.cached_tokens or 0
        return cached, dict(re.findall(r"(\w+)=(\S+)", lines[-1]))


def test_an_engine_restart_is_forgotten_and_followed_again() -> None:
    """The prefill engine is killed (its publisher with it) and started again on the same
    ports, with an empty cache: the stream is degraded while it is gone (no request waits
    on it), the router forgets what the engine held, and follows the new one's events.
    Before, a disconnect left the router's prediction as it was: the first turn after the
    restart was predicted cached where the engine had nothing."""
    events = free_port()
    args = [*ENGINE, "--kv-events-port", str(events)]
    with SimFleet(1, 1, prefill_args=args, decode_args=ENGINE) as fleet:
        engine = fleet.prefill[0]
        router = RouterProcess(
            [f"{engine.url},kv_events={events}"],
            [fleet.decode[0].url],
            *("--prefill-policy", "cost", "--admin-token", TOKEN, "--log-level", "info"),
            *FAST_HEALTH,
        )
        with router:
            turns = Turns(router)
            text = words("w", 400)
            # ZMQ subscribers join late: the first prompts may go unheard.
            deadline = time.monotonic() + WAIT
            while stream_of(router)["block_size"] != BLOCK or stream_of(router)["seq"] is None:
                assert time.monotonic() < deadline, stream_of(router)
                turns.send(text)
            text += " " + words("t1x", 20)
            cached, line = turns.send(text)
            assert int(line["predicted_cached"]) > 300 and cached >= 400, (cached, line)

            engine.kill()
            wait_for(
                lambda: stream_of(router)["faults"].get("disconnected", 0) >= 1,
                timeout=WAIT,
                what="the disconnect seen",
            )
            assert stream_of(router)["state"] == "degraded"
            assert stream_of(router)["indexed_blocks"] == 0
            # No request waits for the engine's events (nor for the engine: it is gone).
            start = time.monotonic()
            answer = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": "sim-model", "prompt": "meanwhile", "max_tokens": 2},
                timeout=30,
            )
            assert answer.status_code in (200, 502, 503) and time.monotonic() - start < 10

            serving = f"pd_router_node_state{{node=0,role=prefill,state=serving,url={engine.url}}}"
            with EngineProcess("prefill", args, port=engine.port):
                wait_for(
                    lambda: router.metrics().get(serving) == 1,
                    timeout=WAIT,
                    what="the engine serving again",
                )
                text += " " + words("t2x", 20)
                cached, line = turns.send(text)
                # The restarted engine holds nothing, and the router knows it.
                assert cached == 0 and line["predicted_cached"] == "0", (cached, line)
                # Its events are followed again: they start again from 0, live within a
                # second of order.
                wait_for(
                    lambda: stream_of(router)["state"] == "live", timeout=WAIT, what="live again"
                )
                text += " " + words("t3x", 20)
                cached, line = turns.send(text)
                assert cached > 400 and int(line["predicted_cached"]) > 400, (cached, line)
                assert_no_crash(router)


def test_a_publisher_that_stops_answering_degrades_the_stream(fleet: SimFleet) -> None:
    """A publisher alive but silent down to its ZMQ threads (SIGSTOP: a hung host, a
    network gone) answers no heartbeat: the stream is degraded within seconds and what the
    engine held is forgotten. Before, the router trusted its index forever. Once it
    answers and publishes in order again, the stream is live."""
    port = free_port()
    with PublisherProcess(port) as publisher, router_for(fleet, port) as router:
        publisher.command("trickle 0.1")
        wait_for(lambda: stream_of(router)["state"] == "live", timeout=WAIT, what="live")
        wait_for(lambda: stream_of(router)["indexed_blocks"] > 0, timeout=WAIT, what="blocks")
        publisher.pause()
        try:
            wait_for(
                lambda: stream_of(router)["state"] == "degraded", timeout=WAIT, what="degraded"
            )
            stream = stream_of(router)
            assert stream["faults"].get("disconnected", 0) >= 1, stream
            assert stream["indexed_blocks"] == 0, stream
            answer = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": "sim-model", "prompt": "meanwhile", "max_tokens": 2},
                timeout=30,
            )
            assert answer.status_code == 200
        finally:
            publisher.resume()
        wait_for(lambda: stream_of(router)["state"] == "live", timeout=WAIT, what="live again")
        assert_no_crash(router)


def stored(hashes: list[int], parent: int | None, ids: list[int], size: int = BLOCK) -> Any:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": ids,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def test_lying_events_raise_nothing_and_grow_nothing(fleet: SimFleet) -> None:
    """Events no engine sends, in order: nothing escapes the subscriber task, nothing the
    router keeps grows with them, and what an engine could not hold is not believed."""
    port = free_port()
    with PublisherProcess(port) as publisher, router_for(fleet, port) as router:
        # ZMQ subscribers join late: send until heard.
        deadline = time.monotonic() + WAIT
        while stream_of(router)["seq"] is None:
            assert time.monotonic() < deadline, "nothing heard"
            publisher.send([stored([1], None, list(range(BLOCK)))])
            time.sleep(0.1)
        wait_for(lambda: stream_of(router)["state"] == "live", timeout=WAIT, what="live")
        base = stream_of(router)["indexed_blocks"]
        lies: list[list[Any]] = [
            # A parent never stored: not keyed.
            [stored([1001, 1002], 999_999, list(range(2 * BLOCK)))],
            # Half a million token ids (2.4 MB) for one block: not keyed.
            [stored([1003], None, list(range(500_000)))],
            # Another tier's blocks (an offloading medium), another KV cache group.
            [{**stored([1004], None, list(range(BLOCK))), "medium": "CPU"}],
            [{**stored([1005], None, list(range(BLOCK))), "group_idx": 1}],
            # Removal of blocks never stored.
            [{"type": "BlockRemoved", "block_hashes": [5, 6, 7], "medium": "GPU"}],
            # No blocks; then a removal that teaches a cache size.
            [stored([], None, [])],
            [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}],
        ]
        for lie in lies:
            publisher.send(lie)
        last = publisher.send([stored([2000], None, list(range(BLOCK)))]) - 1
        wait_for(
            lambda: stream_of(router)["seq"] == last,
            timeout=WAIT,
            what=f"all heard: {stream_of(router)}",
        )
        stream = stream_of(router)
        # Each lie was read and left out (none is garbage): block 1 was removed, block 2000
        # stored, nothing else is in the index.
        assert stream["state"] == "live" and stream["indexed_blocks"] == base, stream
        assert stream["block_size"] == BLOCK and stream["faults"] == {}, stream
        assert stream["capacity_tokens"] < 1_000_000, stream
        # Block sizes no engine has: garbage, degraded. (An enormous one with no blocks
        # was taken as the engine's block size, and made the cache learned from the next
        # removal as large: see tests/fleet/test_kvevents.py.)
        for size in (-1, 0, 1 << 62):
            publisher.send([stored([], None, [], size)])
        wait_for(lambda: stream_of(router)["faults"].get("garbage", 0) >= 3, timeout=WAIT, what="3")
        # A message larger than any engine's: ZMQ drops the connection (a disconnect).
        publisher.command(f"huge {MAX_MESSAGE // 40}")
        wait_for(
            lambda: stream_of(router)["faults"].get("disconnected", 0) >= 1,
            timeout=WAIT,
            what="the huge message refused",
        )
        publisher.command("trickle 0.05")
        wait_for(
            lambda: stream_of(router)["state"] == "live",
            timeout=WAIT,
            what=f"live again {stream_of(router)}",
        )
        answer = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "sim-model", "prompt": "served", "max_tokens": 2},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        assert rss_mb(router.pid) < 300
        assert_no_crash(router)


class MovedEngine(EngineProcess):
    """A simulated prefill engine on another loopback address: the same pod, rescheduled
    (the same ports, another IP)."""

    def __init__(self, host: str, extra_args: list[str], port: int) -> None:
        super().__init__("prefill", [*extra_args, "--host", host], port=port)
        self.host = host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class DiscoveringRouter(RouterProcess):
    def __init__(self, *args: str) -> None:
        ServerProcess.__init__(self, list(args))

    def prefill_streams(self) -> dict[str, dict[str, Any] | None]:
        """The prefill nodes now, by URL: their event streams."""
        answer = httpx.get(
            f"{self.url}/admin/nodes", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )
        nodes = answer.json()["nodes"]
        return {n["url"]: n["kv_events"] for n in nodes if n["role"] == "prefill"}


def test_the_event_endpoint_follows_a_pod_found_through_dns() -> None:
    """``--prefill-dns NAME:PORT,kv_events=PORT``: the engine's pod moves to another address
    (its A record changes; the same ports): the router subscribes to the new address's
    events, drops the old subscription with the old node, and follows the new engine."""
    port, events = free_port(), free_port()
    args = [*ENGINE, "--kv-events-port", str(events)]
    first = MovedEngine("127.0.0.1", args, port)
    moved = MovedEngine("127.0.0.2", args, port)
    with DnsServer({"prefill.test.": {"A": ["127.0.0.1"]}}) as dns, first, moved:
        with SimFleet(0, 1, decode_args=ENGINE) as fleet:
            router = DiscoveringRouter(
                *("--prefill-dns", f"prefill.test:{port},kv_events={events}"),
                *("--decode", fleet.decode[0].url, "--dns-server", dns.address),
                *("--discovery-interval", "0.3", "--prefill-policy", "cost"),
                *("--admin-token", TOKEN, *FAST_HEALTH),
            )
            with router:
                sent = [0]

                def live_at(engine: EngineProcess) -> bool:
                    """Send a new prompt (the engine then publishes what it stored); True
                    once its node's stream is live."""
                    sent[0] += 1
                    prompt = words(f"p{sent[0]}x", 100)
                    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
                    answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
                    assert answer.status_code == 200, answer.text
                    stream = router.prefill_streams().get(engine.url)
                    return stream is not None and stream["state"] == "live"

                wait_for(lambda: live_at(first), timeout=WAIT, what="the first pod's events")
                assert router.prefill_streams()[first.url] is not None
                stream = router.prefill_streams()[first.url]
                assert stream is not None and stream["endpoint"] == f"tcp://127.0.0.1:{events}"

                dns.set({"prefill.test.": {"A": ["127.0.0.2"]}})
                wait_for(
                    lambda: set(router.prefill_streams()) == {moved.url},
                    timeout=WAIT,
                    what="the old pod's node gone, the new one's there",
                )
                first.stop()
                wait_for(lambda: live_at(moved), timeout=WAIT, what="the moved pod's events")
                stream = router.prefill_streams()[moved.url]
                assert stream is not None and stream["endpoint"] == f"tcp://127.0.0.2:{events}"
                assert stream["batches"] >= 1 and stream["faults"] == {}, stream
                assert_no_crash(router)

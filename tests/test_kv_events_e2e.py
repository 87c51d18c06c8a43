"""What an engine's KV events tell a router, end to end: two real router processes
(``--prefill-policy cost``, no ``--state``) in front of a simulated prefill engine that
publishes vLLM's KV events, the ``openai`` SDK as the client. The router's predicted cached
tokens (its log line) follow what the engine says it holds: an eviction caused by the other
router's prompts, and the other router's turn after a reset, neither of which this router's
own prediction can see."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import openai

from pd_router.sim.fleet import SimFleet, free_port
from tests.helpers import RouterProcess

TOKEN = "events"
BLOCK = 4
# The engine's cache: 150 blocks of 4 tokens, 600 words.
CACHE_BLOCKS = 150


def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{index}" for index in range(count))


def stream_of(router: RouterProcess) -> dict[str, Any]:
    answer = httpx.get(
        f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )
    node = next(node for node in answer.json()["nodes"] if node["role"] == "prefill")
    return node["kv_events"]  # type: ignore[no-any-return]


def lines(router: RouterProcess) -> list[str]:
    return [line for line in router.log().splitlines() if "request_id=" in line]


class Client:
    def __init__(self, router: RouterProcess) -> None:
        self.router = router
        self.sdk = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)

    def send(self, prompt: str) -> tuple[int, int, dict[str, str]]:
        """The prompt's tokens and the engine's cached tokens, and the router's log line."""
        # Every request's line counts, whoever sent it: this one's is the next.
        before = len(lines(self.router))
        answer = self.sdk.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
        usage = answer.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        # The request's log line is written as its answer ends: soon after the client has it.
        deadline = time.monotonic() + 30
        while len(logged := lines(self.router)) <= before:
            assert time.monotonic() < deadline, "no log line"
            time.sleep(0.02)
        return usage.prompt_tokens, cached, dict(re.findall(r"(\w+)=(\S+)", logged[-1]))

    def until_live(self) -> None:
        """ZMQ subscribers join late: send unrelated prompts until this router has heard
        the engine store blocks (it then knows the block size, and can learn prompts)."""
        deadline = time.monotonic() + 30
        count = 0
        while (
            stream_of(self.router)["block_size"] != BLOCK
            or stream_of(self.router)["state"] != "live"
        ):
            assert time.monotonic() < deadline, stream_of(self.router)
            self.send(words(f"warm{id(self)}x{count}y", 8))
            count += 1
            time.sleep(0.2)


def test_a_routers_view_follows_an_eviction_and_another_routers_placement() -> None:
    port = free_port()
    prefill_args = [
        *("--block-size", str(BLOCK), "--prefix-cache-blocks", str(CACHE_BLOCKS)),
        *("--kv-events-port", str(port)),
    ]
    with SimFleet(1, 1, prefill_args=prefill_args, decode_args=["--block-size", "4"]) as fleet:
        engine = fleet.prefill[0]
        nodes = [f"{engine.url},kv_events={port}"], [fleet.decode[0].url]
        args = ["--prefill-policy", "cost", "--admin-token", TOKEN, "--log-level", "info"]
        with RouterProcess(*nodes, *args) as a_router, RouterProcess(*nodes, *args) as b_router:
            a, b = Client(a_router), Client(b_router)
            a.until_live()
            b.until_live()

            def settle() -> None:
                # Both routers have applied every batch the engine published so far.
                last = engine.stats()["kv_event_batches"] - 1
                deadline = time.monotonic() + 30
                while any(stream_of(r)["seq"] != last for r in (a_router, b_router)):
                    assert time.monotonic() < deadline, "events not heard"
                    time.sleep(0.05)

            text = words("s", 200)
            a.send(text)  # router A learns the turn's tokens from the answer
            settle()
            text += " " + words("t1x", 30)
            _, cached, line = a.send(text)
            assert line["cache_source"] == "events"
            assert int(line["predicted_cached"]) == cached == 200
            settle()

            # Router B's prompts evict the conversation from the engine's cache (150 blocks).
            for index in range(3):
                b.send(words(f"other{index}x", 200))
            settle()
            text += " " + words("t2x", 30)
            tokens, cached, line = a.send(text)
            # A's own placements say the engine holds 230 tokens of this; its events say what
            # the engine reports.
            assert line["cache_source"] == "events"
            assert int(line["predicted_cached"]) == cached < 200
            settle()

            # The engine is reset (AllBlocksCleared: A forgets all it predicted there), then
            # router B sends the conversation's next turn.
            engine.reset()
            settle()
            assert stream_of(a_router)["clears"] == 1
            text += " " + words("t3x", 30)
            b.send(text)
            settle()
            text += " " + words("t4x", 30)
            _, cached, line = a.send(text)
            # A knows the tokens of the turn it sent last (`tokens`), and the engine holds them
            # again: B placed them, which A's own placements cannot tell.
            assert line["cache_source"] == "events"
            assert int(line["predicted_cached"]) == tokens // BLOCK * BLOCK > 0
            assert cached >= int(line["predicted_cached"])
            a_router.assert_idle()
            b_router.assert_idle()

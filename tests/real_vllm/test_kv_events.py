"""The router's view of what a real vLLM prefill engine holds, from its KV cache events.

The pair's prefill engine publishes its KV events (``conftest.py``); a router given
``kv_events=PORT`` for it, ``--prefill-policy cost``, serves chat conversations. From a
conversation's second turn on, the router reads what the engine holds from its events (it
learned the earlier turn's token ids from the prefill answer): its ``predicted_cached``
(the request log line) must be what the engine then reports as ``cached_tokens``, and after
``/reset_prefix_cache`` (``AllBlocksCleared``) it must say 0, as the engine does.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import RouterProcess
from tests.real_vllm.conftest import BLOCK_SIZE, ENGINE_API_KEY, prompt
from tests.real_vllm.engines import VllmPair
from tests.real_vllm.test_real_vllm import (
    ADMIN_TOKEN,
    ATTEMPTS,
    MODEL,
    REPLY_TOKENS,
    SETTLE,
    client_for,
    router_for,
    warm_handshake,
)

pytestmark = pytest.mark.real_vllm

TURNS = 3
# A turn's text is at least one 256-byte chunk of the router's (what it links tokens to),
# and three turns fit the engines' 512 tokens with a last one sent again.
TURN_WORDS = 34


def stream_of(router: RouterProcess) -> dict[str, Any]:
    answer = httpx.get(
        f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    )
    node = next(node for node in answer.json()["nodes"] if node["role"] == "prefill")
    return node["kv_events"]  # type: ignore[no-any-return]


def request_lines(router: RouterProcess) -> list[dict[str, str]]:
    lines = [line for line in router.log().splitlines() if "request_id=" in line]
    return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines]


class Conversation:
    """Chat turns through the router: each the conversation so far plus a user message."""

    def __init__(self, router: RouterProcess, tag: str) -> None:
        self.router = router
        self.client: openai.OpenAI = client_for(router.url)
        self.tag = tag
        self.messages: list[dict[str, str]] = []

    def turn(self, again: bool = False) -> tuple[int, dict[str, str]]:
        """The engine's ``cached_tokens`` for the next turn (``again``: the last one once
        more), and the router's log line."""
        if again:
            self.messages.pop()
        else:
            text = prompt(f"{self.tag}-turn{len(self.messages)}", words=TURN_WORDS)
            self.messages.append({"role": "user", "content": text})
        # Lines of every conversation through the router (the warm-ups' too): this turn's
        # is the next one.
        before = len(request_lines(self.router))
        response = self.client.chat.completions.create(
            model=MODEL,
            messages=self.messages,  # type: ignore[arg-type]
            max_tokens=REPLY_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        details = response.usage.prompt_tokens_details if response.usage else None
        assert details is not None and details.cached_tokens is not None, response.usage
        reply = response.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": reply})
        # The log line is written as the answer ends, just after the client has it.
        deadline = time.monotonic() + SETTLE
        while len(lines := request_lines(self.router)) <= before:
            assert time.monotonic() < deadline, "no log line for the request"
            time.sleep(0.05)
        return details.cached_tokens, lines[-1]


def until(check: Any, what: str) -> None:
    deadline = time.monotonic() + SETTLE
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def reset_prefix_cache(url: str) -> None:
    """vLLM refuses (``success: false``) while blocks are held, as the last prefill's are
    until the decode engine has pulled them: tried until it succeeds."""

    def reset() -> bool:
        request = urllib.request.Request(
            f"{url}/reset_prefix_cache",
            data=b"",
            method="POST",
            headers={"Authorization": f"Bearer {ENGINE_API_KEY}"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:  # nosec B310
            return bool(json.loads(answer.read())["success"])

    until(reset, "the prefix cache reset")


def test_the_routers_view_is_what_the_engine_reports_cached_and_follows_a_reset(
    vllm_pair: VllmPair,
) -> None:
    assert vllm_pair.prefill is not None and vllm_pair.prefill.kv_events_port is not None
    url = vllm_pair.prefill_url
    warm_handshake(url, vllm_pair.decode_url)
    node = f"{url},kv_events={vllm_pair.prefill.kv_events_port}"
    args = ("--prefill-policy", "cost", "--log-level", "info")
    with router_for(vllm_pair, [node], *args, log_name="router-kv-events.log") as router:
        for attempt in range(1, ATTEMPTS + 1):
            seen = follow_a_conversation(router, url)
            if seen is not None:
                break
            # A fault during the conversation (in CI: a disconnect, the subscriber's 3 s
            # heartbeat timing out in a 2-minute stall of the whole machine) rightly empties
            # the router's view: its word is the prediction's until it hears the blocks again.
            print(f"attempt {attempt}: the stream faulted: {stream_of(router)['last_fault']}")
        else:
            pytest.fail(f"the KV event stream faulted in each of {ATTEMPTS} conversations")
        print(f"\n(engine cached_tokens, router predicted_cached, router's source) by turn: {seen}")
        turns = seen[1:TURNS]
        assert all(
            source == "events" and predicted == cached > 0 for cached, predicted, source in turns
        ), seen
        # After the reset: the engine found nothing, and the router said so from its events.
        assert seen[-1] == (0, 0, "events"), seen
        router.assert_idle()


def follow_a_conversation(router: RouterProcess, engine: str) -> list[tuple[int, int, str]] | None:
    """A conversation's turns, a reset of the engine's prefix cache, and its last turn once
    more, through ``router`` to the prefill engine at ``engine``: each turn's
    ``cached_tokens`` by the engine, and the router's prediction and its source. None if
    the router's event stream faulted meanwhile."""
    tag = os.urandom(3).hex()
    # ZMQ subscribers join late: warm up with conversations of their own until the
    # router has heard the engine store blocks (then it knows their size, 32 here).
    warm = 0
    while stream_of(router)["block_size"] != BLOCK_SIZE or stream_of(router)["state"] != "live":
        assert warm < 20, stream_of(router)
        Conversation(router, f"warm-{tag}-{warm}").turn()
        warm += 1
        time.sleep(0.5)

    faults = sum(stream_of(router)["faults"].values())
    conversation = Conversation(router, f"events-{tag}")
    seen: list[tuple[int, int, str]] = []
    for _ in range(TURNS):
        batches = stream_of(router)["seq"]
        cached, line = conversation.turn()
        seen.append((cached, int(line["predicted_cached"]), line["cache_source"]))
        # The engine publishes the turn's blocks as it computes it: heard before the next.
        until(lambda: stream_of(router)["seq"] != batches, "the turn's events")

    reset_prefix_cache(engine)
    # vLLM publishes what a step did at its end, a reset's AllBlocksCleared with the next
    # step's events: another conversation makes the idle engine step.
    clears = stream_of(router)["clears"]
    Conversation(router, f"after-reset-{tag}").turn()
    until(lambda: stream_of(router)["clears"] > clears, "AllBlocksCleared heard")
    cached, line = conversation.turn(again=True)
    seen.append((cached, int(line["predicted_cached"]), line["cache_source"]))
    return seen if sum(stream_of(router)["faults"].values()) == faults else None

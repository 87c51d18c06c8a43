"""Two router processes with ``--prefill-policy cost`` sharing one Redis (``--state``): a
conversation whose turns alternate between them is prefilled where its last turn was."""

from __future__ import annotations

import time
from contextlib import ExitStack

import openai

from pd_router.sim.fleet import SimFleet
from tests.helpers import RouterProcess, flush_state
from tests.redis_server import RedisServer

ENGINE = ["--block-size", "4"]


def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{index}" for index in range(count))


def test_turns_alternating_between_routers_find_their_conversation_cached(
    redis_server: RedisServer,
) -> None:
    flush_state(redis_server.url)
    with SimFleet(4, 1, prefill_args=ENGINE, decode_args=ENGINE) as fleet, ExitStack() as stack:
        prefill = [engine.url for engine in fleet.prefill]
        decode = [engine.url for engine in fleet.decode]
        args = ["--prefill-policy", "cost", "--state", redis_server.url, "--decode-slots", "4"]
        routers = [stack.enter_context(RouterProcess(prefill, decode, *args)) for _ in range(2)]
        clients = [
            openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
            for router in routers
        ]
        system = {"role": "system", "content": words("s", 200)}
        # Only the second router has seen the system prompt (and so knows where it is
        # held): without sharing, the routers' pictures of the fleet differ from here on.
        for index in range(8):
            clients[1].chat.completions.create(
                model="sim-model",
                messages=[system, {"role": "user", "content": f"warm up {index}"}],
                max_tokens=2,
            )
        time.sleep(0.5)
        missed = []
        for conversation in range(8):
            messages = [system]
            computed = 0
            for turn in range(4):
                # A user reads the answer before the next turn: longer than the routers
                # take to share where the last one went.
                time.sleep(0.05)
                messages.append({"role": "user", "content": words(f"c{conversation}t{turn}x", 80)})
                answer = clients[turn % 2].chat.completions.create(
                    model="sim-model", messages=messages, max_tokens=4  # type: ignore[arg-type]
                )
                usage = answer.usage
                assert usage is not None and usage.prompt_tokens_details is not None
                cached = usage.prompt_tokens_details.cached_tokens or 0
                if turn and cached < computed - 4:
                    missed.append((conversation, turn, cached, computed))
                computed = usage.prompt_tokens
                messages.append(
                    {"role": "assistant", "content": answer.choices[0].message.content or ""}
                )
        # Every turn went to the engine holding the turn before, whichever router took it.
        assert not missed
        assert {engine.stats()["requests"] > 0 for engine in fleet.prefill} == {True}

"""Multi-turn chat conversations sharing a system prompt: each turn repeats the conversation
so far (its last answer included) and adds a user message, as chat clients do; what a
prefix-caching prefill fleet is for.

Run through ``converse``: every conversation at once, each one turn after another, turn t
through ``routers[t % len(routers)]``; a ``Run`` collects prompt and cached tokens from
the answers' usage, TTFTs and errors.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from benchmarks.workloads.requests import MODEL
from benchmarks.workloads.shapes import Run, stream


@dataclass
class Workload:
    conversations: int
    turns: int
    system_words: int
    user_words: int
    answer_tokens: int
    # The most a user thinks between turns: conversations do not move in lockstep, which
    # would let round robin send a conversation to the same node by accident.
    think: float = 0.1
    seed: int = 1

    def system(self) -> str:
        rng = random.Random(self.seed)
        return " ".join(f"s{rng.randrange(10**6)}" for _ in range(self.system_words))

    def user(self, conversation: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}-{conversation}-{turn}")
        return " ".join(f"u{rng.randrange(10**6)}" for _ in range(self.user_words))


async def turn(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], run: Run, answer: int
) -> str | None:
    """One streamed chat turn; the answer's text, or None if it failed."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": answer,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    got = await stream(session, url + "/v1/chat/completions", body, run)
    if got is None:
        return None
    if got.usage is None:
        run.failures["an answer with no usage"] += 1
        return None
    run.ttfts.append(got.ttft)
    run.prompt_tokens += got.usage["prompt_tokens"]
    run.cached_tokens += got.usage["prompt_tokens_details"]["cached_tokens"]
    return got.text


async def converse(routers: Sequence[str], workload: Workload, run: Run) -> None:
    system = workload.system()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    ) as session:

        async def conversation(index: int) -> None:
            messages = [{"role": "system", "content": system}]
            rng = random.Random(f"{workload.seed}-think-{index}")
            for number in range(workload.turns):
                await asyncio.sleep(rng.uniform(0, workload.think))
                messages.append({"role": "user", "content": workload.user(index, number)})
                router = routers[number % len(routers)]
                answer = await turn(session, router, messages, run, workload.answer_tokens)
                if answer is None:
                    return
                messages.append({"role": "assistant", "content": answer})

        started = time.perf_counter()
        await asyncio.gather(*(conversation(index) for index in range(workload.conversations)))
        run.seconds = time.perf_counter() - started

"""Multi-turn chat conversations sharing a system prompt: each turn repeats the conversation
so far (its last answer included) and adds a user message, as chat clients do; what a
prefix-caching prefill fleet is for.

Run through ``converse``: every conversation at once, each one turn after another, turn t
through ``routers[t % len(routers)]``; a ``Run`` collects prompt and cached tokens from
the answers' usage, TTFTs and errors.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.report import percentile
from benchmarks.workloads.requests import MODEL


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


@dataclass
class Run:
    name: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    prefills: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    def ttft(self, q: float) -> float:
        """TTFT percentile ``q`` (0-100), seconds; NaN if no turn succeeded."""
        return percentile(self.ttfts, q) if self.ttfts else float("nan")


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
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            run.errors += 1
            await response.read()
            return None
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", ()):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
    if first is None or usage is None:
        run.errors += 1
        return None
    run.ttfts.append(first - started)
    run.prompt_tokens += usage["prompt_tokens"]
    run.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    return "".join(text)


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

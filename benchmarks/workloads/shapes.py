"""Four shapes of traffic a prefix-caching prefill fleet serves, as sessions of streamed
requests: each step's prompt repeats what came before (its answers included), as clients do.

* ``chat``: conversations sharing one system prompt, through /v1/chat/completions;
* ``completions``: the same conversations as one growing /v1/completions prompt behind a
  shared opening far longer than any fixed cut (an agent's instructions, 2,000+ characters);
* ``rag``: one question each over one of a few long documents, the documents skewed
  (the first is asked about most);
* ``agent``: a loop of steps behind a shared preamble (tool definitions): each step adds a
  tool's output and the model's answer, so the transcript grows;
* ``short``: single short questions, where a prefill engine's round trip costs more than
  the decode engine computing the prompt itself (``--max-local-prefill``).

``play`` runs the sessions through routers with ``clients`` sessions at a time, step t of
a session through ``routers[t % len(routers)]``, and collects TTFTs and errors in a ``Run``.
Words are the simulated engines' tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.report import percentile
from benchmarks.workloads.requests import MODEL


def words(tag: str, count: int, seed: object) -> str:
    rng = random.Random(f"{tag}-{seed}")
    return " ".join(f"{tag}{rng.randrange(10**6)}" for _ in range(count))


@dataclass
class Session:
    """One client's sequence of requests; ``step(t, answers)`` is step t's (path, body)."""

    steps: int
    step: Callable[[int, list[str]], tuple[str, dict[str, Any]]]


@dataclass
class Shape:
    name: str
    sessions: list[Session]
    answer_tokens: int


def chat(
    conversations: int = 32, turns: int = 4, system: int = 300, user: int = 40, variant: int = 0
) -> Shape:
    prompt = words("s", system, ("chat", variant))

    def session(index: int) -> Session:
        def step(turn: int, answers: list[str]) -> tuple[str, dict[str, Any]]:
            messages = [{"role": "system", "content": prompt}]
            for earlier in range(turn):
                messages.append(
                    {"role": "user", "content": words("u", user, (index, earlier, variant))}
                )
                messages.append({"role": "assistant", "content": answers[earlier]})
            messages.append({"role": "user", "content": words("u", user, (index, turn, variant))})
            return "/v1/chat/completions", {"messages": messages}

        return Session(turns, step)

    return Shape("chat", [session(index) for index in range(conversations)], 40)


def completions(
    conversations: int = 32, turns: int = 4, opening: int = 400, user: int = 40, variant: int = 0
) -> Shape:
    shared = words("o", opening, ("completions", variant))

    def session(index: int) -> Session:
        def step(turn: int, answers: list[str]) -> tuple[str, dict[str, Any]]:
            text = shared
            for earlier in range(turn):
                asked = words("u", user, (index, earlier, variant))
                text += f" User: {asked} Assistant:{answers[earlier]}"
            text += f" User: {words('u', user, (index, turn, variant))} Assistant:"
            return "/v1/completions", {"prompt": text}

        return Session(turns, step)

    return Shape("completions", [session(index) for index in range(conversations)], 40)


def rag(
    questions: int = 64,
    documents: int = 4,
    length: int = 1000,
    question: int = 30,
    variant: int = 0,
) -> Shape:
    texts = [words("d", length, ("doc", number, variant)) for number in range(documents)]
    rng = random.Random("rag")
    # Skewed: document k is asked about half as often as document k-1.
    weights = [2.0**-number for number in range(documents)]
    picks = rng.choices(range(documents), weights, k=questions)

    def session(index: int) -> Session:
        def step(turn: int, answers: list[str]) -> tuple[str, dict[str, Any]]:
            messages = [
                {"role": "system", "content": texts[picks[index]]},
                {"role": "user", "content": words("q", question, (index, variant))},
            ]
            return "/v1/chat/completions", {"messages": messages}

        return Session(1, step)

    return Shape("rag", [session(index) for index in range(questions)], 40)


def agent(
    loops: int = 16, steps: int = 6, preamble: int = 500, output: int = 60, variant: int = 0
) -> Shape:
    tools = words("t", preamble, ("agent", variant))

    def session(index: int) -> Session:
        def step(turn: int, answers: list[str]) -> tuple[str, dict[str, Any]]:
            messages = [
                {"role": "system", "content": tools},
                {"role": "user", "content": words("g", 20, (index, variant))},
            ]
            for earlier in range(turn):
                messages.append({"role": "assistant", "content": answers[earlier]})
                messages.append(
                    {"role": "user", "content": words("r", output, (index, earlier, variant))}
                )
            return "/v1/chat/completions", {"messages": messages}

        return Session(steps, step)

    return Shape("agent", [session(index) for index in range(loops)], 30)


def short(questions: int = 64, system: int = 30, question: int = 20, variant: int = 0) -> Shape:
    """Single short questions behind a short system prompt: what a local prefill is for."""
    prompt = words("s", system, ("short", variant))

    def session(index: int) -> Session:
        def step(turn: int, answers: list[str]) -> tuple[str, dict[str, Any]]:
            messages = [
                {"role": "system", "content": prompt},
                {"role": "user", "content": words("q", question, (index, variant))},
            ]
            return "/v1/chat/completions", {"messages": messages}

        return Session(1, step)

    return Shape("short", [session(index) for index in range(questions)], 20)


# Each shape by name; ``variant`` gives the same shape with other words (another round of
# a benchmark: prompts no engine or router has seen).
SHAPES: dict[str, Callable[..., Shape]] = {
    "chat": chat,
    "completions": completions,
    "rag": rag,
    "agent": agent,
    "short": short,
}


@dataclass
class Run:
    name: str
    ttfts: list[float] = field(default_factory=list)
    # What each failed request got: its status and the start of the router's error body,
    # or what its stream lacked.
    failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    # Filled in by the caller: from the engines' counters, or the answers' usage.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefills: list[int] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(self.failures.values())

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    def ttft(self, q: float) -> float:
        """TTFT percentile ``q`` (0-100), seconds; NaN if no request succeeded."""
        return percentile(self.ttfts, q) if self.ttfts else float("nan")


@dataclass
class Answer:
    text: str
    ttft: float
    usage: dict[str, Any] | None  # the last event's, where the request asked for it


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], run: Run
) -> Answer | None:
    """One streamed request, chat or completions; None (counted in ``run.errors``) if it
    failed or sent no text."""
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    async with session.post(url, json=body) as response:
        if response.status != 200:
            body = await response.read()
            run.failures[f"HTTP {response.status}: {body[:120].decode(errors='replace')}"] += 1
            return None
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", ()):
                piece = choice.get("text") or choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    if first is None:
        run.failures["a stream with no text"] += 1
        return None
    return Answer("".join(text), first - started, usage)


async def play(routers: Sequence[str], shape: Shape, run: Run, clients: int = 8) -> None:
    gate = asyncio.Semaphore(clients)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    ) as http:

        async def one(number: int, session: Session) -> None:
            rng = random.Random(f"think-{number}")
            async with gate:
                answers: list[str] = []
                for step in range(session.steps):
                    # Sessions do not move in lockstep (round robin would find a
                    # conversation's node by accident).
                    await asyncio.sleep(rng.uniform(0, 0.05))
                    path, body = session.step(step, answers)
                    body = {
                        **body,
                        "model": MODEL,
                        "max_tokens": shape.answer_tokens,
                        "stream": True,
                    }
                    url = routers[step % len(routers)] + path
                    answer = await stream(http, url, body, run)
                    if answer is None:
                        return
                    run.ttfts.append(answer.ttft)
                    answers.append(answer.text)

        started = time.perf_counter()
        await asyncio.gather(*(one(n, s) for n, s in enumerate(shape.sessions)))
        run.seconds = time.perf_counter() - started

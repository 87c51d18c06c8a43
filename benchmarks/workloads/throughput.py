"""Workload A, throughput: streams from many concurrent clients over some URLs."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.workloads.requests import (
    FILLER,
    PATH,
    completion_body,
    new_session,
    stream_completion,
)


@dataclass
class ThroughputRun:
    mode: str
    round: int
    requests: int
    ok: int
    errors: dict[str, int]
    chunks: int
    seconds: float
    requests_per_s: float
    chunks_per_s: float
    capped: bool
    cpu_ms: dict[str, float]
    cpu_ms_per_request: dict[str, float]
    machine_busy_pct: float
    other_busy_pct: float


async def throughput(
    urls: Sequence[str],
    *,
    requests: int,
    concurrency: int,
    tokens: int,
    time_cap: float,
    tag: str,
    ttfts: list[float] | None = None,
) -> tuple[int, int, Counter[str], float, bool]:
    """``requests`` streams from ``concurrency`` clients, round-robin over ``urls``.

    Returns (sent, chunks, outcomes, seconds, capped). No new request starts after
    ``time_cap`` seconds; requests already in flight finish. ``ttfts``, if given, gets each
    answered request's time to its first event with text, in seconds.
    """
    counter = itertools.count()
    outcomes: Counter[str] = Counter()
    chunks = 0
    capped = False
    want_ttft = ttfts is not None
    async with new_session() as session:
        start = time.perf_counter()
        deadline = start + time_cap

        async def client() -> None:
            nonlocal chunks, capped
            while True:
                i = next(counter)
                if i >= requests:
                    return
                if time.perf_counter() > deadline:
                    capped = True
                    return
                url = urls[i % len(urls)] + PATH
                body = completion_body(f"{tag}-{i} {FILLER}", tokens)
                result = await stream_completion(session, url, body, want_ttft=want_ttft)
                chunks += result.chunks
                if ttfts is not None and result.ok and result.ttft is not None:
                    ttfts.append(result.ttft)
                outcomes["ok" if result.ok else result.error] += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return sum(outcomes.values()), chunks, outcomes, seconds, capped

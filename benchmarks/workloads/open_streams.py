"""Workload D, open streams: N streams open at once through one router, and its memory."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from benchmarks.processes import cpu_ms, proc_status
from benchmarks.workloads.requests import (
    FILLER,
    PATH,
    completion_body,
    has_text,
    new_session,
    stream_completion,
)

STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)


@dataclass
class StreamsRun:
    """Workload D through one router: N streams open at once, and its memory meanwhile."""

    router: str
    streams: int
    ok: int
    errors: dict[str, int]
    # Streams that had their first text event and no end yet when ``rss_open_kib`` was read.
    held_at_peak: int
    all_open: bool
    ramp_seconds: float  # first stream sent -> every stream had its first text event
    release_seconds: float  # engines back to --itl -> every stream ended
    seconds: float  # first stream sent -> every stream ended
    capped: bool
    tokens: int
    release_tokens_per_s: float  # tokens received per second after the release
    asked_tokens_per_s: float  # streams / itl: what the engines were asked for
    rss_before_kib: int
    rss_open_kib: int
    rss_max_kib: int
    rss_after_kib: int
    kib_per_stream: float
    threads_before: int
    threads_open: int
    router_cpu_ms: float
    router_cpu_ms_per_stream: float
    warmup_errors: dict[str, int]


class _OpenStreams:
    """Counters the streams of workload D update as they go."""

    def __init__(self) -> None:
        self.opened = 0  # first text event seen
        self.closed = 0  # ended, after its first text event
        self.failed_early = 0  # ended before any text event
        self.tokens = 0


async def held_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], state: _OpenStreams
) -> str:
    """One stream of workload D: "ok", or what went wrong (as in ``stream_completion``)."""
    opened = False

    def on_event(line: bytes) -> None:
        nonlocal opened
        state.tokens += 1
        if not opened and has_text(line):
            opened = True
            state.opened += 1

    try:
        result = await stream_completion(
            session, url, body, timeout=STREAM_TIMEOUT, on_event=on_event
        )
    finally:
        if opened:
            state.closed += 1
        else:
            state.failed_early += 1
    return "ok" if result.ok else result.error


async def hold_streams(
    name: str,
    url: str,
    pid: int,
    set_itl: Callable[[float], None],
    *,
    streams: int,
    tokens: int,
    itl: float,
    hold_itl: float,
    batch: int,
    cap: float,
    warmup: int,
) -> StreamsRun:
    """Open ``streams`` streams through one router, ``batch`` at a time, and read its RSS.

    ``warmup`` short requests first, through a session closed since; then the router's RSS
    ("before"). While the streams open, the decode engines run at ``hold_itl`` between
    tokens (``set_itl``: POST /sim/config), so that the first streams are still open when
    the last ones start. A batch starts once every stream of the one before had its first
    text event, so the router's listen backlog never holds more than ``batch`` connections.
    When every stream has had one, RSS again ("open"); then the engines go back to ``itl``
    (the release) and every stream runs to its end. Nothing outlives ``cap`` seconds.
    """
    url = url + PATH
    warm: Counter[str] = Counter()
    async with new_session() as session:
        bodies = [completion_body(f"d-warm-{name}-{i} {FILLER}", 4) for i in range(warmup)]
        for first in range(0, warmup, 16):
            results = await asyncio.gather(
                *(stream_completion(session, url, body) for body in bodies[first : first + 16])
            )
            warm.update("ok" if result.ok else result.error for result in results)
    warm.pop("ok", None)
    await asyncio.sleep(0.5)
    rss_before = proc_status(pid, "VmRSS")
    threads_before = proc_status(pid, "Threads")
    cpu_before = cpu_ms(pid)
    state = _OpenStreams()
    peak = [rss_before]

    async def sample_rss() -> None:
        while True:
            peak[0] = max(peak[0], proc_status(pid, "VmRSS"))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample_rss())
    tasks: list[asyncio.Task[str]] = []
    capped = False
    try:
        await asyncio.to_thread(set_itl, hold_itl)
        async with new_session() as session:
            start = time.perf_counter()
            deadline = start + cap
            for first in range(0, streams, batch):
                for i in range(first, min(first + batch, streams)):
                    body = completion_body(f"d-{name}-{i} {FILLER}", tokens)
                    tasks.append(asyncio.create_task(held_stream(session, url, body, state)))
                while state.opened + state.failed_early < len(tasks):
                    if time.perf_counter() > deadline:
                        capped = True
                        break
                    await asyncio.sleep(0.01)
                if capped:
                    break
            ramp = time.perf_counter() - start
            rss_open = proc_status(pid, "VmRSS")
            threads_open = proc_status(pid, "Threads")
            held = state.opened - state.closed
            all_open = state.opened == streams
            await asyncio.to_thread(set_itl, itl)
            released = time.perf_counter()
            tokens_at_release = state.tokens
            remaining = max(deadline - released, 0.1)
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for task in pending:
                task.cancel()
            if pending:
                capped = True
                await asyncio.wait(pending)
            outcomes: Counter[str] = Counter()
            for task in tasks:
                outcomes["cancelled_at_cap" if task.cancelled() else task.result()] += 1
            outcomes["not_sent_cap"] = streams - len(tasks)
            end = time.perf_counter()
    finally:
        for task in tasks:
            task.cancel()  # only those still running: on an error or SIGTERM
        with contextlib.suppress(OSError, RuntimeError):
            await asyncio.to_thread(set_itl, itl)
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    router_cpu = cpu_ms(pid) - cpu_before
    await asyncio.sleep(0.5)
    rss_after = proc_status(pid, "VmRSS")
    ok = outcomes.pop("ok", 0)
    errors = {kind: count for kind, count in outcomes.items() if count}
    return StreamsRun(
        router=name,
        streams=streams,
        ok=ok,
        errors=errors,
        held_at_peak=held,
        all_open=all_open,
        ramp_seconds=ramp,
        release_seconds=end - released,
        seconds=end - start,
        capped=capped,
        tokens=state.tokens,
        release_tokens_per_s=(state.tokens - tokens_at_release) / max(end - released, 1e-9),
        asked_tokens_per_s=streams / itl if itl else float("nan"),
        rss_before_kib=rss_before,
        rss_open_kib=rss_open,
        rss_max_kib=max(peak[0], rss_open),
        rss_after_kib=rss_after,
        kib_per_stream=(rss_open - rss_before) / max(held, 1),
        threads_before=threads_before,
        threads_open=threads_open,
        router_cpu_ms=router_cpu,
        router_cpu_ms_per_stream=router_cpu / streams,
        warmup_errors=dict(warm),
    )

"""Sleeps of periodic work, cheaper when the work finds nothing to do.

``sleep_to_tick(interval)`` sleeps as ``anyio.sleep(interval)`` would, but until the next
whole multiple of the interval in the loop's time. So the router's periodic work of one
interval (the stall watch, the model watch, the check for KV event publishers, uvicorn's
clock: every second by default) wakes the loop once together rather than once each, at a
period as long as before. On asyncio (the router serves on it) the sleep is a future and
a loop timer, without anyio's look-up of the running backend.
"""

from __future__ import annotations

import asyncio
import math

import anyio


def next_tick(now: float, interval: float) -> float:
    """The first multiple of ``interval`` at least a quarter interval after ``now``: one
    interval after a wake-up on time (or a hair early, as a timer may run); a wake-up that
    came late keeps to the grid, so the period stays ``interval`` on average."""
    return math.ceil((now + interval / 4) / interval) * interval


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def sleep_to_tick(interval: float) -> None:
    """Sleep until ``next_tick``; cancellable as any sleep."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio (the tests')
        await anyio.sleep_until(next_tick(anyio.current_time(), interval))
        return
    waiter = loop.create_future()
    timer = loop.call_at(next_tick(loop.time(), interval), _release, waiter)
    try:
        await waiter
    finally:
        timer.cancel()

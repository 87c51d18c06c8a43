"""How late the event loop runs, so that the router never blames an engine for its own
stall (a 30 MB body being parsed, a swap storm, a stopped process).

A ticker sleeps ``interval`` over and over and keeps the wake-ups that came late. A probe
that timed out asks how late the loop ran since the probe started: the answer includes a
tick overdue right now, because after a stall the loop may run the probe's timeout before
the ticker's own late wake-up.
"""

from __future__ import annotations

import asyncio
from collections import deque

import anyio

# Later than this is a lag worth remembering; a busy loop is always a little late.
_NOTABLE = 0.05


class LoopLag:
    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._due: float | None = None  # when the next tick is due; None: not running
        # (woke at, seconds late) of the late ticks, oldest first; bounded.
        self._late: deque[tuple[float, float]] = deque(maxlen=256)

    def worst_since(self, start: float, now: float) -> float:
        """The longest the loop was late at any moment from ``start`` to ``now``."""
        worst = 0.0 if self._due is None else max(0.0, now - self._due)
        for woke, late in reversed(self._late):
            if woke < start:
                break
            worst = max(worst, late)
        return worst

    def ticked(self, now: float) -> None:
        """The ticker woke at ``now``; its next tick is due one interval later."""
        if self._due is not None and now - self._due > _NOTABLE:
            self._late.append((now, now - self._due))
        self._due = now + self.interval

    async def run(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio (the tests')
            while True:
                self.ticked(anyio.current_time())
                await anyio.sleep(self.interval)
        # On asyncio (the router serves on it) a tick is a timer callback: no task to wake,
        # no sleep's future and cancel scope, half the CPU of a tick that finds nothing.
        handle: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal handle
            now = loop.time()
            self.ticked(now)
            handle = loop.call_at(now + self.interval, tick)

        tick()
        try:
            await anyio.sleep_forever()
        finally:
            if handle is not None:
                handle.cancel()

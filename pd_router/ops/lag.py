"""How late the event loop runs, so that the router never blames an engine for its own
stall (a 30 MB body being parsed, a swap storm, a stopped process).

A ticker wakes every ``interval`` and keeps the wake-ups that came late. A probe that timed
out asks how late the loop ran since the probe started: the answer includes a tick overdue
right now, because after a stall the loop may run the probe's timeout before the ticker's
own late wake-up.

Only a stretch someone watches (``watching``: a probe out) is ever asked about, so the
ticker ticks only then: an idle router with its probes answered in a millisecond wakes for
no tick at all, where it woke ten times a second.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

# Later than this is a lag worth remembering; a busy loop is always a little late.
_NOTABLE = 0.05


class LoopLag:
    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._due: float | None = None  # when the next tick is due; None: not ticking
        # (woke at, seconds late) of the late ticks, oldest first; bounded.
        self._late: deque[tuple[float, float]] = deque(maxlen=256)
        self._watchers = 0
        # While ``run`` runs: on asyncio its loop (a tick is a timer callback there), else
        # True (a task sleeps from tick to tick: trio, the tests').
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasked = False
        self._handle: asyncio.TimerHandle | None = None
        self._wanted: anyio.Event | None = None  # set to wake the ticking task

    def worst_since(self, start: float, now: float) -> float:
        """The longest the loop was late at any moment from ``start`` to ``now``, as far
        as the ticks seen while someone watched tell."""
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

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Tick while inside (``run`` running); ask ``worst_since`` before leaving."""
        self._watchers += 1
        if self._watchers == 1:
            self._start()
        try:
            yield
        finally:
            self._watchers -= 1
            if not self._watchers:
                self._stop()

    def _start(self) -> None:
        if self._loop is not None:
            self._due = self._loop.time() + self.interval
            self._handle = self._loop.call_at(self._due, self._tick)
        elif self._tasked:
            self._due = anyio.current_time() + self.interval
            if self._wanted is not None:
                self._wanted.set()

    def _stop(self) -> None:
        self._due = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        assert self._loop is not None  # nosec B101: only scheduled while run runs
        now = self._loop.time()
        self.ticked(now)
        self._handle = self._loop.call_at(now + self.interval, self._tick)

    async def run(self) -> None:
        """The ticker: runs until cancelled, ticking while someone watches."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio (the tests')
            await self._run_task()
            return
        # On asyncio (the router serves on it) a tick is a timer callback: no task to wake,
        # no sleep's future and cancel scope, half the CPU of a tick that finds nothing.
        self._loop = loop
        try:
            if self._watchers:
                self._start()
            await anyio.sleep_forever()
        finally:
            self._stop()
            self._loop = None

    async def _run_task(self) -> None:
        self._tasked = True
        try:
            if self._watchers:
                self._start()
            while True:
                due = self._due
                if due is None:
                    self._wanted = anyio.Event()
                    await self._wanted.wait()
                    self._wanted = None
                    continue
                await anyio.sleep_until(due)
                now = anyio.current_time()
                # Not if the watch ended meanwhile, or ended and began again (due later).
                if self._due is not None and now >= self._due:
                    self.ticked(now)
        finally:
            self._stop()
            self._tasked = False
            self._wanted = None

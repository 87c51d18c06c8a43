"""Liveness rules with no server: the stall watch (progress is evidence) and the loop-lag
ticker (the router's own stall is nobody's fault), under asyncio and trio."""

from __future__ import annotations

import time

import anyio
import pytest

from pd_router.fleet import stall
from pd_router.fleet.nodes import Node
from pd_router.fleet.registry import Binding, Fleet
from pd_router.ops.lag import LoopLag


class Stream:
    """A started stream as the watch sees it."""

    def __init__(self) -> None:
        self.received = 100
        self.awaiting = True


class Request:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def fail(self, error: object) -> None:
        raise AssertionError("the watch itself fails nothing")


def fleet_of(*slots: int) -> Fleet:
    decode = [Node(id=i + 1, url=f"http://d{i}", slots=n) for i, n in enumerate(slots)]
    return Fleet([Node(id=0, url="http://p0", slots=1, role="prefill")], decode)


_held: list[object] = []  # the bindings' context managers, alive for the test's length


def bound(fleet: Fleet, node: Node, name: str) -> Binding:
    manager = fleet.bind(Request(name), node)
    _held.append(manager)
    return manager.__enter__()


def started(fleet: Fleet, node: Node, name: str) -> tuple[Binding, Stream]:
    binding = bound(fleet, node, name)
    stream = binding.stream = Stream()
    stall.hung([binding], 1.0, 30.0)  # the watch's first sight of it
    return binding, stream


def ticks(fleet: Fleet, seconds: float, timeout: float = 30.0) -> dict[Node, list[Binding]]:
    """The watch's verdict after ``seconds`` of one-second ticks."""
    found: dict[Node, list[Binding]] = {}
    for _ in range(int(seconds)):
        found = stall.hung(fleet.bindings.values(), 1.0, timeout)
    return found


def test_a_node_whose_started_streams_all_went_silent_is_hung() -> None:
    fleet = fleet_of(4, 4)
    d0, d1 = fleet.pool.nodes
    a, _ = started(fleet, d0, "a")
    b, _ = started(fleet, d0, "b")
    _, other = started(fleet, d1, "other")
    not_started = bound(fleet, d0, "waiting for its KV")
    assert ticks(fleet, 29) == {}
    other.received += 1
    assert ticks(fleet, 1) == {d0: [a, b]}
    assert not_started not in ticks(fleet, 1)[d0], "a stream without its KV is not watched"


def test_one_flowing_stream_means_the_node_is_not_hung() -> None:
    fleet = fleet_of(4)
    (d0,) = fleet.pool.nodes
    started(fleet, d0, "silent")
    _, flowing = started(fleet, d0, "flowing")
    for _ in range(60):
        flowing.received += 10
        assert stall.hung(fleet.bindings.values(), 1.0, 30.0) == {}


def test_a_stream_held_up_by_its_own_client_is_not_silent() -> None:
    fleet = fleet_of(4)
    (d0,) = fleet.pool.nodes
    _, slow_client = started(fleet, d0, "slow client")
    slow_client.awaiting = False  # the relay is busy sending; the engine's bytes wait
    assert ticks(fleet, 120) == {}
    slow_client.awaiting = True
    assert ticks(fleet, 29) == {}, "silence counts from when the relay waits again"
    assert list(ticks(fleet, 1)) == [d0]


def test_a_late_tick_counts_as_at_most_its_cap() -> None:
    """The caller caps ``elapsed`` (health.watch_stalls): a 60 s loop stall is 2 s here."""
    fleet = fleet_of(1)
    (d0,) = fleet.pool.nodes
    binding, _ = started(fleet, d0, "s")
    stall.hung(fleet.bindings.values(), min(60.0, 2.0), 30.0)  # as watch_stalls caps it
    assert binding.silent == 2.0


def test_lag_counts_only_since_the_start_and_includes_a_tick_overdue_now() -> None:
    lag = LoopLag(interval=0.1)
    lag.ticked(10.0)
    lag.ticked(10.1)
    lag.ticked(13.2)  # due at 10.2: 3 s late
    lag.ticked(13.3)
    assert lag.worst_since(10.0, 13.35) == pytest.approx(3.0)
    assert lag.worst_since(13.25, 13.35) == 0.0, "a lag before the start does not count"
    # The loop is stuck right now: the tick due at 13.4 has not run.
    assert lag.worst_since(13.25, 15.4) == pytest.approx(2.0)


@pytest.mark.anyio
async def test_the_ticker_sees_a_blocked_loop() -> None:
    lag = LoopLag(interval=0.02)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lag.run)
        await anyio.sleep(0.1)
        with lag.watching():  # a probe out
            start = anyio.current_time()
            assert lag.worst_since(start, anyio.current_time()) < 0.1
            await anyio.sleep(0.1)
            time.sleep(0.4)  # the router's own stall: a long parse, a page-in
            assert lag.worst_since(start, anyio.current_time()) >= 0.3
            await anyio.sleep(0.1)
            assert lag.worst_since(start, anyio.current_time()) >= 0.3, "remembered after it"
        tg.cancel_scope.cancel()


class CountedLag(LoopLag):
    def __init__(self, interval: float) -> None:
        super().__init__(interval)
        self.ticks = 0

    def ticked(self, now: float) -> None:
        self.ticks += 1
        super().ticked(now)


@pytest.mark.anyio
async def test_the_ticker_ticks_only_while_a_probe_watches() -> None:
    """Nobody asks about the loop's lag with no probe out: an idle router wakes for no tick.
    Watching from before the ticker starts, and from two probes at once, works too."""
    lag = CountedLag(interval=0.01)
    async with anyio.create_task_group() as tg:
        with lag.watching():
            tg.start_soon(lag.run)
            await anyio.sleep(0.1)
            assert lag.ticks > 0, "a watch begun before the ticker ran is ticked for"
        await anyio.sleep(0.05)
        idle = lag.ticks
        await anyio.sleep(0.2)
        assert lag.ticks == idle, "no tick while nobody watches"
        start = anyio.current_time()
        time.sleep(0.3)  # a stall nobody watched
        with lag.watching(), lag.watching():  # two probes out
            assert lag.worst_since(start, anyio.current_time()) == 0.0
            await anyio.sleep(0.1)
            assert lag.ticks > idle
        ticked = lag.ticks
        await anyio.sleep(0.1)
        assert lag.ticks == ticked, "both probes back: the ticking stops"
        tg.cancel_scope.cancel()

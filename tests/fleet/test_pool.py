"""The decode pool's rules, under asyncio and trio, with no server."""

from __future__ import annotations

import re

import anyio
import pytest

from pd_router.errors import Busy, QueueTimeout
from pd_router.fleet.nodes import Node, make_nodes
from pd_router.fleet.pool import DecodePool

pytestmark = pytest.mark.anyio


def pool_of(*slots: int) -> DecodePool:
    return DecodePool([Node(id=i, url=f"http://d{i}", slots=n) for i, n in enumerate(slots)])


def assert_idle(pool: DecodePool) -> None:
    assert pool.in_use == 0
    assert pool.queue_depth == 0
    assert pool.acquired == pool.released


async def test_fail_fast_is_the_default_behaviour() -> None:
    pool = pool_of(1)
    held = await pool.acquire(0)
    with pytest.raises(Busy) as caught:
        await pool.acquire(0)
    assert not isinstance(caught.value, QueueTimeout)
    assert caught.value.message == "all decode nodes busy"
    assert caught.value.status == 429 and caught.value.headers["Retry-After"]
    held.release()
    assert_idle(pool)


async def test_queue_timeout_fires_and_names_the_wait() -> None:
    pool = pool_of(1)
    held = await pool.acquire(0)
    started = anyio.current_time()
    with pytest.raises(QueueTimeout) as caught:
        await pool.acquire(0.2)
    elapsed = anyio.current_time() - started
    assert 0.19 <= elapsed < 1.0
    # The wait it names is the one it had (a loaded machine wakes the waiter late).
    said = re.fullmatch(r"no decode node free after waiting (\d+\.\d)s", caught.value.message)
    assert said is not None and 0.2 <= float(said[1]) <= elapsed + 0.05
    assert pool.queue_depth == 0
    held.release()
    assert_idle(pool)


async def test_six_requests_on_one_single_slot_node_all_succeed_one_at_a_time() -> None:
    pool = pool_of(1)
    active = 0
    peak = 0
    order: list[int] = []

    async def request(i: int) -> None:
        nonlocal active, peak
        async with pool.reserve(5) as reservation:
            assert reservation.node.in_use == 1
            active += 1
            peak = max(peak, active)
            order.append(i)
            await anyio.sleep(0.01)
            active -= 1

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(request, i)
            await anyio.sleep(0)
    assert peak == 1
    assert sorted(order) == list(range(6))
    assert_idle(pool)


async def test_parallelism_equals_total_slots_across_nodes() -> None:
    pool = pool_of(1, 2, 3)
    active = 0
    peak = 0
    gate = anyio.Event()

    async def request() -> None:
        nonlocal active, peak
        async with pool.reserve(5):
            active += 1
            peak = max(peak, active)
            await gate.wait()
            active -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(request)
        while pool.queue_depth < 4:
            await anyio.sleep(0.001)
        assert peak == 6 and pool.in_use == 6
        assert [n.in_use for n in pool.nodes] == [1, 2, 3]
        gate.set()
    assert_idle(pool)


async def test_free_slots_spread_over_nodes_before_stacking() -> None:
    pool = pool_of(2, 2)
    first = pool.try_acquire()
    second = pool.try_acquire()
    assert first is not None and second is not None
    assert first.node is not second.node


async def test_a_slot_elsewhere_skips_the_node_to_avoid() -> None:
    pool = pool_of(4, 1)
    first, second = pool.nodes
    moved = pool.try_acquire(avoid=first)
    assert moved is not None and moved.node is second, "the other node, though it has fewer"
    assert pool.try_acquire(avoid=first) is None, "only the avoided node has a free slot"
    moved.release()
    assert_idle(pool)


async def test_first_come_first_served_and_no_overtaking() -> None:
    pool = pool_of(1)
    held = await pool.acquire(0)
    served: list[int] = []

    async def waiter(i: int) -> None:
        async with pool.reserve(5):
            served.append(i)
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(waiter, i)
            while pool.queue_depth < i + 1:
                await anyio.sleep(0)
        # A newcomer that finds a waiter queued must not jump the line.
        assert pool.try_acquire() is None
        held.release()
        assert pool.in_use == 1
    assert served == [0, 1, 2, 3, 4]
    assert_idle(pool)


async def test_no_starvation_under_repeated_contention() -> None:
    pool = pool_of(1, 1)
    served = {i: 0 for i in range(8)}

    async def client(i: int) -> None:
        for _ in range(10):
            async with pool.reserve(10):
                served[i] += 1
                await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(client, i)
    assert served == {i: 10 for i in range(8)}
    assert_idle(pool)


async def test_cancelled_waiter_takes_nothing_and_loses_no_wakeup() -> None:
    pool = pool_of(1)
    held = await pool.acquire(0)
    got: list[str] = []

    async def waiter(name: str) -> None:
        async with pool.reserve(5):
            got.append(name)

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as doomed:
            tg.start_soon(waiter, "first")
            await anyio.sleep(0.01)
        cancelled_waiter = anyio.CancelScope()

        async def leaver() -> None:
            with cancelled_waiter:
                await pool.acquire(5)
                got.append("leaver")  # pragma: no cover - must never run

        tg.start_soon(leaver)
        tg.start_soon(waiter, "third")
        while pool.queue_depth < 3:
            await anyio.sleep(0.001)
        cancelled_waiter.cancel()
        while pool.queue_depth != 2:
            await anyio.sleep(0.001)
        held.release()
    assert doomed is not None
    assert got == ["first", "third"]
    assert_idle(pool)


async def test_waiter_cancelled_after_the_hand_off_passes_the_slot_on() -> None:
    """The slot was handed to a waiter in the same tick it was cancelled: not lost."""
    pool = pool_of(1)
    held = await pool.acquire(0)
    got: list[str] = []
    scope = anyio.CancelScope()

    async def leaver() -> None:
        with scope:
            async with pool.reserve(5):
                got.append("leaver")

    async def patient() -> None:
        async with pool.reserve(5):
            got.append("patient")

    async with anyio.create_task_group() as tg:
        tg.start_soon(leaver)
        while pool.queue_depth < 1:
            await anyio.sleep(0)
        tg.start_soon(patient)
        while pool.queue_depth < 2:
            await anyio.sleep(0)
        held.release()  # hands the slot to "leaver" ...
        scope.cancel()  # ... which is cancelled before it could run
    # asyncio delivers the cancellation into the wait (the leaver passes the slot on);
    # trio lets the wait complete and cancels at the next checkpoint (the leaver holds the
    # slot briefly, then releases it). Either way nothing is lost and "patient" is served.
    assert got[-1] == "patient"
    assert_idle(pool)


async def test_release_is_exactly_once() -> None:
    pool = pool_of(2)
    reservation = await pool.acquire(0)
    reservation.release()
    reservation.release()
    assert pool.released == 1
    assert_idle(pool)


async def test_node_slots_come_from_the_spec() -> None:
    nodes = make_nodes(["http://a:1", "http://b:2,slots=4"], default_slots=2)
    assert [(n.url, n.slots) for n in nodes] == [("http://a:1", 2), ("http://b:2", 4)]
    for bad in ["a:1", "http://a:1,slots=0", "http://a:1,weight=2", "http://a:1,slots=x"]:
        with pytest.raises(ValueError):
            make_nodes([bad], 1)

"""Regression: the reservation structures the reference change analysed, on the real pool.

A cancellation is delivered at the next checkpoint, not where it was requested; so the
reservation must land inside the ``try`` that releases it with no ``await`` in between.
The first two structures below leak a slot (kept here so that the leak stays understood);
the third is ``DecodePool.reserve``, which the relay uses, and must never leak.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from pd_router.fleet.nodes import Node
from pd_router.fleet.pool import DecodePool

pytestmark = pytest.mark.anyio

Structure = Callable[[DecodePool, Callable[[], Awaitable[None]]], Awaitable[None]]


async def unguarded(pool: DecodePool, prefill: Callable[[], Awaitable[None]]) -> None:
    reservation = await pool.acquire(5)
    await prefill()  # outside any try: a cancellation here leaks
    try:
        await anyio.sleep(0)
    finally:
        reservation.release()


async def shield_without_try(pool: DecodePool, prefill: Callable[[], Awaitable[None]]) -> None:
    with anyio.CancelScope(shield=True):
        reservation = await pool.acquire(5)
    await anyio.sleep(0)  # e.g. an async log call: the pending cancellation lands here
    try:
        await prefill()
    finally:
        reservation.release()


async def reserve(pool: DecodePool, prefill: Callable[[], Awaitable[None]]) -> None:
    async with pool.reserve(5):
        await prefill()


@pytest.mark.parametrize(
    "structure, moment, leaks",
    [
        (unguarded, "queued", False),
        (unguarded, "prefill", True),
        (shield_without_try, "queued", True),
        (shield_without_try, "prefill", False),
        (reserve, "queued", False),
        (reserve, "prefill", False),
    ],
)
async def test_client_leaves(structure: Structure, moment: str, leaks: bool) -> None:
    pool = DecodePool([Node(id=0, url="http://d0", slots=1)])
    blocker = await pool.acquire(0) if moment == "queued" else None
    in_prefill = anyio.Event()

    async def prefill() -> None:
        in_prefill.set()
        await anyio.sleep(10)

    async with anyio.create_task_group() as tg:
        request = anyio.CancelScope()

        async def handler() -> None:
            with request:
                await structure(pool, prefill)

        tg.start_soon(handler)
        if blocker is not None:
            while pool.queue_depth < 1:
                await anyio.sleep(0)
            request.cancel()  # the client leaves while queued ...
            blocker.release()  # ... and a slot frees right after
        else:
            await in_prefill.wait()
            request.cancel()
    await anyio.sleep(0.01)
    assert pool.queue_depth == 0
    assert (pool.in_use == 1) is leaks
    if not leaks:
        assert pool.acquired == pool.released

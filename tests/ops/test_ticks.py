"""The sleeps of periodic work (``ops/ticks.py``), under asyncio and trio, and uvicorn's
main loop as the router runs it: awake once a second for its clock, and at once when told
to stop."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest
import uvicorn

from pd_router.ops.ticks import next_tick, sleep_to_tick
from pd_router.serve import _Server


@pytest.mark.parametrize("interval", [1.0, 0.05, 0.25, 2.0])
@pytest.mark.parametrize("now", [0.0, 3.0, 3.01, 3.6, 3.9999, 12345.678])
def test_a_next_tick_is_on_the_grid_and_never_at_once(now: float, interval: float) -> None:
    due = next_tick(now, interval)
    assert due - now >= interval / 4 - 1e-9
    assert due - now <= interval * 1.25 + 1e-9
    assert round(due / interval) * interval == pytest.approx(due)


@pytest.mark.anyio
async def test_a_sleep_lasts_until_the_next_tick() -> None:
    """Sleepers of one interval begun apart wake together, on the tick: one wake-up."""
    for _ in range(3):
        due = next_tick(anyio.current_time(), 0.05)
        await sleep_to_tick(0.05)
        assert anyio.current_time() >= due - 0.002  # loop timers have a 1 ms resolution


@pytest.mark.anyio
async def test_sleep_to_tick_is_cancellable() -> None:
    with anyio.move_on_after(0.05) as scope:
        await sleep_to_tick(60.0)
    assert scope.cancelled_caught


async def _app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("no request here")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_the_main_loop_renews_the_date_and_stops_when_told_from_another_thread() -> None:
    config = uvicorn.Config(_app, log_config=None, lifespan="off")
    config.load()
    server = _Server(config, router=None)  # type: ignore[arg-type]  # no signal comes here
    server._loop = asyncio.get_running_loop()
    main = asyncio.ensure_future(server.main_loop())
    await asyncio.sleep(0.05)
    assert not main.done()
    headers = dict(server.server_state.default_headers)
    assert headers[b"date"].endswith(b" GMT")
    # As a signal handler would (it may run on any bytecode): uvicorn's own flag.
    threading.Thread(target=setattr, args=(server, "should_exit", True)).start()
    await asyncio.wait_for(main, 30)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_the_main_loop_of_a_server_told_to_exit_before_it_began_ends_at_once() -> None:
    config = uvicorn.Config(_app, log_config=None, lifespan="off")
    config.load()
    server = _Server(config, router=None)  # type: ignore[arg-type]
    server.should_exit = True
    await asyncio.wait_for(server.main_loop(), 30)

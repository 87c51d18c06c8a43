"""Aborts by request id across the routers sharing one Redis (``shared/abort.py``), on real
redis-servers, under asyncio and trio: the router holding the request answers the one
asked; garbage on the channel is skipped without losing what follows; a Redis away for a
while is said once when the channel is lost and once when it is back, not at every try."""

from __future__ import annotations

import logging

import anyio
import pytest

from pd_router.shared.abort import CHANNEL, Outcome, RemoteAborts
from pd_router.shared.redis import RETRY, Redis, parse_url
from tests.redis_server import RedisServer

pytestmark = pytest.mark.anyio

HELD = "req-held-by-b"


def holding(request_id: str) -> Outcome:
    """Router b's requests: it holds ``HELD`` and aborts it."""
    if request_id == HELD:
        return 200, {"id": request_id, "outcome": "aborted"}
    return 404, {}


def holding_nothing(request_id: str) -> Outcome:
    return 404, {}


async def abort_answered(asker: RemoteAborts) -> Outcome:
    """Asks until the answer comes: each router's subscription is made in its own time."""
    with anyio.fail_after(30):
        while (answer := await asker.abort(HELD)) is None:
            pass
    return answer


async def test_the_router_holding_the_request_answers_and_garbage_on_the_channel_is_skipped(
    redis: Redis,
) -> None:
    a = RemoteAborts(redis, "a", holding_nothing)
    b = RemoteAborts(redis, "b", holding)
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.run)
        tg.start_soon(b.run)
        assert await abort_answered(a) == (200, {"id": HELD, "outcome": "aborted"})
        # Nobody holds it: no answer within the wait, not an error.
        assert await a.abort("req-nowhere") is None
        # Before, a message that was not JSON ended b's subscription, and an abort
        # published while it was made again went unheard: now the next is answered at once.
        await redis.call("PUBLISH", CHANNEL, b"not json")
        await redis.call("PUBLISH", CHANNEL, b"[1, 2]")
        assert await a.abort(HELD) == (200, {"id": HELD, "outcome": "aborted"})
        tg.cancel_scope.cancel()


async def test_a_redis_away_for_a_while_is_said_once_lost_and_once_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pd_router.remote_abort")
    with RedisServer() as server:
        async with (
            Redis(parse_url(server.url), timeout=1.0) as redis_a,
            Redis(parse_url(server.url), timeout=1.0) as redis_b,
        ):
            a = RemoteAborts(redis_a, "a", holding_nothing)
            b = RemoteAborts(redis_b, "b", holding)
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.run)
                tg.start_soon(b.run)
                await abort_answered(a)
                server.stop()
                # Both listeners try again every RETRY seconds meanwhile: a dozen tries each.
                await anyio.sleep(12 * RETRY)
                server.start()
                assert await abort_answered(a) == (200, {"id": HELD, "outcome": "aborted"})
                tg.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if r.name == "pd_router.remote_abort"]
    assert len(lines) == 4, lines  # a's and b's
    assert sum("; subscribing again" in line for line in lines) == 2, lines
    assert sum("subscribed again, " in line for line in lines) == 2, lines

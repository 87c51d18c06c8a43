"""What routers sharing ``--state`` tell each other of their placements
(``shared/placements.py``), on a real redis-server, under asyncio and trio: another
publisher's garbage on the channel is skipped, and what follows it is still heard."""

from __future__ import annotations

import anyio
import orjson
import pytest

from pd_router.fleet.nodes import Node
from pd_router.fleet.registry import Fleet
from pd_router.shared.placements import (
    CHANNEL,
    MAX_CHUNKS,
    MESSAGE_BYTES,
    SharedPlacements,
    messages,
)
from pd_router.shared.redis import Redis

pytestmark = pytest.mark.anyio

PREFILL = "http://p0:8100"
DECODE = "http://d0:8200"


def fleet() -> Fleet:
    return Fleet(
        [Node(id=0, url=PREFILL, slots=1, role="prefill")],
        [Node(id=1, url=DECODE, slots=1)],
        prefill_policy="cost",
    )


def placed(role: str, url: object, chunks: object, tokens: object) -> bytes:
    return orjson.dumps({"router": "other", "placed": [[role, url, chunks, tokens]]})


async def test_garbage_on_the_channel_is_skipped_and_what_follows_is_heard(redis: Redis) -> None:
    """Before, a message that was not JSON ended the subscription (messages published
    before it was made again were lost), and a placement naming its engine by a list made
    the listener raise (and the router restart its placements task a second later)."""
    here = fleet()
    shared = SharedPlacements(redis, "me", here)
    decode = here.pool.nodes[0]
    good = [11, 12, 13]
    async with anyio.create_task_group() as tg:
        tg.start_soon(shared.run)
        # Subscribed once a message published reaches the listener.
        with anyio.fail_after(10):
            while not here.kv.of(decode.id).held([7]):
                await redis.call("PUBLISH", CHANNEL, placed("decode", DECODE, [7], 10))
                await anyio.sleep(0.05)
        for garbage in [
            b"not json",
            placed("decode", [DECODE], good, 10),
            placed("decode", DECODE, good, 1 << 40),
            placed("decode", DECODE, good, -1),
            placed("decode", DECODE, good, True),
            orjson.dumps({"router": "other", "placed": [["decode", DECODE, good]]}),
            # Larger than any sender sends: the listener's loop would be held meanwhile.
            placed("decode", DECODE, good + list(range(1000, 300_000)), 10),
            placed("decode", DECODE, good * (MAX_CHUNKS // 3 + 1), 10),
        ]:
            await redis.call("PUBLISH", CHANNEL, garbage)
        await redis.call("PUBLISH", CHANNEL, placed("decode", DECODE, [21, 22], 8))
        with anyio.fail_after(10):
            while not here.kv.of(decode.id).held([21, 22]):
                await anyio.sleep(0.05)
        # None of the lies was taken; the placement after them was.
        assert here.kv.of(decode.id).held(good) == 0
        assert here.kv.of(decode.id).held([21, 22]) == 2
        tg.cancel_scope.cancel()


def test_a_burst_of_placements_goes_out_in_messages_a_listener_takes() -> None:
    """Up to ``OUTBOX`` placements of long prompts wait for one flush: they go out in
    order, in messages of 1 MiB at most; one longer than any context is left out."""
    items = [("prefill", PREFILL, list(range(i, i + 2000)), 128_000) for i in range(200)]
    items.insert(7, ("prefill", PREFILL, [1] * (MAX_CHUNKS + 1), 600_000))
    sent = list(messages("me", items))
    assert len(sent) > 1 and all(len(message) <= MESSAGE_BYTES for message in sent)
    heard = [item for message in sent for item in orjson.loads(message)["placed"]]
    assert heard == [list(item) for item in items[:7] + items[8:]]
    assert {orjson.loads(message)["router"] for message in sent} == {"me"}

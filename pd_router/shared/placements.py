"""What each router placed where, told to the routers sharing one Redis (``--state``).

The ``cost`` policy predicts what an engine holds from where its router sent prompts. A
conversation whose turns alternate between routers would be new to each of them; so every
router publishes its placements (the engine, by role and URL, the prompt's chunk keys, the
same on every router: ``fleet/holdings.py``, and its tokens) and takes the others' into its
own view and its count of each engine's share of the prefills, as if they were its own.
Off the request path: placements wait in a bounded outbox (the oldest dropped when full) and
go out together on ``{pdr}:placements``, ``FLUSH`` seconds after the first of them (no
placement, no wake-up: looking every ``FLUSH`` seconds cost an idle router 14 ms of CPU a
second). Redis being away costs the routers agreement, never a request. A conversation's
next turn comes after its answer (hundreds of ms at least), well after the flush.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

import anyio
import orjson

from pd_router.fleet.holdings import Prompt
from pd_router.fleet.nodes import Node
from pd_router.fleet.registry import Fleet
from pd_router.shared.redis import RETRY, Outage, Redis, RedisError, RedisUnavailable

log = logging.getLogger("pd_router.placements")

CHANNEL = "{pdr}:placements"
FLUSH = 0.005
# Placements waiting to go out: ~1 KB each for a 2,000-token prompt.
OUTBOX = 4096
# A prompt's tokens in a heard placement: more is no engine's context, but a lie.
MAX_TOKENS = 1 << 32
# A placement's chunks (``CHUNK_TOKENS`` each: 512 K tokens), and one message's bytes: a
# listener parses and applies a message at once, every other request of its router waiting
# (a 6 MiB lie held each listening router's loop 460 ms; 1 MiB takes ~30 ms). A sender
# splits what it has into messages that fit; a listener skips one that does not.
MAX_CHUNKS = 8192
MESSAGE_BYTES = 1 << 20

Placed = tuple[str, str, list[int], int]  # (role, url, chunk keys, tokens)


class Outbox(deque[Placed]):
    """The placements not sent yet; one added wakes the publisher (``filled``)."""

    def __init__(self) -> None:
        super().__init__(maxlen=OUTBOX)
        self.filled: anyio.Event | None = None

    def append(self, item: Placed) -> None:
        super().append(item)
        if self.filled is not None:
            self.filled.set()


class SharedPlacements:
    def __init__(self, redis: Redis, router_id: str, fleet: Fleet) -> None:
        self.redis = redis
        self.router_id = router_id
        self.fleet = fleet
        self.outbox = Outbox()
        fleet.kv.outbox = self.outbox

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._publish)
            tg.start_soon(self._listen)

    async def _publish(self) -> None:
        outbox = self.outbox
        while True:
            outbox.filled = anyio.Event()
            if not outbox:
                await outbox.filled.wait()
            await anyio.sleep(FLUSH)  # those placed meanwhile go in the same message
            items = list(self.outbox)
            self.outbox.clear()
            try:
                for message in messages(self.router_id, items):
                    await self.redis.call("PUBLISH", CHANNEL, message)
            except (RedisUnavailable, RedisError) as exc:
                log.info("placements not shared: %s", exc)

    async def _listen(self) -> None:
        outage = Outage(log, "placements channel")
        while True:
            try:
                async with self.redis.subscribe(CHANNEL) as channel:
                    outage.subscribed()
                    while True:
                        _, data = await channel.next_message()
                        if len(data) > MESSAGE_BYTES:
                            log.info("placements channel: a message over 1 MiB, skipped")
                            continue
                        try:
                            message = orjson.loads(data)
                        except orjson.JSONDecodeError:
                            # Not another router's: skipped, and the channel kept.
                            log.info("placements channel: a message that is not JSON, skipped")
                            continue
                        self.heard(message)
            except (RedisUnavailable, RedisError) as exc:
                outage.lost(exc)
                await anyio.sleep(RETRY)

    def heard(self, message: Any) -> None:
        """Another router's placements: its engines hold those prompts now."""
        if not isinstance(message, dict) or message.get("router") == self.router_id:
            return
        placed = message.get("placed")
        if not isinstance(placed, list):
            return
        nodes: dict[tuple[str, str], Node] = {
            (node.role, node.url): node for node in self.fleet.nodes
        }
        for item in placed[:OUTBOX]:
            if not isinstance(item, list) or len(item) != 4:
                continue
            role, url, chunks, tokens = item
            if not (isinstance(role, str) and isinstance(url, str) and type(tokens) is int):
                continue
            node = nodes.get((role, url))
            if node is None or not isinstance(chunks, list) or not 0 <= tokens < MAX_TOKENS:
                continue
            if len(chunks) > MAX_CHUNKS:
                continue
            if not all(isinstance(key, int) for key in chunks):
                continue
            prompt = Prompt(chunks, tokens)
            if role == "prefill":
                # Counted in the share of placements as this router's own: every router
                # sees the same fleet.
                self.fleet.prefill.heard(node, prompt)
            else:
                self.fleet.kv.of(node.id).insert(chunks)


def messages(router_id: str, items: list[Placed]) -> Iterator[bytes]:
    """``items`` as messages of ``MESSAGE_BYTES`` at most, in order; a placement of more
    than ``MAX_CHUNKS`` chunks is left out (no engine's context is that long)."""
    head = orjson.dumps({"router": router_id, "placed": []})[:-2]
    parts: list[bytes] = []
    size = len(head) + 2
    for item in items:
        if len(item[2]) > MAX_CHUNKS:
            continue
        part = orjson.dumps(item)
        if parts and size + len(part) + 1 > MESSAGE_BYTES:
            yield head + b",".join(parts) + b"]}"
            parts, size = [], len(head) + 2
        parts.append(part)
        size += len(part) + 1
    if parts:
        yield head + b",".join(parts) + b"]}"

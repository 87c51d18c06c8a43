"""Abort by request id across the routers sharing one Redis (``--state``).

An operator's abort reaches whichever router the Service picked; the request may run on
another. The router that does not hold it publishes the id on ``{pdr}:abort``; every
router hears it, the one holding the request aborts it there (the same two phases as a
local abort: engines stopped first, then the one terminal outcome) and publishes what
happened on the asker's reply channel. No answer within ``WAIT`` seconds: no router holds
it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

import anyio
import orjson

from pd_router.errors import StateUnavailable
from pd_router.shared.pool import answered
from pd_router.shared.redis import RETRY, Outage, Redis, RedisError, RedisUnavailable

log = logging.getLogger("pd_router.remote_abort")

CHANNEL = "{pdr}:abort"
REPLIES = "{pdr}:abort-reply:"
# Every router answers within a round trip of Redis; a second covers a busy one.
WAIT = 1.0

# An abort done here: (status, document) as the admin API answers it; 404: not held here.
Outcome = tuple[int, dict[str, Any]]


class RemoteAborts:
    def __init__(self, redis: Redis, router_id: str, local: Callable[[str], Outcome]) -> None:
        self.redis = redis
        self.router_id = router_id
        self.local = local
        self._waiting: dict[str, tuple[anyio.Event, list[Outcome]]] = {}

    async def abort(self, request_id: str) -> Outcome | None:
        """Abort ``request_id`` on the router that holds it; None if none answered.
        ``StateUnavailable`` if the others cannot be asked."""
        token = secrets.token_hex(8)
        done, answers = self._waiting[token] = (anyio.Event(), [])
        ask = {"id": request_id, "router": self.router_id, "token": token}
        try:
            await self.redis.call("PUBLISH", CHANNEL, orjson.dumps(ask))
            with anyio.move_on_after(WAIT):
                await done.wait()
        except RedisUnavailable as exc:
            raise StateUnavailable(f"shared state unavailable: {exc}") from None
        except RedisError as error:
            log.error("abort: redis %s answered: %s", self.redis.settings.address, error)
            raise answered(self.redis, error) from None
        finally:
            del self._waiting[token]
        return answers[0] if answers else None

    async def run(self) -> None:
        """Hear the other routers' aborts, and the answers to this one's."""
        outage = Outage(log, "abort channel")
        while True:
            try:
                async with self.redis.subscribe(CHANNEL, REPLIES + self.router_id) as channel:
                    outage.subscribed()
                    while True:
                        name, data = await channel.next_message()
                        try:
                            message = orjson.loads(data)
                        except orjson.JSONDecodeError:
                            # Not a router's: skipped, and the channel kept (an abort
                            # published while it was made again would be lost).
                            message = None
                        if not isinstance(message, dict):
                            log.error("abort channel: %r is not an abort; skipped", data[:200])
                        elif name.decode() == CHANNEL:
                            await self._asked(message)
                        else:
                            self._answered(message)
            except (RedisUnavailable, RedisError) as exc:
                outage.lost(exc)
                await anyio.sleep(RETRY)

    async def _asked(self, message: dict[str, Any]) -> None:
        if message.get("router") == self.router_id:
            return
        status, document = self.local(str(message.get("id")))
        if status == 404:
            return
        answer = {"token": message.get("token"), "status": status, "document": document}
        await self.redis.call("PUBLISH", REPLIES + str(message.get("router")), orjson.dumps(answer))

    def _answered(self, message: dict[str, Any]) -> None:
        waiting = self._waiting.get(str(message.get("token")))
        status, document = message.get("status"), message.get("document")
        if not isinstance(status, int) or not isinstance(document, dict):
            log.error("abort channel: %r is not an answer; skipped", message)
        elif waiting is not None:
            done, answers = waiting
            answers.append((status, document))
            done.set()

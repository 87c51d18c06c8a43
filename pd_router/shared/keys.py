"""Requests in flight per client key across every router on one Redis (``--state``).

Each router keeps its own counts (``fleet/keys.py``) and is the only writer of its hash in
Redis, which it replaces whole at every call, under its lease: the fleet's count of a key
is the sum over the routers whose lease runs (``scripts.KEYS_SYNC``). So counts heal by
themselves from the faults a shared counter suffers:

* a call that timed out yet ran (its reply lost): the caller was refused (503) and counted
  nothing here; the router's next call writes its true counts over Redis's;
* a release lost with Redis away: the same; the next call (a release sends one, and a
  router holding anything sends one every third of its lease) corrects it;
* a router killed or cut off: its hash expires with its lease, and with it its requests.

All of a router's calls go through one worker, one at a time, each carrying every request
asking to enter since the last one: a burst costs a round trip, not one per request. A
call given up on (no reply in time) may still run late, after the next ones, and write
back counts the router no longer has: calls are numbered, and Redis refuses one whose
number is not above the last it ran. A failed call (its outcome unknown) is followed by
another soon, whatever it carried, so that what Redis counts is this router's again.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Awaitable, Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pd_router.errors import StateUnavailable, fresh
from pd_router.fleet.keys import KeyLimits, refused
from pd_router.shared import scripts
from pd_router.shared.pool import LEASE, ErrorReplies, SharedPool, noting
from pd_router.shared.redis import RETRY, Redis, RedisError, RedisUnavailable, Script

log = logging.getLogger("pd_router.shared_keys")

_SYNC = Script(scripts.KEYS_SYNC, noting(2), each=0)
# The asks of a call that neither answered nor failed on the store (``_work`` stopped).
_INTERRUPTED = StateUnavailable("shared state unavailable: the call for the key counts ended")


class _Ask:
    __slots__ = ("name", "limit", "done", "counted", "error")

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.done = anyio.Event()
        self.counted = False
        self.error: StateUnavailable | None = None


# An ask, or None: "my counts changed, tell Redis" (a release).
_Job = _Ask | None


class SharedKeyLimits(KeyLimits):
    def __init__(self, redis: Redis, lease: float = LEASE) -> None:
        super().__init__()
        self.redis = redis
        self.lease = lease
        self.router_id = secrets.token_hex(8)
        jobs: tuple[MemoryObjectSendStream[_Job], MemoryObjectReceiveStream[_Job]]
        jobs = anyio.create_memory_object_stream(math.inf)
        self._jobs, self._pending = jobs
        self._errors = ErrorReplies("shared key counts")
        self._calls = 0  # the number of the last call sent

    def background(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        return [("the shared key counts", self._work)]

    async def enter(self, name: str, limit: int) -> None:
        ask = _Ask(name, limit)
        self._jobs.send_nowait(ask)
        # Shielded: a count taken for a request that is not told so would never be
        # released here (the next call would still heal Redis, but not this router).
        with anyio.CancelScope(shield=True):
            await ask.done.wait()
        if ask.error is not None:
            raise fresh(ask.error)
        if not ask.counted:
            raise refused(limit)

    def leave(self, name: str) -> None:
        super().leave(name)
        self._jobs.send_nowait(None)

    async def _work(self) -> None:
        while True:
            batch: list[_Job] = []
            # A router holding requests renews its lease on them even when nothing moves.
            with anyio.move_on_after(self.lease / 3 if self.in_flight else math.inf):
                batch.append(await self._pending.receive())
            batch += self._drained()
            asks = [job for job in batch if job is not None]
            failed = False
            try:
                await self._sync(asks)
            except BaseException as exc:
                # Every ask is answered, whatever ended the call (this task stopping, a
                # bug): a request waits for its answer shielded, and would wait forever.
                failed = True
                error = exc if isinstance(exc, StateUnavailable) else _INTERRUPTED
                if error is _INTERRUPTED:
                    # Those queued meanwhile: their call will not come either.
                    asks += [job for job in self._drained() if job is not None]
                for ask in asks:
                    ask.error = error
                if error is _INTERRUPTED:
                    raise
            finally:
                for ask in asks:
                    ask.done.set()
            if failed:
                # The call may have run (a lost reply: an ask counted that was refused here)
                # or not (a release Redis never heard): tell it again soon, as nothing else
                # may call for a lease (a router that holds nothing does not renew).
                await anyio.sleep(RETRY)
                self._jobs.send_nowait(None)

    def _drained(self) -> list[_Job]:
        """The jobs waiting, taken."""
        jobs: list[_Job] = []
        while True:
            try:
                jobs.append(self._pending.receive_nowait())
            except anyio.WouldBlock:
                return jobs

    async def _sync(self, asks: list[_Ask]) -> None:
        held = [item for name, count in self.in_flight.items() for item in (name, str(count))]
        self._calls += 1
        lease = str(int(self.lease * 1000))
        args = [self.router_id, lease, str(self._calls), str(len(held) // 2), *held]
        for ask in asks:
            args += [ask.name, str(ask.limit)]
        try:
            replies, bad = await _SYNC.run(self.redis, (), args, asked=len(asks))
        except RedisUnavailable as exc:
            raise StateUnavailable(f"shared state unavailable: {exc}") from None
        except RedisError as error:
            raise self._errors.answered(self.redis, error) from None
        self._errors.cleared()
        SharedPool.noted(bad)
        for ask, counted in zip(asks, replies, strict=True):
            if counted:
                ask.counted = True
                self.in_flight[ask.name] = self.in_flight.get(ask.name, 0) + 1

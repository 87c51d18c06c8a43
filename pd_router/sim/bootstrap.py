"""SGLang's P/D dialect ("bootstrap"): the fields its router adds to a request, and the rooms
a prefill engine holds computed prompts in until a decode engine takes them.

SGLang's router sends one body to a prefill and a decode engine at once, naming the prefill's
bootstrap server (``bootstrap_host``, ``bootstrap_port``) and a random ``bootstrap_room`` for
this request's KV. The sim's decode engine fetches the room's tokens with
``POST /sglang/bootstrap`` on the prefill's HTTP port, where real SGLang's decode engine meets
the prefill's bootstrap server on its own port and then receives the KV over Mooncake or NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeGuard

import anyio

from pd_router.sim.asgi import ApiError

BOOTSTRAP_PATH = "/sglang/bootstrap"
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# SGLang's router draws a room with random.randint(0, 2**63 - 1).
MAX_ROOM = 2**63 - 1
# Rooms taken or forgotten that a take still fails at once, instead of after the timeout.
REMEMBERED_ROOMS = 1 << 16


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's KV waits: the prefill's bootstrap server and the room."""

    host: str
    port: int
    room: int

    @property
    def address(self) -> str:
        # The host as the router sent it: SGLang's router already brackets an IPv6 address.
        return f"{self.host}:{self.port}"

    @property
    def pull_url(self) -> str:
        return f"http://{self.address}{BOOTSTRAP_PATH}"

    @property
    def pull_request(self) -> dict[str, Any]:
        return {"room": self.room}


def is_room(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_ROOM


def carries_bootstrap(body: dict[str, Any]) -> bool:
    return any(body.get(key) is not None for key in BOOTSTRAP_FIELDS)


def parse_bootstrap(body: dict[str, Any]) -> Bootstrap:
    """The body's bootstrap fields; raises ApiError naming the first one missing or wrong."""
    for key in BOOTSTRAP_FIELDS:
        value = body.get(key)
        if value is None:
            raise ApiError(
                f"{key} is missing: the sglang dialect needs bootstrap_host, bootstrap_port "
                "and bootstrap_room",
                key,
            )
        if isinstance(value, list):
            # SGLang's batch form: one room per prompt of a list.
            raise ApiError(
                f"{key} is a list: the sim takes one prompt per request, with one room", key
            )
    host, port, room = (body[key] for key in BOOTSTRAP_FIELDS)
    if not isinstance(host, str) or not host:
        raise ApiError("bootstrap_host must be a non-empty string", "bootstrap_host")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ApiError("bootstrap_port must be an integer in [1, 65535]", "bootstrap_port")
    if not is_room(room):
        raise ApiError("bootstrap_room must be an integer in [0, 2**63 - 1]", "bootstrap_room")
    return Bootstrap(host, port, room)


class RoomInUse(Exception):
    pass


class RoomUnavailable(Exception):
    pass


@dataclass
class _Room:
    # Set when the prompt's tokens are held, or when the room closes without them.
    ready: anyio.Event = field(default_factory=anyio.Event)
    taken: anyio.Event = field(default_factory=anyio.Event)
    tokens: list[str] | None = None
    # A prefill request owns the room (a take may have opened it first, to wait for one).
    claimed: bool = False
    forgotten: bool = False
    waiters: int = 0


class BootstrapRooms:
    """The prefill side: a request claims its room, computes, holds its tokens there until a
    decode engine takes them or ``timeout`` passes, then releases it. A take waits up to
    ``timeout`` for the tokens, since it may come before the prefill request does."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._open: dict[int, _Room] = {}
        # room -> taken (else forgotten), oldest first.
        self._closed: dict[int, bool] = {}

    @property
    def held(self) -> int:
        """Rooms whose tokens wait for a decode engine."""
        return sum(r.tokens is not None and not r.taken.is_set() for r in self._open.values())

    @property
    def awaited(self) -> int:
        """Takes waiting for their room's tokens."""
        return sum(room.waiters for room in self._open.values())

    def claim(self, room: int) -> None:
        entry = self._open.get(room)
        if entry is not None and entry.claimed:
            raise RoomInUse(f"bootstrap room {room} is in use by another request")
        # A room closed before may serve a new request: a router's retry, say.
        self._closed.pop(room, None)
        if entry is None:
            entry = self._open[room] = _Room()
        entry.claimed = True

    async def hold(self, room: int, tokens: list[str]) -> bool:
        """Offer the claimed room's tokens; whether a decode engine took them in time."""
        entry = self._open[room]
        entry.tokens = tokens
        entry.ready.set()
        with anyio.move_on_after(self.timeout):
            await entry.taken.wait()
        return entry.taken.is_set()

    def release(self, room: int) -> None:
        """The claiming request is over: a room not taken by now is forgotten."""
        entry = self._open.pop(room)
        entry.forgotten = not entry.taken.is_set()
        entry.tokens = None
        # Wakes the takes still waiting, to fail now rather than at their timeout.
        entry.ready.set()
        self._closed[room] = not entry.forgotten
        while len(self._closed) > REMEMBERED_ROOMS:
            del self._closed[next(iter(self._closed))]

    async def take(self, room: int) -> list[str]:
        """The room's tokens, once held; raises RoomUnavailable if it never is in time, or
        was taken or forgotten."""
        if room in self._closed:
            raise RoomUnavailable(self._closed_message(room, taken=self._closed[room]))
        entry = self._open.setdefault(room, _Room())
        entry.waiters += 1
        try:
            with anyio.move_on_after(self.timeout):
                await entry.ready.wait()
        finally:
            entry.waiters -= 1
            if not entry.claimed and not entry.waiters and self._open.get(room) is entry:
                del self._open[room]
        if entry.taken.is_set() or entry.forgotten:
            raise RoomUnavailable(self._closed_message(room, taken=entry.taken.is_set()))
        if entry.tokens is None:
            raise RoomUnavailable(
                f"no prompt was computed for bootstrap room {room} within {self.timeout:g} s"
            )
        entry.taken.set()
        return entry.tokens

    @staticmethod
    def _closed_message(room: int, taken: bool) -> str:
        if taken:
            return f"bootstrap room {room} was already taken"
        return (
            f"bootstrap room {room} was forgotten: its prefill request ended before a decode "
            "engine took it"
        )

"""Requests in flight per client key, for the keys with a ``max_in_flight``
(``--api-keys-file``): past it, that key's next request is refused (429
``rate_limit_exceeded``) and no other key is affected. No I/O.

This is the in-process count; with ``--state`` the count is the fleet's
(``shared/keys.py``). ``enter`` raises having counted nothing, or counts the request; the
caller calls ``leave`` in a ``finally`` right after, on every exit path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pd_router.errors import RateLimited


class KeyLimits:
    def __init__(self) -> None:
        # Key name -> requests in flight; only keys with some in flight are here.
        self.in_flight: dict[str, int] = {}

    def background(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        return []

    async def enter(self, name: str, limit: int) -> None:
        count = self.in_flight.get(name, 0)
        if count >= limit:
            raise refused(limit)
        self.in_flight[name] = count + 1

    def leave(self, name: str) -> None:
        """Synchronous, so that it is safe in a ``finally`` of a cancelled scope."""
        count = self.in_flight[name] - 1
        if count:
            self.in_flight[name] = count
        else:
            del self.in_flight[name]


def refused(limit: int) -> RateLimited:
    noun = "request" if limit == 1 else "requests"
    return RateLimited(
        f"this API key has its limit of {limit} {noun} in flight (max_in_flight); "
        "retry when one has finished"
    )

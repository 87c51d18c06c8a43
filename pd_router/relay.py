"""One request, top to bottom: reserve a decode slot -> prefill -> decode -> stream back.

The relay is the request's ASGI response, so the one cleanup point is its own ``__call__``:
the slot and every upstream connection are released there, in every exit path, including
a client that left before the first byte (a body generator's ``finally`` would not run).

Cancellation contract:

* uvicorn never cancels the app when a client leaves; a watcher task reads ``receive()``
  and cancels the relay on ``http.disconnect``. Queued: the waiter leaves the queue at
  once. Prefill or decode: the upstream connection is closed, so the engine aborts.
* The hand-off (prefill answered -> decode engine accepted) is shielded: the prefill
  engine holds the KV until the decode engine pulls it or a lease runs out, so a client
  leaving there must not strand it. If the client is already gone when decode starts, a
  one-token "drain" request is sent instead; either way the wait for the decode engine's
  headers is bounded by ``handoff_grace`` once the client has left.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
from starlette.types import Receive, Scope, Send

from . import handshake
from .errors import RouterError, UpstreamError
from .nodes import RoundRobin
from .pool import DecodePool
from .response import ClientStream
from .sse import EventRelay, patch_usage
from .upstream import Response, Upstream
from .validation import PATHS, Endpoint

log = logging.getLogger("pd_router")

OUTCOMES = (
    "ok",
    "client_aborted",
    "rejected_busy",
    "rejected_timeout",
    "prefill_error",
    "decode_error",
    "bad_request",
    "internal_error",
)


@dataclass
class Settings:
    queue_timeout: float = 0.0
    handoff_grace: float = 5.0


@dataclass
class Router:
    """What every request shares."""

    pool: DecodePool
    prefill: RoundRobin
    upstream: Upstream
    settings: Settings = field(default_factory=Settings)
    outcomes: dict[tuple[Endpoint, str], int] = field(default_factory=dict)

    def count(self, endpoint: Endpoint, outcome: str) -> None:
        key = (endpoint, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1


class Relay:
    def __init__(
        self, router: Router, endpoint: Endpoint, body: dict[str, Any], request_id: str
    ) -> None:
        self.router = router
        self.endpoint = endpoint
        self.path = PATHS[endpoint]
        self.body = body
        self.request_id = request_id
        self.stream = bool(body.get("stream"))
        self.client_gone = False
        self.outcome = "rejected_busy"
        self._handoff: anyio.CancelScope | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = ClientStream(send, self.request_id)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                try:
                    await self._run(client)
                except RouterError as error:
                    self.outcome = error.outcome or self.outcome
                    await client.fail(error)
                except Exception:
                    log.exception("request %s failed inside the router", self.request_id)
                    self.outcome = "internal_error"
                    await client.fail(RouterError("internal router error"))
                tg.cancel_scope.cancel()
        finally:
            # uvicorn also reports a disconnect once a response is complete: only a client
            # that left before its answer was finished abandoned the request.
            if self.client_gone and not client.finished:
                self.outcome = "client_aborted"
            self.router.count(self.endpoint, self.outcome)

    async def _watch(self, receive: Receive, relay: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        if self._handoff is not None:
            self._handoff.deadline = min(
                self._handoff.deadline, anyio.current_time() + self.router.settings.handoff_grace
            )
        relay.cancel()

    async def _run(self, client: ClientStream) -> None:
        router = self.router
        async with (
            router.pool.reserve(router.settings.queue_timeout) as reservation,
            AsyncExitStack() as upstream,
        ):
            node = reservation.node
            if reservation.waited > 0.1:
                log.info(
                    "queued %.1fs for decode node %s request_id=%s",
                    reservation.waited,
                    node.url,
                    self.request_id,
                )
            self.outcome = "prefill_error"
            prefilled = await self._prefill()
            self.outcome = "decode_error"
            answer = await self._handoff_to(upstream, node.url + self.path, prefilled)
            if answer is None or self.client_gone:
                return
            if answer.status != 200:
                raise await answer.error()
            if self.stream:
                await self._relay_events(client, answer, prefilled)
            else:
                await self._relay_json(client, answer, prefilled)
            self.outcome = "ok"

    async def _prefill(self) -> handshake.Prefilled:
        url = self.router.prefill.pick().url + self.path
        body = handshake.prefill_body(self.body)
        async with self.router.upstream.post(url, body, self.request_id) as answer:
            if answer.status != 200:
                raise await answer.error()
            raw = await answer.read()
        try:
            return handshake.Prefilled(orjson.loads(raw))
        except orjson.JSONDecodeError:
            raise UpstreamError(f"{url}: prefill answer is not JSON") from None

    async def _handoff_to(
        self, upstream: AsyncExitStack, url: str, prefilled: handshake.Prefilled
    ) -> Response | None:
        """Send the decode request; shielded until the decode engine has taken it.

        Returns None when the client left and the engine did not answer within the grace.
        """
        params = prefilled.kv_transfer_params
        with anyio.CancelScope(shield=True) as handoff:
            self._handoff = handoff
            try:
                drain = self.client_gone
                if drain:
                    handoff.deadline = anyio.current_time() + self.router.settings.handoff_grace
                    body = handshake.drain_body(self.body, params)
                else:
                    body = handshake.decode_body(self.body, params)
                post = self.router.upstream.post(url, body, self.request_id)
                answer = await upstream.enter_async_context(post)
                if drain and answer.status == 200:
                    # Read the drain's one token: by then the KV has been pulled.
                    await answer.read()
                return answer
            finally:
                self._handoff = None
        return None

    async def _relay_events(
        self, client: ClientStream, answer: Response, prefilled: handshake.Prefilled
    ) -> None:
        events = EventRelay(prefilled.fix_usage)
        await client.start_events()
        try:
            async for data in answer.chunks():
                ready = events.feed(data)
                if ready:
                    await client.write(ready)
        except ValueError as exc:
            raise UpstreamError(f"{answer.url}: {exc}") from None
        if not events.done:
            raise UpstreamError(f"{answer.url}: decode stream ended without [DONE]")
        await client.end_events()

    async def _relay_json(
        self, client: ClientStream, answer: Response, prefilled: handshake.Prefilled
    ) -> None:
        raw = await answer.read()
        await client.respond(200, patch_usage(raw, prefilled.fix_usage))

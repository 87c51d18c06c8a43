"""The prefill engine: a vLLM ``kv_producer`` that computes a prompt and pins its KV blocks.

A request must carry ``kv_transfer_params.do_remote_decode: true``. After
``prefill_delay`` seconds the prompt's tokens are pinned under a lease and the response's
``kv_transfer_params`` tell a decode engine where to pull them: ``POST /kv/pull`` on this
same HTTP port stands in for NIXL's side channel and transfer.

With ``--dialect sglang`` a request carries SGLang's bootstrap fields instead (``bootstrap.py``)
and may stream. The computed prompt's tokens are held in its ``bootstrap_room`` until a decode
engine takes them with ``POST /sglang/bootstrap`` ``{"room": N}`` on this same port, and only
then does the request get its answer, that of an engine that generated one token. A room no
decode engine takes within ``--bootstrap-timeout`` is a 500, and is forgotten, as is the room
of a request whose client hung up.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

from pd_router.sim.asgi import ApiError, Exchange
from pd_router.sim.bootstrap import (
    BOOTSTRAP_PATH,
    BootstrapRooms,
    RoomInUse,
    RoomUnavailable,
    is_room,
    parse_bootstrap,
)
from pd_router.sim.config import EngineSettings, SimConfig
from pd_router.sim.engine import Engine, Job, Outcome
from pd_router.sim.kvcache import PinnedBlocks, PrefixCache
from pd_router.sim.payloads import JSON, full_response, token_text, usage
from pd_router.sim.tokens import token_id

if TYPE_CHECKING:
    from pd_router.sim.events import Publisher


class PrefillEngine(Engine):
    def __init__(self, settings: EngineSettings, config: SimConfig) -> None:
        super().__init__(settings, config)
        self.blocks = PinnedBlocks(settings.block_size, settings.kv_lease)
        self.prefix_cache = PrefixCache(settings.block_size, settings.prefix_cache_blocks)
        self.compute = anyio.CapacityLimiter(settings.prefill_concurrency)
        # vLLM's KV events (``--kv-events-port``), published from startup.
        self.events: Publisher | None = None
        self.rooms = BootstrapRooms(settings.bootstrap_timeout)
        if settings.dialect == "sglang":
            self.add_route("POST", BOOTSTRAP_PATH, self._bootstrap)
        else:
            self.add_route("POST", "/kv/pull", self._kv_pull)

    def maintain(self) -> None:
        self.counters.blocks_expired += self.blocks.expire()

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats["blocks_pinned"] = self.blocks.blocks_pinned
        stats["prefix_cache_blocks"] = self.prefix_cache.blocks
        stats["rooms_held"] = self.rooms.held
        stats["rooms_awaited"] = self.rooms.awaited
        if self.events is not None:
            stats["kv_event_batches"] = self.events.published
        return stats

    def reset(self) -> None:
        self.prefix_cache.clear()
        if self.events is not None:
            self.events.publish(self.events.cleared())

    async def startup(self) -> None:
        port = self.settings.kv_events_port
        if port is not None:
            from pd_router.sim.events import Publisher

            self.events = Publisher(self.settings.host, port, self.settings.block_size)

    async def shutdown(self) -> None:
        if self.events is not None:
            self.events.close()

    def prepare(self, job: Job) -> None:
        if self.settings.dialect == "sglang":
            parse_bootstrap(job.body)
            return
        params = job.body.get("kv_transfer_params")
        if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
            raise ApiError(
                "the sim prefill engine requires kv_transfer_params with do_remote_decode: true",
                "kv_transfer_params",
            )
        if job.stream:
            raise ApiError("the sim prefill engine does not stream; send stream: false", "stream")

    async def generate(self, exchange: Exchange, job: Job) -> Outcome:
        if self.settings.dialect == "sglang":
            return await self._generate_for_room(exchange, job)
        tokens = job.prompt_tokens
        cached = await self._prefill(job)
        block_ids = [] if cached is None else self.blocks.pin(job.request_id, tokens)
        body = self._first_token_body(
            job,
            cached or 0,
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": block_ids,
                "remote_engine_id": self.settings.engine_id,
                "remote_request_id": job.request_id,
                "remote_host": self.settings.host,
                "remote_port": self.settings.port,
                "tp_size": 1,
            },
        )
        if job.body.get("return_token_ids") is True:
            ids = [token_id(token) for token in tokens]
            if job.chat:
                body["prompt_token_ids"] = ids
            else:
                body["choices"][0]["prompt_token_ids"] = ids
        if cached is None:
            await exchange.respond_truncated(body)
            return Outcome.CRASHED
        await exchange.respond(200, body)
        return Outcome.COMPLETED

    async def _prefill(self, job: Job) -> int | None:
        """Compute the prompt: the tokens the prefix cache served, or None when the response
        is to be cut (``fail_after_tokens``), which stores, counts and publishes nothing."""
        tokens = job.prompt_tokens
        config = self.config
        async with self.compute:
            # Compute is spent on what the cache holds when the prefill starts.
            cached, hashes = self.prefix_cache.lookup(tokens)
            await anyio.sleep(
                config.prefill_delay + config.prefill_per_token * (len(tokens) - cached)
            )
        if config.fail_after_tokens is not None:
            return None
        stored, removed = self.prefix_cache.insert(hashes)
        if self.events is not None:
            publisher = self.events
            publisher.publish(publisher.stored(stored, hashes, tokens) + publisher.removed(removed))
        self.counters.prompt_tokens += len(tokens)
        self.counters.cached_tokens += cached
        return cached

    def _first_token_body(self, job: Job, cached: int, kv_transfer_params: JSON | None) -> JSON:
        """The answer of an engine that generated one token: the prompt's first."""
        tokens = job.prompt_tokens
        return full_response(
            request_id=job.request_id,
            chat=job.chat,
            model=self.settings.model,
            created=int(time.time()),
            text=token_text(tokens[0]),
            usage_body=usage(len(tokens), 1, cached),
            kv_transfer_params=kv_transfer_params,
        )

    async def _generate_for_room(self, exchange: Exchange, job: Job) -> Outcome:
        """SGLang's prefill: compute, hold the tokens in the request's bootstrap room, and
        answer only once a decode engine took them."""
        room = parse_bootstrap(job.body).room
        try:
            self.rooms.claim(room)
        except RoomInUse as exc:
            await exchange.respond_error(400, str(exc), "bootstrap_room")
            return Outcome.FAILED
        try:
            cached = await self._prefill(job)
            if cached is None:
                await exchange.respond_truncated(self._first_token_body(job, 0, None))
                return Outcome.CRASHED
            taken = await self.rooms.hold(room, job.prompt_tokens)
        finally:
            # Also when the router hangs up: a room it no longer waits for is forgotten.
            self.rooms.release(room)
        if not taken:
            self.counters.bootstrap_timeouts += 1
            timeout = self.rooms.timeout
            message = f"no decode engine took bootstrap room {room} within {timeout:g} s"
            await exchange.respond_error(500, message)
            return Outcome.FAILED
        if not job.stream:
            await exchange.respond(200, self._first_token_body(job, cached, None))
            return Outcome.COMPLETED
        created = int(time.time())
        text = token_text(job.prompt_tokens[0])
        await self.start_token_stream(exchange, job, created)
        await exchange.send_body(self.token_event(job, created, text, "length"), more=True)
        usage_body = usage(len(job.prompt_tokens), 1, cached)
        await self.end_token_stream(exchange, job, created, usage_body)
        return Outcome.COMPLETED

    async def _bootstrap(self, exchange: Exchange) -> None:
        """A decode engine takes a room's tokens, waiting for them to be computed."""
        request = await exchange.read_json_object()
        if request is None:
            return
        room = request.get("room")
        if not is_room(room):
            raise ApiError("a bootstrap request needs an integer room in [0, 2**63 - 1]", "room")
        # A decode engine that hangs up stops waiting, and takes nothing.
        await exchange.run_until_disconnect(lambda: self._take(exchange, room))

    async def _take(self, exchange: Exchange, room: int) -> None:
        try:
            tokens = await self.rooms.take(room)
        except RoomUnavailable as exc:
            await exchange.respond_error(404, str(exc))
            return
        self.counters.rooms_taken += 1
        self.counters.transfers += 1
        await exchange.respond(200, {"tokens": tokens})

    async def _kv_pull(self, exchange: Exchange) -> None:
        request = await exchange.read_json_object()
        if request is None:
            return
        engine_id = request.get("engine_id")
        request_id = request.get("request_id")
        block_ids = request.get("block_ids")
        if (
            not isinstance(engine_id, str)
            or not isinstance(request_id, str)
            or not isinstance(block_ids, list)
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids)
        ):
            raise ApiError("a pull needs string engine_id and request_id and int block_ids")
        if engine_id != self.settings.engine_id:
            raise ApiError(
                f"this is engine {self.settings.engine_id!r}, not {engine_id!r}", status=404
            )
        tokens = self.blocks.pull(request_id, block_ids)
        if tokens is None:
            raise ApiError(
                f"no KV blocks {block_ids} pinned for request {request_id!r}: unknown, "
                "expired or already pulled",
                status=404,
            )
        self.counters.transfers += 1
        await exchange.respond(200, {"tokens": tokens})

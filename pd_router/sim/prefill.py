"""The prefill engine: a vLLM ``kv_producer`` that computes a prompt and pins its KV blocks.

A request must carry ``kv_transfer_params.do_remote_decode: true``. After
``prefill_delay`` seconds the prompt's tokens are pinned under a lease and the response's
``kv_transfer_params`` tell a decode engine where to pull them: ``POST /kv/pull`` on this
same HTTP port stands in for NIXL's side channel and transfer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

from pd_router.sim.asgi import ApiError, Exchange
from pd_router.sim.config import EngineSettings, SimConfig
from pd_router.sim.engine import Engine, Job, Outcome
from pd_router.sim.kvcache import PinnedBlocks, PrefixCache
from pd_router.sim.payloads import full_response, token_text, usage
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
        self.add_route("POST", "/kv/pull", self._kv_pull)

    def maintain(self) -> None:
        self.counters.blocks_expired += self.blocks.expire()

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats["blocks_pinned"] = self.blocks.blocks_pinned
        stats["prefix_cache_blocks"] = self.prefix_cache.blocks
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
        params = job.body.get("kv_transfer_params")
        if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
            raise ApiError(
                "the sim prefill engine requires kv_transfer_params with do_remote_decode: true",
                "kv_transfer_params",
            )
        if job.stream:
            raise ApiError("the sim prefill engine does not stream; send stream: false", "stream")

    async def generate(self, exchange: Exchange, job: Job) -> Outcome:
        tokens = job.prompt_tokens
        config = self.config
        async with self.compute:
            # Compute is spent on what the cache holds when the prefill starts.
            cached, hashes = self.prefix_cache.lookup(tokens)
            await anyio.sleep(
                config.prefill_delay + config.prefill_per_token * (len(tokens) - cached)
            )
        crash = config.fail_after_tokens is not None
        if crash:
            cached = 0
        else:
            stored, removed = self.prefix_cache.insert(hashes)
            if self.events is not None:
                publisher = self.events
                publisher.publish(
                    publisher.stored(stored, hashes, tokens) + publisher.removed(removed)
                )
            self.counters.prompt_tokens += len(tokens)
            self.counters.cached_tokens += cached
        block_ids = [] if crash else self.blocks.pin(job.request_id, tokens)
        body = full_response(
            request_id=job.request_id,
            chat=job.chat,
            model=self.settings.model,
            created=int(time.time()),
            text=token_text(tokens[0]),
            usage_body=usage(len(tokens), 1, cached),
            kv_transfer_params={
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
        if crash:
            await exchange.respond_truncated(body)
            return Outcome.CRASHED
        await exchange.respond(200, body)
        return Outcome.COMPLETED

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

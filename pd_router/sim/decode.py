"""The decode engine: a vLLM ``kv_consumer`` that pulls a prefill's KV and generates.

Order of a request: wait for one of ``--slots`` (FIFO), ``accept_delay``, pull the blocks
from the prefill engine named in ``kv_transfer_params``, and only then send response
headers, so a router that has the headers knows the KV arrived. A non-streaming response
sends headers and body together at the end, as vLLM does.

Output is derived only from the pulled tokens, never from the body's prompt: output token
``i`` is ``pulled[i % len(pulled)]`` and its text is ``" " + token`` (the first token too).
Usage reports ``prompt_tokens = len(pulled)``, all of them cached, like vLLM after a remote
prefill.

With ``--standalone`` a body without ``kv_transfer_params`` is served as a vLLM
``kv_consumer`` serves it (a local prefill): the body's own prompt tokens, computed after
``prefill_delay`` + ``prefill_per_token`` x the tokens not in this engine's prefix cache
instead of a pull. The prefix cache holds what the engine computed and what it pulled, as
vLLM caches a transferred prompt's blocks like its own.

With ``--dialect sglang`` the body carries SGLang's ``bootstrap_host``, ``bootstrap_port``
and ``bootstrap_room`` instead (``bootstrap.py``), and the pull is ``POST /sglang/bootstrap``
``{"room": N}`` to that host and port, which answers once the prefill engine, sent the same
body at the same time, has computed the room's prompt. With ``--standalone`` a body without
any of the three is a local prefill.

With ``--name-prefill`` (the demo's) an answer's text starts with ``[prefill HOST:PORT]``,
the prefill engine whose KV it pulled, for a person who wants to see where it went.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import orjson

from pd_router.sim.asgi import ApiError, Exchange
from pd_router.sim.bootstrap import Bootstrap, carries_bootstrap, parse_bootstrap
from pd_router.sim.config import EngineSettings, SimConfig
from pd_router.sim.engine import Engine, Job, Outcome
from pd_router.sim.kvcache import PrefixCache
from pd_router.sim.payloads import JSON, full_response, token_text, usage

PULL_TIMEOUT = aiohttp.ClientTimeout(total=30)


@dataclass(frozen=True)
class RemotePrefill:
    """Where the prompt's KV blocks wait, from the prefill's ``kv_transfer_params``."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def pull_url(self) -> str:
        return f"http://{self.address}/kv/pull"

    @property
    def pull_request(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "request_id": self.request_id,
            "block_ids": self.block_ids,
        }


# Where a request's KV is fetched from, in either dialect.
Remote = RemotePrefill | Bootstrap


class PullError(Exception):
    pass


def parse_remote_prefill(params: object) -> RemotePrefill:
    if isinstance(params, dict) and params.get("do_remote_prefill") is True:
        engine_id = params.get("remote_engine_id")
        request_id = params.get("remote_request_id")
        block_ids = params.get("remote_block_ids")
        host = params.get("remote_host")
        port = params.get("remote_port")
        if (
            isinstance(engine_id, str)
            and isinstance(request_id, str)
            and isinstance(block_ids, list)
            and all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids)
            and isinstance(host, str)
            and isinstance(port, int)
            and not isinstance(port, bool)
        ):
            return RemotePrefill(engine_id, request_id, block_ids, host, port)
    raise ApiError("missing or invalid kv_transfer_params", "kv_transfer_params")


class DecodeEngine(Engine):
    _session: aiohttp.ClientSession | None = None
    _slots: anyio.Semaphore | None = None

    def __init__(self, settings: EngineSettings, config: SimConfig) -> None:
        super().__init__(settings, config)
        self.prefix_cache = PrefixCache(settings.block_size, settings.prefix_cache_blocks)

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats["prefix_cache_blocks"] = self.prefix_cache.blocks
        return stats

    def reset(self) -> None:
        self.prefix_cache.clear()

    async def startup(self) -> None:
        # One pooled session per engine, like NIXL's one agent per engine. A pull happens in
        # a slot, so a connection per slot: aiohttp's default 100 would make an sglang take,
        # which waits for its room's prompt, hold up the others past it.
        connector = aiohttp.TCPConnector(limit=self.settings.slots)
        self._session = aiohttp.ClientSession(connector=connector, timeout=PULL_TIMEOUT)
        self._slots = anyio.Semaphore(self.settings.slots)

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()

    def prepare(self, job: Job) -> None:
        self._remote(job)

    def _remote(self, job: Job) -> Remote | None:
        """Where the request's KV waits, or None for a local prefill (--standalone, a body
        without the dialect's fields); raises ApiError."""
        body = job.body
        if self.settings.dialect == "sglang":
            if self.settings.standalone and not carries_bootstrap(body):
                return None
            return parse_bootstrap(body)
        params = body.get("kv_transfer_params")
        if params is None and self.settings.standalone:
            return None
        return parse_remote_prefill(params)

    async def generate(self, exchange: Exchange, job: Job) -> Outcome:
        if self._slots is None:
            raise RuntimeError("the decode engine has not started")
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        try:
            return await self._generate_in_slot(exchange, job)
        finally:
            self._slots.release()

    async def _generate_in_slot(self, exchange: Exchange, job: Job) -> Outcome:
        await anyio.sleep(self.config.accept_delay)
        remote = self._remote(job)
        lead = ""
        if remote is None:
            tokens = job.prompt_tokens
            cached, hashes = self.prefix_cache.lookup(tokens)
            await anyio.sleep(
                self.config.prefill_delay + self.config.prefill_per_token * (len(tokens) - cached)
            )
            self.prefix_cache.insert(hashes)
            self.counters.prompt_tokens += len(tokens)
            self.counters.cached_tokens += cached
        else:
            try:
                tokens = await self._pull(remote)
            except PullError as exc:
                self.counters.pull_failures += 1
                await exchange.respond_error(500, f"KV transfer failed: {exc}")
                return Outcome.FAILED
            self.counters.transfers += 1
            cached = len(tokens)
            if self.settings.name_prefill:
                lead = f"[prefill {remote.address}]"
            self.prefix_cache.insert(self.prefix_cache.lookup(tokens)[1])
        if job.stream:
            return await self._stream(exchange, job, tokens, cached, lead)
        return await self._complete(exchange, job, tokens, cached, lead)

    async def _pull(self, remote: Remote) -> list[str]:
        if self._session is None:
            raise RuntimeError("the decode engine has not started")
        try:
            async with self._session.post(
                remote.pull_url,
                data=orjson.dumps(remote.pull_request),
                headers={"content-type": "application/json"},
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PullError(f"{remote.pull_url}: {exc!r}") from None
        try:
            payload: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            payload = None
        if status != 200:
            message = raw.decode(errors="replace")
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                message = str(payload["error"].get("message"))
            raise PullError(f"{remote.pull_url} answered {status}: {message}")
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, str) for t in tokens)
        ):
            raise PullError(f"{remote.pull_url} sent no tokens")
        return tokens

    async def _stream(
        self, exchange: Exchange, job: Job, tokens: list[str], cached: int, lead: str
    ) -> Outcome:
        created = int(time.time())
        count = job.max_tokens
        fail_after = self.config.fail_after_tokens
        await self.start_token_stream(exchange, job, created)
        for i in range(count):
            if i == fail_after:
                return Outcome.CRASHED
            await anyio.sleep(self.config.ttft if i == 0 else self.config.itl)
            while self.config.stall:
                await anyio.sleep(0.05)
            finish = "length" if i == count - 1 else None
            text = (lead if i == 0 else "") + token_text(tokens[i % len(tokens)])
            await exchange.send_body(self.token_event(job, created, text, finish), more=True)
        if fail_after is not None:
            # Asked to fail after at least every token: die before the usage and [DONE].
            return Outcome.CRASHED
        await self.end_token_stream(exchange, job, created, usage(len(tokens), count, cached))
        return Outcome.COMPLETED

    async def _complete(
        self, exchange: Exchange, job: Job, tokens: list[str], cached: int, lead: str
    ) -> Outcome:
        created = int(time.time())
        count = job.max_tokens
        fail_after = self.config.fail_after_tokens
        for i in range(count):
            if i == fail_after:
                break
            await anyio.sleep(self.config.ttft if i == 0 else self.config.itl)
        text = lead + "".join(token_text(tokens[i % len(tokens)]) for i in range(count))
        body: JSON = full_response(
            request_id=job.request_id,
            chat=job.chat,
            model=self.settings.model,
            created=created,
            text=text,
            usage_body=usage(len(tokens), count, cached),
            kv_transfer_params=None,
        )
        if fail_after is not None:
            await exchange.respond_truncated(body)
            return Outcome.CRASHED
        await exchange.respond(200, body)
        return Outcome.COMPLETED

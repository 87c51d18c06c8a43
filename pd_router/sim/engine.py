"""What both simulated engines share: routing, request bookkeeping, stats and knobs.

A role (``prefill.py``, ``decode.py``) validates a generation request in :meth:`prepare`
and serves it in :meth:`generate`; this base class counts it, answers errors, and cancels
``generate`` as soon as the client disconnects.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import anyio

from pd_router.sim.asgi import (
    SSE_DONE,
    ApiError,
    Exchange,
    Receive,
    Scope,
    Send,
    SimulatedCrash,
    sse_event,
)
from pd_router.sim.config import EngineSettings, SimConfig
from pd_router.sim.payloads import JSON, chunk, usage_chunk
from pd_router.sim.tokens import PromptError, request_tokens

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
RECENT_REQUEST_IDS = 1024

Handler = Callable[[Exchange], Awaitable[None]]


class Outcome(enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    # The response was cut on purpose (fail_after_tokens); uvicorn must drop the connection.
    CRASHED = "crashed"


@dataclass
class Counters:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    blocks_expired: int = 0
    transfers: int = 0
    pull_failures: int = 0
    # The most generation requests served at once: the router's slot accounting, seen from
    # the engine's side.
    peak_active: int = 0
    # Prompt tokens prefilled, and those of them served from the prefix cache.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # GET /v1/models answered (or begun): what a router's model reads cost the engine.
    models_requests: int = 0
    # /v1/ requests refused for their Authorization (--api-key).
    unauthorized: int = 0
    # The sglang dialect's prefill: rooms a decode engine took, and rooms none took in time.
    rooms_taken: int = 0
    bootstrap_timeouts: int = 0


@dataclass
class Job:
    """A validated generation request."""

    request_id: str
    chat: bool
    body: dict[str, Any]
    prompt_tokens: list[str]
    max_tokens: int
    stream: bool
    include_usage: bool


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(f"{key} must be a positive integer", key)
    return value


class Engine:
    """Base ASGI app of a simulated engine."""

    def __init__(self, settings: EngineSettings, config: SimConfig) -> None:
        self.settings = settings
        self.config = config
        self.counters = Counters()
        self.request_ids: deque[str] = deque(maxlen=RECENT_REQUEST_IDS)
        # The W3C trace context each generation request came with (None: no header), by
        # request id: what a traced engine (vLLM's --otlp-traces-endpoint) would continue.
        self.trace_contexts: deque[dict[str, str | None]] = deque(maxlen=RECENT_REQUEST_IDS)
        self.active = 0
        self.queued = 0
        self.created = int(time.time())
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("GET", "/sim/stats"): self._stats,
            ("POST", "/sim/reset"): self._reset,
            ("GET", "/sim/config"): self._get_config,
            ("POST", "/sim/config"): self._set_config,
            ("POST", COMPLETIONS): self._completions,
            ("POST", CHAT_COMPLETIONS): self._chat_completions,
        }

    # Hooks for the roles.

    async def startup(self) -> None:
        """Runs on ASGI lifespan startup, inside the server's event loop."""

    async def shutdown(self) -> None:
        """Runs on ASGI lifespan shutdown."""

    def maintain(self) -> None:
        """Runs before every request, for lazy housekeeping such as lease expiry."""

    def reset(self) -> None:
        """``POST /sim/reset``: what the role forgets besides the counters."""

    def prepare(self, job: Job) -> None:
        """Role-specific validation; raises ApiError."""

    async def generate(self, exchange: Exchange, job: Job) -> Outcome:
        raise NotImplementedError

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        self._routes[(method, path)] = handler

    def stats(self) -> dict[str, Any]:
        self.maintain()
        return {
            "role": self.settings.role,
            "engine_id": self.settings.engine_id,
            "model": self.settings.model,
            **asdict(self.counters),
            "active": self.active,
            "queued": self.queued,
            "blocks_pinned": 0,
            "request_ids": list(self.request_ids),
            "trace_contexts": list(self.trace_contexts),
        }

    # ASGI.

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        exchange = Exchange(scope, receive, send)
        if not self._authorized(exchange):
            # vLLM's own answer (its AuthenticationMiddleware), body and all.
            self.counters.unauthorized += 1
            await exchange.respond(401, {"error": "Unauthorized"})
            return
        self.maintain()
        handler = self._routes.get((exchange.method, exchange.path))
        try:
            if handler is not None:
                await handler(exchange)
            elif any(path == exchange.path for _, path in self._routes):
                raise ApiError(f"method {exchange.method} not allowed", status=405)
            else:
                raise ApiError(f"no route for {exchange.path}", status=404)
        except ApiError as exc:
            if not exchange.started:
                await exchange.respond_error(exc.status, exc.message, exc.param)

    def _authorized(self, exchange: Exchange) -> bool:
        """Every ``Authorization`` header of a /v1/ request must be the key (stricter than
        vLLM, which reads the first): a second one, a client's, would be refused."""
        key = self.settings.api_key
        if key is None or not exchange.path.startswith("/v1/"):
            return True
        given = [value for name, value in exchange.scope["headers"] if name == b"authorization"]
        return bool(given) and all(value == b"Bearer " + key.encode() for value in given)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    # Reported to uvicorn, which then exits instead of serving a broken engine.
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # Generation.

    async def _completions(self, exchange: Exchange) -> None:
        await self._generation(exchange, chat=False)

    async def _chat_completions(self, exchange: Exchange) -> None:
        await self._generation(exchange, chat=True)

    async def _generation(self, exchange: Exchange, chat: bool) -> None:
        header_id = exchange.header(b"x-request-id")
        if header_id:
            self.request_ids.append(header_id)
        request_id = header_id or uuid.uuid4().hex
        self.trace_contexts.append(
            {
                "request_id": request_id,
                "traceparent": exchange.header(b"traceparent"),
                "tracestate": exchange.header(b"tracestate"),
            }
        )
        self.counters.requests += 1
        self.active += 1
        self.counters.peak_active = max(self.counters.peak_active, self.active)
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.active -= 1

        # A sequence ends as its last byte leaves, not when this task next runs: on a busy
        # machine the client may have that byte, and have sent the next request, before
        # then, and ``peak_active`` would count both, as if a router had exceeded its slots.
        exchange.on_last_byte = end
        try:
            outcome = await self._serve(exchange, request_id, chat)
        finally:
            end()
        if outcome is None:
            self.counters.aborted += 1
        elif outcome is Outcome.COMPLETED:
            self.counters.completed += 1
        else:
            self.counters.failed += 1
        if outcome is Outcome.CRASHED:
            raise SimulatedCrash

    async def _serve(self, exchange: Exchange, request_id: str, chat: bool) -> Outcome | None:
        """The request's outcome, or None if the client left first."""
        try:
            body = await exchange.read_json_object()
            if body is None:
                return None
            if self.config.fail_status is not None:
                message = self.config.fail_message or "simulated failure"
                raise ApiError(message, status=self.config.fail_status)
            job = self._job(request_id, chat, body)
            self.prepare(job)
        except ApiError as exc:
            await exchange.respond_error(exc.status, exc.message, exc.param)
            return Outcome.FAILED
        return await exchange.run_until_disconnect(lambda: self.generate(exchange, job))

    def _job(self, request_id: str, chat: bool, body: dict[str, Any]) -> Job:
        model = body.get("model")
        if model is not None and model != self.settings.model:
            # vLLM refuses a model name it does not serve.
            raise ApiError(f"The model `{model}` does not exist.", "model", status=404)
        try:
            tokens = request_tokens(body, chat, self.settings.max_model_len)
        except PromptError as exc:
            raise ApiError(exc.message, exc.param) from None
        max_tokens = self._max_tokens(body, len(tokens))
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise ApiError("stream must be a boolean", "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise ApiError("stream_options must be an object", "stream_options")
        include_usage = bool(options and options.get("include_usage"))
        return Job(
            request_id=request_id,
            chat=chat,
            body=body,
            prompt_tokens=tokens,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=include_usage,
        )

    def _max_tokens(self, body: dict[str, Any], prompt_tokens: int) -> int:
        """The tokens to generate, as vLLM 0.32 decides them: more than ``max_model_len``
        asked is a 400 (its message); otherwise what the context has room for after the
        prompt caps the request (the answer then ends with finish_reason "length")."""
        param = (
            "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"
        )
        asked = _positive_int(body, param)
        limit = self.settings.max_model_len
        if asked is not None and asked > limit:
            raise ApiError(
                f"{param}={asked} cannot be greater than max_model_len={limit}. "
                f"Please request fewer output tokens. (parameter={param}, value={asked})",
                param,
            )
        return min(asked or self.config.default_max_tokens, limit - prompt_tokens)

    # Streamed answers.

    def token_event(self, job: Job, created: int, text: str, finish: str | None) -> bytes:
        return sse_event(
            chunk(
                request_id=job.request_id,
                chat=job.chat,
                model=self.settings.model,
                created=created,
                text=text,
                finish_reason=finish,
            )
        )

    async def start_token_stream(self, exchange: Exchange, job: Job, created: int) -> None:
        """Headers, and for a chat the opening event that only names the role."""
        await exchange.start_stream()
        if job.chat:
            opening = chunk(
                request_id=job.request_id,
                chat=True,
                model=self.settings.model,
                created=created,
                text="",
                finish_reason=None,
                role=True,
            )
            await exchange.send_body(sse_event(opening), more=True)

    async def end_token_stream(
        self, exchange: Exchange, job: Job, created: int, usage_body: JSON
    ) -> None:
        """The usage event if the request asked for it, then ``[DONE]``."""
        if job.include_usage:
            usage_event = usage_chunk(
                request_id=job.request_id,
                chat=job.chat,
                model=self.settings.model,
                created=created,
                usage_body=usage_body,
            )
            await exchange.send_body(sse_event(usage_event), more=True)
        await exchange.send_body(SSE_DONE, more=False)

    # Operational endpoints.

    async def _health(self, exchange: Exchange) -> None:
        await anyio.sleep(self.config.health_delay)
        if self.config.health_status is not None:
            raise ApiError("health check refused", status=self.config.health_status)
        await exchange.respond(200, {"status": "ok"})

    async def _models(self, exchange: Exchange) -> None:
        self.counters.models_requests += 1
        await anyio.sleep(self.config.models_delay)
        model = {
            "id": self.settings.model,
            "object": "model",
            "created": self.created,
            "owned_by": "pd-router-sim",
            "max_model_len": self.settings.max_model_len,
        }
        await exchange.respond(200, {"object": "list", "data": [model]})

    async def _stats(self, exchange: Exchange) -> None:
        await exchange.respond(200, self.stats())

    async def _reset(self, exchange: Exchange) -> None:
        self.counters = Counters()
        self.request_ids.clear()
        self.trace_contexts.clear()
        self.reset()
        await exchange.respond(200, self.stats())

    async def _get_config(self, exchange: Exchange) -> None:
        await exchange.respond(200, self.config.as_dict())

    async def _set_config(self, exchange: Exchange) -> None:
        changes = await exchange.read_json_object()
        if changes is None:
            return
        self.config.update(changes)
        await exchange.respond(200, self.config.as_dict())

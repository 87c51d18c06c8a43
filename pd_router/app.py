"""The Starlette app: OpenAI routes, /v1/models, /health, /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .errors import PayloadTooLarge, RouterError, UpstreamError
from .metrics import registry_for
from .relay import Relay, Router
from .validation import PATHS, Endpoint, parse_body, request_id

MAX_BODY_BYTES = 32 << 20


def error_response(error: RouterError) -> Response:
    return Response(
        error.json(), status_code=error.status, headers=error.headers, media_type="application/json"
    )


class OpenAIRoute:
    """A raw ASGI endpoint: the relay is its own response and owns its cleanup."""

    def __init__(self, router: Router, endpoint: Endpoint, max_body_bytes: int) -> None:
        self.router = router
        self.endpoint = endpoint
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        rid = request_id(request.headers.get("x-request-id"))
        try:
            body = parse_body(await _read_body(request, self.max_body_bytes), self.endpoint)
        except RouterError as error:
            self.router.count(self.endpoint, "bad_request")
            response = error_response(error)
            response.headers["x-request-id"] = rid
            await response(scope, receive, send)
            return
        except ClientDisconnect:
            self.router.count(self.endpoint, "client_aborted")
            return
        await Relay(self.router, self.endpoint, body, rid)(scope, receive, send)


def create_app(router: Router, *, max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    registry = registry_for(router)

    async def models(request: Request) -> Response:
        nodes = [*router.pool.nodes, *router.prefill.nodes]
        answers: list[Any] = [None] * len(nodes)

        async def ask(index: int, url: str) -> None:
            try:
                answers[index] = await router.upstream.get_json(url + "/v1/models")
            except UpstreamError:
                pass

        with anyio.move_on_after(10):
            async with anyio.create_task_group() as tg:
                for index, node in enumerate(nodes):
                    tg.start_soon(ask, index, node.url)
        seen: dict[str, Any] = {}
        for answer in answers:
            data = answer.get("data") if isinstance(answer, dict) else None
            for model in data if isinstance(data, list) else ():
                if isinstance(model, dict) and isinstance(model.get("id"), str):
                    seen.setdefault(model["id"], model)
        if not seen:
            return error_response(UpstreamError("no engine answered /v1/models", status=503))
        return _json({"object": "list", "data": list(seen.values())})

    async def health(request: Request) -> Response:
        pool = router.pool
        return _json(
            {
                "status": "ok",
                "prefill_nodes": len(router.prefill.nodes),
                "decode_nodes": len(pool.nodes),
                "decode_slots": pool.capacity,
                "decode_slots_in_use": pool.in_use,
                "queue_depth": pool.queue_depth,
            }
        )

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.upstream.start()
        try:
            yield
        finally:
            await router.upstream.close()

    routes = [
        *(
            Route(PATHS[endpoint], OpenAIRoute(router, endpoint, max_body_bytes), methods=["POST"])
            for endpoint in PATHS
        ),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _json(document: Any) -> Response:
    return Response(orjson.dumps(document), media_type="application/json")

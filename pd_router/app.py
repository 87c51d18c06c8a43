"""The Starlette app: OpenAI routes, /v1/models, /health, /metrics, /admin; and the
background work that lives as long as the app: the prober and graceful shutdown."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from pd_router.admin import abort_here, admin_routes
from pd_router.discovery.loop import discover_forever
from pd_router.discovery.resolver import Resolver
from pd_router.discovery.rules import Discovery
from pd_router.edge import hops
from pd_router.edge.auth import Key
from pd_router.edge.stream import ClientStream
from pd_router.edge.validation import PATHS, Endpoint, parse_body, request_id
from pd_router.engines import bootstrap
from pd_router.engines.kvevents import follow
from pd_router.engines.watch import (
    learn_models,
    no_bootstrap,
    probe,
    probe_forever,
    supervise,
    watch_models,
    watch_stalls,
)
from pd_router.errors import (
    AdminDisabled,
    LoopDetected,
    ModelsUnknown,
    NoRoute,
    PayloadTooLarge,
    RouterError,
    ShuttingDown,
    Unauthorized,
)
from pd_router.fleet.membership import LocalMembership, Membership
from pd_router.fleet.models import listing as model_listing
from pd_router.fleet.nodes import Node
from pd_router.ops import logs
from pd_router.ops.gathered import GatheredMetrics
from pd_router.ops.lag import LoopLag
from pd_router.ops.metrics import OTHER
from pd_router.relay import Relay, Router, refused_line
from pd_router.shared.abort import RemoteAborts
from pd_router.shared.fleet import SharedFleet
from pd_router.shared.placements import SharedPlacements
from pd_router.shared.pool import SharedPool

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
        self.mark = router.mark.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = b""
        rid_header: str | None = None
        authorization: list[bytes] = []
        via: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                rid_header = value.decode("latin-1")
            elif name == b"content-length":
                declared = value
            elif name == hops.HEADER:
                via = value if via is None else via + b"," + value
            elif name == b"authorization":
                authorization.append(value)
        rid = request_id(rid_header)
        key = None
        tracer = self.router.tracer
        trace = None if tracer is None else tracer.request(scope["headers"], PATHS[self.endpoint])
        try:
            # First: a loop is refused before anything of it is read or held.
            onward = hops.passed(via, self.mark)
            if self.router.keys is not None:
                # Before the body is read: a client without a key costs no memory either.
                key = self.router.keys.keys.check(authorization)
                if trace is not None:
                    # Its name, never the key: on a request refused later (400, 413, a
                    # shutdown) too, as its metric and log line name it.
                    trace.root.set_attribute("pd_router.key", key.name)
            if self.router.shutting_down:
                raise ShuttingDown("router shutting down")
            raw = await _read_body(receive, declared, self.max_body_bytes)
            if raw is None:
                self.router.telemetry.count(self.endpoint, "client_aborted", _name(key))
                if trace is not None:
                    trace.finish(rid, "client_aborted", 0, None)
                self._log(rid, key, "client_aborted", 0, 0)
                return
            body = parse_body(raw, self.endpoint)
            relay = Relay(self.router, self.endpoint, body, rid, onward, trace, key)
        except RouterError as error:
            outcome = error.outcome or "bad_request"
            self.router.telemetry.count(self.endpoint, outcome, _name(key))
            if trace is not None:
                trace.finish(rid, outcome, error.status, error)
            answer = ClientStream(rid)
            answer.attach(send)
            await answer.fail(error)
            if outcome != "unauthorized":  # counted only: a client without a key writes no log
                self._log(rid, key, outcome, error.status, answer.bytes_sent)
            return
        del raw  # the relay lets go of the request once the engines have it
        await relay(scope, receive, send)

    def _log(self, rid: str, key: Key | None, outcome: str, status: int, sent: int) -> None:
        line = refused_line(rid, _name(key) or None, self.endpoint, outcome, status, sent)
        logs.request_finished(line)


class RouterApp:
    """The ASGI entry point. The OpenAI POST routes go straight to their endpoint: the
    framework's middleware would wrap every streamed chunk's ``send``. Everything else,
    those routes' other methods included, is the Starlette app's."""

    def __init__(
        self,
        openai: dict[str, OpenAIRoute],
        rest: Starlette,
        router: Router,
    ) -> None:
        self.openai = openai
        self.rest = rest
        self.mark = router.mark.encode()
        self.keys = router.keys
        self.telemetry = router.telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["method"] == "POST":
                route = self.openai.get(scope["path"])
                if route is not None:
                    await route(scope, receive, send)  # checks the key itself
                    return
            # A probe or a model read of a router that is its own node, say.
            via = [value for name, value in scope["headers"] if name == hops.HEADER]
            if via:
                try:
                    hops.passed(b",".join(via), self.mark)
                except LoopDetected as loop:
                    await error_response(loop)(scope, receive, send)
                    return
            if self.keys is not None and scope["path"].startswith("/v1/"):
                # Every /v1/ path, /v1/models and those that do not exist included: without
                # a key, a client learns nothing, not even which paths there are.
                authorization = [
                    value for name, value in scope["headers"] if name == b"authorization"
                ]
                try:
                    self.keys.keys.check(authorization)
                except Unauthorized as error:
                    self.telemetry.count(OTHER, "unauthorized")
                    await error_response(error)(scope, receive, send)
                    return
        await self.rest(scope, receive, send)


@dataclass(frozen=True)
class AppOptions:
    max_body_bytes: int = MAX_BODY_BYTES
    admin_token: str | None = None
    health_interval: float = 1.0
    health_timeout: float = 1.0
    stall_timeout: float = 30.0
    shutdown_timeout: float = 30.0
    # The address the router listens on (host, port), to refuse it as an engine; None:
    # not known (in-process tests).
    listen: tuple[str, int] | None = None
    # Slots of a decode node added through the admin API that does not say (--decode-slots).
    decode_slots: int = 1
    # With --workers: this worker's number, and the directory where every worker's series
    # meet for /metrics (``ops/gathered.py``); None: a router of one process.
    worker: tuple[int, Path] | None = None


def create_app(router: Router, options: AppOptions | None = None) -> RouterApp:
    options = options or AppOptions()
    registry = router.telemetry.registry
    gathered = None if options.worker is None else GatheredMetrics(registry, *options.worker)
    fleet = router.fleet
    remote = None
    placements = None
    probes = options.health_interval > 0
    membership: Membership = LocalMembership(fleet, probes)
    if isinstance(fleet.pool, SharedPool):
        remote = RemoteAborts(fleet.pool.redis, fleet.pool.router_id, partial(abort_here, fleet))
        placements = SharedPlacements(fleet.pool.redis, fleet.pool.router_id, fleet)
        membership = SharedFleet(fleet, fleet.pool, probes)
    lag = LoopLag()
    admit = partial(_admit, router, options.health_timeout, lag)

    async def models(request: Request) -> Response:
        # From what the model watch read: a caller costs the engines nothing.
        serving = set(fleet.serving_view())
        listed = model_listing(
            [node for node in fleet.prefill.nodes if node.id in serving],
            [node for node in fleet.pool.nodes if node.id in serving],
        )
        if listed is None:
            message = "no serving engine's model list has been read yet"
            return error_response(ModelsUnknown(message))
        return _json({"object": "list", "data": listed})

    async def health(request: Request) -> Response:
        pool = fleet.pool
        serving = set(fleet.serving_view())
        live_prefill = sum(node.id in serving for node in fleet.prefill.nodes)
        live_decode = sum(node.id in serving for node in pool.nodes)
        ready = live_prefill > 0 and live_decode > 0 and pool.available and not router.shutting_down
        status = "ok" if ready else ("shutting_down" if router.shutting_down else "unavailable")
        document = {
            "status": status,
            "prefill_nodes": live_prefill,
            "decode_nodes": live_decode,
            "decode_slots": pool.capacity,
            "decode_slots_in_use": pool.in_use,
            "queue_depth": pool.queue_depth,
        }
        if not pool.available:
            document["shared_state"] = "unavailable"
        if options.worker is not None:
            document["worker"] = options.worker[0]  # the counts above are this worker's
        return _json(document, 200 if ready else 503)

    async def metrics(request: Request) -> Response:
        body = generate_latest(registry) if gathered is None else gathered.exposition()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            async with anyio.create_task_group() as tg:
                stopping = router.stopping = anyio.Event()
                tg.start_soon(supervise, "the loop-lag ticker", lag.run)
                if gathered is not None:
                    tg.start_soon(supervise, "the metrics snapshot", gathered.run)
                if options.health_interval > 0:
                    prober = partial(
                        probe_forever,
                        fleet,
                        router.upstream,
                        options.health_interval,
                        options.health_timeout,
                        lag,
                        membership.may_probe,
                        _bootstrap_port(router),
                    )
                    tg.start_soon(supervise, "the prober", prober)
                # Not a probe: one small GET per node every 30 s, which routing by model and
                # GET /v1/models need whether or not the engines are probed.
                tick = options.health_interval or 1.0
                learn = partial(watch_models, fleet, router.upstream, tick)
                tg.start_soon(supervise, "the model watch", learn)
                events = partial(follow, fleet.prefill.nodes, fleet.events)
                tg.start_soon(supervise, "the KV event subscribers", events)
                if options.stall_timeout > 0:
                    watch = partial(watch_stalls, fleet, options.stall_timeout)
                    tg.start_soon(supervise, "the stall watch", watch)
                if router.discovery is not None and router.discovery.groups:
                    tg.start_soon(
                        supervise,
                        "DNS discovery",
                        partial(_discover, router, router.discovery, membership, admit),
                    )
                background = [
                    *fleet.pool.background(),
                    *membership.background(),
                    *router.key_limits.background(),
                ]
                if router.keys is not None:
                    background.append(("the api keys file watch", router.keys.watch))
                for name, work in background:
                    tg.start_soon(supervise, name, work)
                if remote is not None:
                    tg.start_soon(supervise, "the abort channel", remote.run)
                if placements is not None:
                    tg.start_soon(supervise, "the placements channel", placements.run)
                stragglers = partial(_end_stragglers, router, stopping, options.shutdown_timeout)
                tg.start_soon(supervise, "the shutdown timer", stragglers)
                yield
                tg.cancel_scope.cancel()
        finally:
            await router.upstream.close()
            if router.tracer is not None:
                # The last requests' spans go out before the process does.
                await anyio.to_thread.run_sync(router.tracer.close)

    openai = {
        PATHS[endpoint]: OpenAIRoute(router, endpoint, options.max_body_bytes) for endpoint in PATHS
    }
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in openai.items()),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    if options.admin_token:
        own = partial(_own, options.listen)
        routes.extend(
            admin_routes(
                router, options.admin_token, remote, membership, own, admit, options.decode_slots
            )
        )
    paths = {route.path for route in routes}

    async def no_route(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, HTTPException):  # the only kind registered below
            raise exc
        status = exc.status_code
        method, path = request.method, request.url.path
        if status == 404 and not options.admin_token and path.split("/")[1] == "admin":
            return error_response(AdminDisabled(f"{method} {path}"))
        if status == 405:
            message = f"{method} is not allowed on {path}"
        else:
            message = f"no route {method} {path}"
            if path.endswith("/") and path.rstrip("/") in paths:
                message += f" (did you mean {path.rstrip('/')}?)"
        response = error_response(NoRoute(message, status=status))
        if status == 405:
            # Every method of the path: Starlette's Allow names those of its first route
            # only (GET and POST /admin/nodes are two).
            allowed = {
                method
                for route in routes
                if isinstance(route, Route) and route.matches(request.scope)[0] is not Match.NONE
                for method in route.methods or ()
            }
            response.headers["Allow"] = ", ".join(sorted(allowed))
        return response

    rest = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: no_route})
    # A redirect to the path without its slash would name the host the client's Host header
    # says; a 404 that names the right path serves the client better.
    rest.router.redirect_slashes = False
    return RouterApp(openai, rest, router)


async def _discover(
    router: Router,
    discovery: Discovery,
    membership: Membership,
    admit: Callable[[Node], Coroutine[Any, Any, None]],
) -> None:
    # Lookups give up well before the next round is due, and never wait under a second.
    resolver = Resolver(discovery.server, timeout=max(1.0, min(5.0, discovery.interval)))
    await discover_forever(discovery, router.fleet, membership, resolver.lookup, admit)


async def _admit(router: Router, timeout: float, lag: LoopLag, node: Node) -> None:
    """A new node's first probe, at once: one that answers serves within a round trip, not
    at the prober's next tick. Its models first: the good probe makes it serving."""
    await learn_models(router.fleet, router.upstream, node)
    await probe(router.fleet, router.upstream, node, timeout, lag, _bootstrap_port(router))


def _bootstrap_port(router: Router) -> Callable[[Node], int | None]:
    """What the prober connects to besides /health: SGLang's prefill engines' bootstrap."""
    settings = router.settings
    if settings.dialect != "sglang":
        return no_bootstrap

    def port(node: Node) -> int | None:
        return (
            bootstrap.port(node.labels, settings.bootstrap_port) if node.role == "prefill" else None
        )

    return port


def _own(listen: tuple[str, int] | None, url: str) -> bool:
    """Whether ``url`` is this router's listening address, as far as it can tell."""
    return listen is not None and hops.own_address(url, *listen, socket.gethostname())


async def _end_stragglers(router: Router, stopping: anyio.Event, timeout: float) -> None:
    """After SIGTERM, in-flight requests get ``timeout`` seconds; then each is failed."""
    await stopping.wait()
    await anyio.sleep(timeout)
    for binding in list(router.fleet.bindings.values()):
        binding.handle.fail(ShuttingDown("router shut down before this request finished"))


async def _read_body(receive: Receive, declared: bytes, limit: int) -> bytes | None:
    """The request body, or None if the client left before sending all of it."""
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _name(key: Key | None) -> str:
    return "" if key is None else key.name


def _json(document: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(document), status_code=status, media_type="application/json")

"""The admin API (mounted only when ``--admin-token`` is set): fleet state, add / drain /
remove nodes, abort a request by id. Every route checks the bearer token in constant time.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pd_router.edge.auth import bearer
from pd_router.engines import bootstrap
from pd_router.errors import Aborted, StateUnavailable, Unauthorized
from pd_router.fleet.membership import Conflict, LocalMembership, Membership
from pd_router.fleet.nodes import (
    MAX_SLOTS,
    Node,
    State,
    check_labels,
    normalise_url,
    whole,
)
from pd_router.fleet.registry import Fleet
from pd_router.relay import Relay, Router
from pd_router.shared.abort import Outcome, RemoteAborts

# What an operator changed, and through which router: a line for each change.
log = logging.getLogger("pd_router.admin")

Handler = Callable[[Request], Awaitable[Response]]


# Requests ``GET /admin/requests`` lists, oldest first, unless asked for up to the most:
# the event loop that serves every client builds the answer (with 4,000 in flight, all of
# them took 11-54 ms to the client's hands, the oldest 100 about 1 ms).
LIST_LIMIT = 100
MAX_LIST_LIMIT = 10_000


def _json(document: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(document), status_code=status, media_type="application/json")


def _error(status: int, message: str, code: str, param: str | None = None) -> Response:
    return _json(_error_body(message, code, param), status)


def _error_body(message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "admin_error", "param": param, "code": code}}


def node_view(node: Node, fleet: Fleet, bootstrap_port: int | None = None) -> dict[str, Any]:
    """``bootstrap_port``: the router's ``--bootstrap-port`` in SGLang's dialect (a prefill
    node shows the port its decode engines are sent), None in vLLM's."""
    stream = fleet.events.streams.get(node.id)
    view: dict[str, Any] = {
        "id": node.id,
        "url": node.url,
        "role": node.role,
        "state": node.state.value,
        "reason": node.reason,
        "slots": node.slots,
        "in_use": node.in_use,
        "bound_requests": sorted(node.bound),
        "consecutive_failures": node.failures,
        "last_error": node.last_error,
        "labels": node.labels,
        "source": node.source,
        # None until the node's /v1/models has been read (it may serve any model till then).
        "models": None if node.models is None else sorted(node.models),
        # The engine's KV event stream (``kv_events=PORT``), None if it has none.
        "kv_events": None if stream is None else stream.view(),
    }
    if bootstrap_port is not None and node.role == "prefill":
        view["bootstrap_port"] = bootstrap.port(node.labels, bootstrap_port)
    return view


def abort_here(fleet: Fleet, rid: str) -> Outcome:
    """Abort a request this router holds, in two phases; 404 when it holds none by that id."""
    relay = fleet.requests.get(rid)
    if not isinstance(relay, Relay):
        return 404, _error_body(f"no request {rid!r} in flight", "not_found")
    # 1. Collect what the client has had (read-only).
    partial = {"bytes_sent": relay.client.bytes_sent, "streaming": relay.client.started}
    # 2. Make the engines stop. If that fails, nothing is committed: the binding stays
    #    and the abort can be retried.
    try:
        relay.close_upstream()
    except Exception as exc:
        return 502, _error_body(f"closing the engine streams failed: {exc}", "abort_failed")
    # 3. Commit: one terminal "abort" outcome to the client; slot and bindings released.
    relay.fail(Aborted("request aborted by an operator"))
    return 200, {"id": rid, "aborted": True, **partial}


def admin_routes(
    router: Router,
    token: str,
    remote: RemoteAborts | None = None,
    membership: Membership | None = None,
    own: Callable[[str], bool] = lambda url: False,
    admit: Callable[[Node], Awaitable[None]] | None = None,
    decode_slots: int = 1,
) -> list[Route]:
    """``remote``: with a shared state, an abort reaches the router that holds the request;
    ``membership``: where node changes go (with a shared state, to every router); ``own``:
    whether an engine URL is this router's own address; ``admit``: a joining node's first
    probe, made before the answer; ``decode_slots``: the slots of a decode node added
    without saying (--decode-slots), as for one given on the command line."""
    fleet = router.fleet
    members = membership or LocalMembership(fleet)
    settings = router.settings
    shown_port = settings.bootstrap_port if settings.dialect == "sglang" else None
    expected = token.encode()

    def guarded(handler: Handler) -> Handler:
        async def check(request: Request) -> Response:
            # The header as the client sent it, parsed as a client key's is.
            given = [value for name, value in request.scope["headers"] if name == b"authorization"]
            try:
                valid = hmac.compare_digest(bearer(given), expected)
            except Unauthorized:
                valid = False
            if not valid:
                return _error(401, "a valid admin bearer token is required", "unauthorized")
            try:
                return await handler(request)
            except StateUnavailable as exc:
                return _error(503, str(exc), "shared_state_unavailable")

        return check

    def find(request: Request) -> Node | None:
        # The id as /admin/nodes shows it: int() would also take "1_0", " 1" or other
        # scripts' digits, and act on a node the path does not name.
        node_id = whole(request.path_params["node_id"])
        return None if node_id is None else fleet.node(node_id)

    async def list_nodes(request: Request) -> Response:
        nodes = [node_view(node, fleet, shown_port) for node in fleet.nodes]
        document = {
            "nodes": nodes,
            "serving_view": fleet.serving_view(),
            "queue_depth": fleet.pool.queue_depth,
            "in_flight": len(fleet.bindings),
            "shutting_down": router.shutting_down,
        }
        by_router = await members.in_flight()
        if by_router is not None:
            # Every router's requests per node: bound_requests are this router's only.
            for view in nodes:
                counts = {r: c[view["id"]] for r, c in by_router.items() if c.get(view["id"])}
                view["in_flight_by_router"] = counts
                view["fleet_in_flight"] = sum(counts.values())
            document["routers"] = {r: sum(c.values()) for r, c in sorted(by_router.items())}
            if not fleet.pool.available:
                document["shared_state"] = "unavailable"  # so the others are not in it
        return _json(document)

    async def add_node(request: Request) -> Response:
        try:
            spec = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"request body is not valid JSON: {exc}", "bad_node")
        if not isinstance(spec, dict) or spec.get("role") not in ("prefill", "decode"):
            shape = '{"url": ..., "role": "prefill"|"decode", "slots": N, "labels": {}}'
            return _error(400, f"expected {shape}", "bad_node", "role")
        # A node added again is given whole: what it leaves out is the default again.
        slots = spec.get("slots", decode_slots if spec["role"] == "decode" else 1)
        if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= MAX_SLOTS:
            message = f"'slots' must be a whole number from 1 to {MAX_SLOTS}"
            return _error(400, message, "bad_node", "slots")
        url = spec.get("url")
        try:
            if not isinstance(url, str):
                raise ValueError("'url' must be a string: http(s)://host:port")
            url = normalise_url(url)
        except ValueError as exc:
            return _error(400, f"url: {exc}", "bad_node", "url")
        try:
            labels = check_labels(spec.get("labels", {}))
        except ValueError as exc:
            return _error(400, f"labels: {exc}", "bad_node", "labels")
        if own(url):
            message = (
                f"url: {url} is this router's own address: a router is no engine of its own "
                "(every request sent there would come back)"
            )
            return _error(400, message, "bad_node", "url")
        role = spec["role"]
        # One engine is one node: adding it again changes it, under its id.
        known = fleet.find(role, url) is not None
        try:
            node = await members.add(url, role, slots, labels)
        except ValueError as exc:
            return _error(409, str(exc), "conflict")
        log.info(
            "admin: %s node %s (%s) %s, %d slots, labels %s",
            role,
            node.id,
            url,
            "added again" if known else "added",
            node.slots,
            node.labels,
        )
        if node.state is State.JOINING and admit is not None:
            await admit(node)
        return _json(node_view(node, fleet, shown_port), 200 if known else 201)

    async def drain_node(request: Request) -> Response:
        node = find(request)
        if node is None:
            return _error(404, "no such node", "not_found")
        try:
            await members.drain(node)
        except ValueError as exc:
            return _error(409, str(exc), "conflict")
        log.info("admin: %s node %s (%s) drained", node.role, node.id, node.url)
        # Accepted, not done: in-flight requests finish in their own time.
        return _json(node_view(node, fleet, shown_port), 202)

    async def remove_node(request: Request) -> Response:
        node = find(request)
        if node is None:
            return _error(404, "no such node", "not_found")
        force = request.query_params.get("force") == "true"
        try:
            await members.remove(node, force)
        except Conflict as exc:
            return _error(409, str(exc), "conflict")
        except ValueError as exc:
            return _error(409, str(exc), "not_drained")
        how = " (forced)" if force else ""
        log.info("admin: %s node %s (%s) removed%s", node.role, node.id, node.url, how)
        return _json({"removed": node.id})

    async def list_requests(request: Request) -> Response:
        given = request.query_params.get("limit")
        limit = LIST_LIMIT if given is None else whole(given)
        if limit is None or not 1 <= limit <= MAX_LIST_LIMIT:
            message = f"'limit' must be a whole number from 1 to {MAX_LIST_LIMIT:,}"
            return _error(400, message, "bad_limit", "limit")
        # Admitted in the order they arrived (``Fleet.admit``): the first are the oldest.
        relays = (r for r in fleet.requests.values() if isinstance(r, Relay))
        now = time.perf_counter()
        views = [r.view(now) for r in itertools.islice(relays, limit)]
        return _json({"requests": views, "in_flight": len(fleet.requests)})

    async def abort_request(request: Request) -> Response:
        rid = request.path_params["request_id"]
        status, document = abort_here(fleet, rid)
        if status == 404 and remote is not None:
            status, document = await remote.abort(rid) or (status, document)
        if status == 200:
            log.info("admin: request %s aborted", rid)
        return _json(document, status)

    return [
        Route("/admin/nodes", guarded(list_nodes), methods=["GET"]),
        Route("/admin/nodes", guarded(add_node), methods=["POST"]),
        Route("/admin/nodes/{node_id}/drain", guarded(drain_node), methods=["POST"]),
        Route("/admin/nodes/{node_id}", guarded(remove_node), methods=["DELETE"]),
        Route("/admin/requests", guarded(list_requests), methods=["GET"]),
        Route("/admin/requests/{request_id}/abort", guarded(abort_request), methods=["POST"]),
    ]

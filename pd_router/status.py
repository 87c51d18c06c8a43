"""``pd-router status``: a running router's fleet as a table, for a person at a terminal.

The source is the router's public ``GET /metrics``. With an admin token (``--admin-token``
or ``PD_ROUTER_ADMIN_TOKEN``) it is ``GET /admin/nodes`` instead, which also has each
node's labels, its requests in flight (with ``--state``, those of every router sharing
the fleet) and its last error. Fetching is ``urllib``; reading and formatting are pure
functions.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
from prometheus_client.parser import text_string_to_metric_families

from pd_router.config import ENV_PREFIX, number
from pd_router.ops.logs import escaped
from pd_router.parser import Parser, parse

# The router's own variable for --admin-token, so one export serves both.
ADMIN_ENV = ENV_PREFIX + "ADMIN_TOKEN"
# Model ids shown per node; more are counted (+N).
MODELS_SHOWN = 3


class StatusError(Exception):
    """The router could not be asked, or its answer makes no sense; the message says which."""


@dataclass
class NodeRow:
    id: int
    role: str
    url: str
    state: str = "?"
    slots: int = 0
    in_use: int = 0
    failures: int = 0
    # None: the source does not say (/metrics has no labels or per-node requests).
    labels: dict[str, str] | None = None
    requests: int | None = None
    last_error: str | None = None
    # Why it is not serving ("probe timeout", "stalled", "refused"...), when it is not.
    reason: str | None = None
    # static, admin, or the DNS name that lists it (dns:vllm-decode:8200).
    source: str = "static"
    # What its /v1/models lists; [] while not read yet (an engine's list is never empty);
    # None: the source does not say (/metrics).
    models: list[str] | None = None


@dataclass
class Snapshot:
    nodes: list[NodeRow] = field(default_factory=list)
    queue_depth: int = 0
    in_flight: int = 0
    shutting_down: bool | None = None
    # With a shared state (``--state``): every router's requests in flight, by router id.
    routers: dict[str, int] | None = None
    # Why ``/health`` says the router takes no request now (None: it does, or unknown).
    not_ready: str | None = None


def from_metrics(text: str) -> Snapshot:
    """A Prometheus exposition of the router's ``/metrics``."""
    snapshot = Snapshot()
    rows: dict[int, NodeRow] = {}
    seen_router = False
    # With --workers each series comes once per worker (its ``worker`` label): the counts
    # are summed, what each worker says of a node (slots, state) is the same.
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "pd_router_queue_depth":
                snapshot.queue_depth += int(value)
                seen_router = True
            elif name == "pd_router_in_flight":
                snapshot.in_flight += int(value)
            elif name.startswith("pd_router_node_") and "node" in labels:
                node_id = int(labels["node"])
                row = rows.get(node_id)
                if row is None:
                    row = rows[node_id] = NodeRow(node_id, labels["role"], labels["url"])
                if name == "pd_router_node_slots":
                    row.slots = int(value)
                elif name == "pd_router_node_slots_in_use":
                    row.in_use += int(value)
                elif name == "pd_router_node_consecutive_failures":
                    row.failures = int(value)
                elif name == "pd_router_node_state" and value == 1:
                    row.state = labels["state"]
                elif name == "pd_router_node_reason" and value == 1:
                    row.reason = labels["reason"]
                elif name == "pd_router_node_source" and value == 1:
                    row.source = labels["source"]
    if not seen_router:
        raise StatusError("its /metrics has no pd_router_queue_depth: is this a pd-router?")
    snapshot.nodes = sorted(rows.values(), key=lambda row: row.id)
    return snapshot


def from_admin(document: Any) -> Snapshot:
    """The JSON of ``GET /admin/nodes``."""
    try:
        nodes = [
            NodeRow(
                id=int(node["id"]),
                role=str(node["role"]),
                url=str(node["url"]),
                state=str(node["state"]),
                slots=int(node["slots"]),
                in_use=int(node["in_use"]),
                failures=int(node["consecutive_failures"]),
                labels={str(k): str(v) for k, v in node.get("labels", {}).items()},
                # With a shared state, every router's; bound_requests are the asked one's.
                requests=int(node.get("fleet_in_flight", len(node["bound_requests"]))),
                last_error=node.get("last_error"),
                reason=node.get("reason"),
                source=str(node.get("source", "static")),
                models=[str(model) for model in node.get("models") or ()],
            )
            for node in document["nodes"]
        ]
        routers = document.get("routers")
        return Snapshot(
            nodes=sorted(nodes, key=lambda row: row.id),
            queue_depth=int(document["queue_depth"]),
            in_flight=int(document["in_flight"]),
            shutting_down=bool(document.get("shutting_down", False)),
            routers=None if routers is None else {str(k): int(v) for k, v in routers.items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StatusError(f"unexpected /admin/nodes answer ({exc!r})") from None


def format_table(snapshot: Snapshot, router: str) -> str:
    """The fleet as aligned text; a column the source knows nothing of is left out."""
    nodes, routers = snapshot.nodes, snapshot.routers
    serving = sum(node.state == "serving" for node in nodes)
    decode = [node for node in nodes if node.role == "decode"]
    in_flight = snapshot.in_flight if routers is None else sum(routers.values())
    slots = f"{sum(_used(n, routers) for n in decode)}/{sum(n.slots for n in decode)} in use"
    if routers is not None:
        slots += f" ({sum(n.in_use for n in decode)} by this router)"
    summary = (
        f"pd-router {router}: {serving} of {len(nodes)} nodes serving, decode slots {slots}, "
        f"{snapshot.queue_depth} queued, {in_flight} in flight"
    )
    if routers is not None:
        summary += f" on {len(routers)} routers"
    if snapshot.shutting_down:
        summary += ", SHUTTING DOWN"
    elif snapshot.not_ready:
        summary += f", NOT READY: {snapshot.not_ready}"
    if not nodes:
        return summary + "\n(no nodes)\n"
    with_requests = any(node.requests is not None for node in nodes)
    with_labels = any(node.labels for node in nodes)
    with_sources = any(node.source != "static" for node in nodes)
    with_models = any(node.models is not None for node in nodes)
    header = ["ID", "ROLE", "STATE", "SLOTS", "FAILURES"]
    header += ["REQUESTS"] * with_requests + ["URL"] + ["SOURCE"] * with_sources
    header += ["MODELS"] * with_models + ["LABELS"] * with_labels
    table = [header]
    for node in nodes:
        # Prefill nodes' too: /metrics and /admin/nodes give them, and a "-" read as a
        # value the source did not have.
        slots = f"{_used(node, routers)}/{node.slots}"
        row = [str(node.id), node.role, node.state, slots, str(node.failures)]
        if with_requests:
            row.append("-" if node.requests is None else str(node.requests))
        row.append(node.url)
        if with_sources:
            row.append(node.source)
        if with_models:
            row.append(_models(node.models))
        if with_labels:
            row.append(",".join(f"{k}={v}" for k, v in sorted((node.labels or {}).items())))
        # What engines and the admin API wrote reaches a terminal: nothing in it may move
        # the cursor, clear the screen or start a line of its own.
        table.append([escaped(cell) for cell in row])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [summary, ""]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    if routers is not None:
        lines.append("")
        lines += [
            f"router {escaped(name)}: {count} in flight" for name, count in sorted(routers.items())
        ]
    # Why a node is not serving (the evidence), and the last error of a failing one.
    notes = [n for n in nodes if n.reason or (n.last_error and n.failures)]
    if notes:
        lines.append("")
        lines += [_note(node) for node in notes]
    return "\n".join(lines) + "\n"


def _used(node: NodeRow, routers: dict[str, int] | None) -> int:
    """A decode node's slots in use: with a shared state, every router's (one per request
    in flight on it, as the routers last published them, at most ~1 s old)."""
    if routers is None or node.role != "decode" or node.requests is None:
        return node.in_use
    return node.requests


def _models(models: list[str] | None) -> str:
    if not models:
        return "?"  # not read yet: the node takes any model
    shown = ",".join(models[:MODELS_SHOWN])
    return shown + (f",+{len(models) - MODELS_SHOWN}" if len(models) > MODELS_SHOWN else "")


def _note(node: NodeRow) -> str:
    why = f"node {node.id} {node.state} ({node.reason})" if node.reason else f"node {node.id}"
    return escaped(f"{why} last error: {node.last_error}" if node.last_error else why)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: urllib would follow it with the admin token to wherever it
    names (another host, or from https to http)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects())


def fetch(url: str, token: str | None = None, timeout: float = 5.0) -> bytes:
    # urllib writes header values as Latin-1; the router reads the token as UTF-8 bytes.
    headers = {"Authorization": f"Bearer {token}".encode().decode("latin-1")} if token else {}
    request = urllib.request.Request(url, headers=headers)
    # The scheme was checked to be http(s) in main: the opener cannot be pointed at a file.
    with _OPENER.open(request, timeout=timeout) as response:  # nosec B310
        body: bytes = response.read()
        return body


def snapshot(router: str, token: str | None, timeout: float) -> tuple[Snapshot, str | None]:
    """Ask the router; a note for stderr when the admin API was wanted but is not there."""
    try:
        result, note = _nodes(router, token, timeout)
        result.not_ready = _not_ready(router, timeout)
        return result, note
    except urllib.error.HTTPError as exc:
        raise StatusError(f"{exc.url} answered {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise StatusError(f"cannot reach it: {exc.reason}") from None
    except (OSError, ValueError) as exc:
        # Timeouts, resets, and answers that are not what a router sends.
        raise StatusError(f"cannot read it: {exc}") from None


def _nodes(router: str, token: str | None, timeout: float) -> tuple[Snapshot, str | None]:
    if token:
        try:
            document = orjson.loads(fetch(f"{router}/admin/nodes", token, timeout))
            return from_admin(document), None
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise StatusError("the admin token was refused (401)") from None
            if exc.code != 404:
                raise
            note = "the router has no admin API (--admin-token unset): showing /metrics"
            return from_metrics(fetch(f"{router}/metrics", None, timeout).decode()), note
    return from_metrics(fetch(f"{router}/metrics", None, timeout).decode()), None


def _not_ready(router: str, timeout: float) -> str | None:
    """Why the router's ``/health`` answers 503 (not ready: a load balancer sends it
    nothing): its nodes may all look well while its shared state (Redis) is away."""
    try:
        fetch(f"{router}/health", None, timeout)
        return None
    except urllib.error.HTTPError as exc:
        if exc.code != 503:
            raise
        try:
            document = orjson.loads(exc.read())
        except orjson.JSONDecodeError:
            document = None  # a proxy's page: what the nodes say is still worth showing
    if not isinstance(document, dict):
        return "HTTP 503"
    reasons = []
    if document.get("shared_state") == "unavailable":
        reasons.append("shared state (--state) unavailable")
    for role in ("prefill", "decode"):
        count = document.get(f"{role}_nodes")
        if type(count) is int and count == 0:
            reasons.append(f"no {role} node serving")
    return ", ".join(reasons) or "HTTP 503"


def _timeout(text: str) -> float:
    value = number(text)
    # 0 would make every read fail at once ("Operation now in progress").
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _router_url(text: str) -> str | None:
    """The router's base URL, or None for one urllib would fail on later with a traceback
    (a port that is no number, an unclosed IPv6 bracket, a space in the host)."""
    try:
        parts = urlsplit(text)
        parts.port  # raises ValueError for a port that is not one
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if not parts.netloc.isprintable() or any(char.isspace() for char in parts.netloc):
        return None
    return text.rstrip("/")


def main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    parser = Parser(
        prog="pd-router status", description="Show a running pd-router's nodes and queue."
    )
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the router's base URL; default http://127.0.0.1:8000",
    )
    parser.add_argument(
        "--admin-token",
        default=environ.get(ADMIN_ENV) or None,
        metavar="TOKEN",
        help=f"use /admin/nodes (labels, requests per node); default ${ADMIN_ENV}",
    )
    parser.add_argument(
        "--timeout",
        type=_timeout,
        default=5.0,
        metavar="SECONDS",
        help="how long each call to the router may take (more than 0); default 5",
    )
    args = parse(parser, argv)
    router = _router_url(args.url)
    if router is None:
        parser.error(f"--url: expected http(s)://host:port, got {args.url!r}")
    try:
        result, note = snapshot(router, args.admin_token, args.timeout)
    except StatusError as exc:
        print(f"pd-router status: router at {router}: {exc}", file=sys.stderr)
        return 1
    if note:
        print(f"pd-router status: {note}", file=sys.stderr)
    sys.stdout.write(format_table(result, router))
    return 0

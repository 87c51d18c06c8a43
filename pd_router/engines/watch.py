"""Liveness at run time: the prober, the stall watch, the model watch, and the supervision
of every task that lives as long as the app.

The prober GETs every node's ``/health`` every ``interval`` seconds, each bounded by
``timeout`` (in SGLang's dialect it also connects to each prefill engine's bootstrap port);
the stall watch looks at the streams' progress every tick (``fleet/stall.py``). Both
report to the fleet, which decides what a node's state becomes (``fleet/nodes.py``). The
model watch reads each node's ``/v1/models`` (``fleet/models.py``).
Nothing here may end for good: an error probing one node counts against that node only,
and a task that fails anyway is restarted with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import anyio

from pd_router.engines.client import PROBE_TIMEOUT, Upstream
from pd_router.errors import Evidence, UpstreamError
from pd_router.fleet import models, stall
from pd_router.fleet.nodes import Failure, Node
from pd_router.fleet.registry import Fleet
from pd_router.ops.lag import LoopLag
from pd_router.ops.ticks import sleep_to_tick

log = logging.getLogger("pd_router.health")

# A probe that timed out while the router's own loop ran this late (as a share of the
# probe's timeout) proves nothing about the engine: it is void.
VOID_LAG_SHARE = 0.25


def no_bootstrap(node: Node) -> int | None:
    return None


async def probe_forever(
    fleet: Fleet,
    upstream: Upstream,
    interval: float,
    timeout: float,
    lag: LoopLag,
    may_probe: Callable[[], bool] = lambda: True,
    bootstrap_port: Callable[[Node], int | None] = no_bootstrap,
) -> None:
    """``may_probe``: with ``--state`` one router probes for the fleet, the others wait.
    ``bootstrap_port``: a node's SGLang bootstrap port, which is probed too (None: none)."""
    while True:
        if may_probe():
            async with anyio.create_task_group() as tg:
                for node in fleet.nodes:
                    tg.start_soon(probe, fleet, upstream, node, timeout, lag, bootstrap_port)
        await sleep_to_tick(interval)


async def probe(
    fleet: Fleet,
    upstream: Upstream,
    node: Node,
    timeout: float,
    lag: LoopLag,
    bootstrap_port: Callable[[Node], int | None] = no_bootstrap,
) -> None:
    started = anyio.current_time()
    # The loop's lag is asked about only while a probe is out: the ticker ticks only then.
    with lag.watching():
        try:
            failure = await upstream.probe(node.url + "/health", timeout)
            port = bootstrap_port(node)
            if failure is None and port is not None:
                failure = await _bootstrap_answers(node.url, port, timeout)
        except Exception as exc:
            log.exception(
                "probing %s node %s (%s) failed inside the router", node.role, node.id, node.url
            )
            failure = Failure(
                "probe error", f"health check failed in the router: {exc!r}", Evidence.SOFT
            )
        timed_out = failure is not None and failure.kind == PROBE_TIMEOUT
        late = lag.worst_since(started, anyio.current_time()) if timed_out else 0.0
    if node not in fleet.nodes:
        return  # removed while the probe was out
    if failure is None:
        fleet.probed(node)
        return
    if timed_out:
        if late >= timeout * VOID_LAG_SHARE:
            log.info(
                "probe of %s node %s (%s) void: the router's own loop ran %.1f s late",
                node.role,
                node.id,
                node.url,
                late,
            )
            return
    fleet.failed(node, failure, probe=True)


async def _bootstrap_answers(url: str, port: int, timeout: float) -> Failure | None:
    """Whether an SGLang prefill engine's bootstrap server takes a connection: decode
    engines dial it for each request's KV. An engine whose /health answers and whose
    bootstrap port does not (a wrong --bootstrap-port or label) would fail every request
    it prefills, at the decode engines, which would be blamed for it: so one refusal is
    fatal, as a real request's is (three in a row, at start, let a burst of requests
    through it and made its only decode node unhealthy)."""
    host = urlsplit(url).hostname or ""
    where = f"bootstrap server {host}:{port}"
    try:
        with anyio.fail_after(timeout):
            stream = await anyio.connect_tcp(host, port)
    except TimeoutError:
        return Failure(PROBE_TIMEOUT, f"{where}: no connection within {timeout:g} s", Evidence.SOFT)
    except OSError as exc:
        return Failure("bootstrap refused", f"{where}: {exc.strerror or exc}", Evidence.FATAL)
    await stream.aclose()
    return None


async def watch_stalls(fleet: Fleet, timeout: float) -> None:
    """End the silent streams of hung decode nodes; see ``fleet/stall.py``."""
    tick = min(1.0, timeout / 4)
    last = anyio.current_time()
    while True:
        await sleep_to_tick(tick)
        now = anyio.current_time()
        # Time the loop lost to its own stall is nobody's silence.
        elapsed, last = min(now - last, 2 * tick), now
        for node, silent in stall.hung(fleet.bindings.values(), elapsed, timeout).items():
            seconds = max(binding.silent for binding in silent)
            fleet.stalled(node, silent, seconds, hold=timeout)


async def watch_models(fleet: Fleet, upstream: Upstream, tick: float = 1.0) -> None:
    """Learn each node's models: a new node's within ``tick``, then every ``REFRESH`` s.

    Every router does its own reading (with ``--state`` too): it is one small GET per node
    every half minute, and needs no agreement."""
    due: dict[Node, float] = {}

    async def learn(node: Node) -> None:
        if await learn_models(fleet, upstream, node):
            due[node] = anyio.current_time() + models.REFRESH

    while True:
        now = anyio.current_time()
        nodes = fleet.nodes
        due = {node: due.get(node, now) for node in nodes}  # removed nodes forgotten
        reading = [node for node in nodes if due[node] <= now]
        if reading:  # most ticks read nothing: no task group for them
            async with anyio.create_task_group() as tg:
                for node in reading:
                    due[node] = now + models.RETRY  # unless the read succeeds
                    tg.start_soon(learn, node)
        await sleep_to_tick(tick)


async def learn_models(fleet: Fleet, upstream: Upstream, node: Node) -> bool:
    """Read ``node``'s ``/v1/models`` and tell the fleet; False if it did not answer well."""
    with anyio.move_on_after(models.TIMEOUT):
        try:
            learned = models.parse(await upstream.get_json(node.url + "/v1/models"))
        except (UpstreamError, ValueError) as exc:
            if node.models is None:
                log.debug("%s node %s: models not known yet: %s", node.role, node.id, exc)
            return False
        if node in fleet.nodes:
            fleet.learned(node, learned)
        return True
    return False


async def supervise(
    name: str, task: Callable[[], Awaitable[None]], restart_after: float = 1.0
) -> None:
    """Run ``task`` until it returns; if it fails, log it and start it again."""
    while True:
        try:
            await task()
            return
        except Exception:
            log.exception("%s failed; restarting it in %g s", name, restart_after)
        await anyio.sleep(restart_after)

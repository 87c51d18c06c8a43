"""The prober: GET /health on every node, every ``interval`` seconds, each bounded by
``timeout``. What it sees goes to the fleet, which decides what a node's state becomes."""

from __future__ import annotations

import anyio

from .fleet import Fleet
from .nodes import Node
from .upstream import Upstream


async def probe_forever(fleet: Fleet, upstream: Upstream, interval: float, timeout: float) -> None:
    while True:
        async with anyio.create_task_group() as tg:
            for node in fleet.nodes:
                tg.start_soon(_probe, fleet, upstream, node, timeout)
        await anyio.sleep(interval)


async def _probe(fleet: Fleet, upstream: Upstream, node: Node, timeout: float) -> None:
    problem = await upstream.probe(node.url + "/health", timeout)
    if node not in fleet.nodes:
        return  # removed while the probe was out
    if problem is None:
        fleet.succeeded(node)
    else:
        fleet.failed(node, problem)

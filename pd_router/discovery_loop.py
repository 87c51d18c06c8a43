"""The discovery loop: every ``--discovery-interval`` seconds, resolve each name and apply
what its group decides (``discovery.py``) through the fleet's add / drain / remove.

New nodes join and are probed at once, so that one that answers serves within a round
trip of its lookup rather than at the prober's next tick; the prober takes them on from
there. Log lines: one per change, and one when a name's lookups start failing, come back
empty or answer again (not one per failed round: a lasting outage would flood the log; the
metrics count every one).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio

from .discovery import GONE, Answer, Discovery, DnsSpec, Group
from .fleet import Fleet
from .nodes import Node

log = logging.getLogger("pd_router.discovery")

Lookup = Callable[[DnsSpec], Awaitable[Answer]]
Probe = Callable[[Node], Coroutine[Any, Any, None]]


async def discover_forever(
    discovery: Discovery, fleet: Fleet, lookup: Lookup, probe: Probe
) -> None:
    while True:
        await discover_once(discovery, fleet, lookup, probe)
        await anyio.sleep(discovery.interval)


async def discover_once(discovery: Discovery, fleet: Fleet, lookup: Lookup, probe: Probe) -> None:
    answers: dict[int, Answer] = {}

    async def ask(index: int, group: Group) -> None:
        answers[index] = await lookup(group.spec)

    async with anyio.create_task_group() as tg:
        for index, group in enumerate(discovery.groups):
            tg.start_soon(ask, index, group)
    joining: list[Node] = []
    for index, group in enumerate(discovery.groups):
        joining += apply(group, answers[index], fleet, discovery)
    async with anyio.create_task_group() as tg:
        for node in joining:
            tg.start_soon(probe, node)


def apply(group: Group, answer: Answer, fleet: Fleet, discovery: Discovery) -> list[Node]:
    """One answer into the fleet; returns the nodes that joined (to be probed)."""
    spec = group.spec
    _log_outcome(group, answer)
    nodes = {node.id: node for node in fleet.nodes}
    plan = group.update(answer, {node.url for node in nodes.values()}, nodes, fleet.clock())
    joining = []
    slots = spec.slots or (discovery.decode_slots if spec.role == "decode" else 1)
    drain_timeout = discovery.drain_timeout
    for address in plan.add:
        node = fleet.add(
            address, spec.role, slots, labels=dict(spec.labels), source=spec.source, joining=True
        )
        group.joined(address, node.id)
        joining.append(node)
        log.info("%s: %s node %s (%s) found; joining", spec.source, spec.role, node.id, node.url)
    for node_id in plan.drain:
        node = nodes[node_id]
        fleet.drain(node, GONE)
        log.info(
            "%s: %s node %s (%s) no longer listed: draining its %d requests",
            spec.source,
            spec.role,
            node.id,
            node.url,
            len(node.bound),
        )
    for node_id in plan.rejoin:
        node = nodes[node_id]
        if fleet.rejoin(node, GONE):
            group.rejoined()
            joining.append(node)
            log.info("%s: %s node %s (%s) listed again; joining", *_named(spec, node))
    for node_id, force in group.sweep(fleet.clock(), drain_timeout, lambda i: _idle(nodes[i])):
        node = nodes[node_id]
        held = len(node.bound)
        fleet.remove(node, force=True)
        if force:
            log.warning(
                "%s: %s node %s (%s) removed %g s after it left DNS, failing its %d requests",
                spec.source,
                spec.role,
                node.id,
                node.url,
                drain_timeout,
                held,
            )
        else:
            log.info("%s: %s node %s (%s) drained and removed", *_named(spec, node))
    return joining


def _idle(node: Node) -> bool:
    return not node.bound and node.in_use == 0


def _named(spec: DnsSpec, node: Node) -> tuple[str, str, int, str]:
    return spec.source, spec.role, node.id, node.url


def _log_outcome(group: Group, answer: Answer) -> None:
    # By outcome only: a server that is away answers "refused" and "timed out" by turns.
    outcome = answer.outcome
    previous, group.last = group.last, outcome
    if outcome == previous:
        return
    if outcome == "failed":
        log.warning(
            "%s: lookup failed: %s; the fleet is kept as it is", group.spec.source, answer.failure
        )
    elif outcome == "empty":
        log.warning("%s: the name lists no address; the fleet is kept as it is", group.spec.source)
    elif previous is not None:
        log.info(
            "%s: lookups answer again (%d addresses)", group.spec.source, len(answer.addresses)
        )

"""The discovery loop: every ``--discovery-interval`` seconds, resolve each name and apply
what its group decides (``discovery/rules.py``) through the membership
(``fleet/membership.py``): this process's fleet, or with ``--state`` the fleet every router
shares.

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

from pd_router.discovery.rules import Answer, Discovery, DnsSpec, Group
from pd_router.errors import StateUnavailable
from pd_router.fleet.membership import Membership
from pd_router.fleet.nodes import Node, State
from pd_router.fleet.registry import Fleet

log = logging.getLogger("pd_router.discovery")

Lookup = Callable[[DnsSpec], Awaitable[Answer]]
Probe = Callable[[Node], Coroutine[Any, Any, None]]


async def discover_forever(
    discovery: Discovery, fleet: Fleet, membership: Membership, lookup: Lookup, probe: Probe
) -> None:
    while True:
        await discover_once(discovery, fleet, membership, lookup, probe)
        await anyio.sleep(discovery.interval)


async def discover_once(
    discovery: Discovery, fleet: Fleet, membership: Membership, lookup: Lookup, probe: Probe
) -> None:
    answers: dict[int, Answer] = {}

    async def ask(index: int, group: Group) -> None:
        answers[index] = await lookup(group.spec)

    async with anyio.create_task_group() as tg:
        for index, group in enumerate(discovery.groups):
            tg.start_soon(ask, index, group)
    joining: list[Node] = []
    for index, group in enumerate(discovery.groups):
        joining += await apply(group, answers[index], fleet, discovery, membership)
    async with anyio.create_task_group() as tg:
        for node in joining:
            tg.start_soon(probe, node)


async def apply(
    group: Group, answer: Answer, fleet: Fleet, discovery: Discovery, membership: Membership
) -> list[Node]:
    """One answer into the fleet, through ``membership`` (with ``--state``, the fleet of
    every router); returns the nodes that joined (to be probed)."""
    spec = group.spec
    _log_outcome(group, answer)
    nodes = {node.id: node for node in fleet.nodes}
    # A node of this name that no group holds is another router's find (--state): this
    # router's lookup takes it on if it lists the address.
    held = {member.node_id for g in discovery.groups for member in g.members.values()}
    # Of this role only: one engine may be a prefill node and a decode node.
    taken = {
        node.url
        for node in nodes.values()
        if node.role == spec.role and (node.source != spec.source or node.id in held)
    }
    plan = group.update(answer, taken, nodes)
    joining = []
    slots = spec.slots or (discovery.decode_slots if spec.role == "decode" else 1)
    drain_timeout = discovery.drain_timeout
    now = fleet.clock()
    try:
        for address in plan.add:
            found = await membership.discovered(
                address, spec.role, slots, dict(spec.labels), spec.source
            )
            if found is None or found.source != spec.source:
                continue  # removed meanwhile, or another source's node (--state)
            group.joined(address, found.id)
            joining.append(found)
            log.info("%s: %s node %s (%s) found; %s", *_named(spec, found), found.state.value)
        for node_id in plan.drain:
            node = nodes[node_id]
            heir = next(
                (
                    other
                    for other in discovery.groups
                    if other is not group
                    and other.spec.role == spec.role
                    and node.url in other.addresses
                ),
                None,
            )
            if heir is not None:
                group.hand_over(node_id, heir)
                log.info(
                    "%s: %s node %s (%s) no longer listed, but %s lists it: kept",
                    *_named(spec, node),
                    heir.spec.source,
                )
                continue
            await membership.gone(node)
            group.left(node_id, now)
            log.info(
                "%s: %s node %s (%s) no longer listed: draining its %d requests",
                *_named(spec, node),
                len(node.bound),
            )
        for node_id in plan.rejoin:
            node = nodes[node_id]
            rejoined = await membership.back(node)
            group.back(node_id, rejoined)
            if rejoined:
                joining.append(node)
                log.info("%s: %s node %s (%s) listed again; joining", *_named(spec, node))
        for address, node_id, force in group.sweep(now, drain_timeout, lambda i: _idle(nodes[i])):
            node = nodes[node_id]
            if node.state is not State.DRAINING:
                # Taken back since it left this name (an operator added it again; with
                # --state, a router that lists it undid the drain), whatever its health
                # since: not this name's to remove, and no longer followed by it (listed
                # again, it is found again).
                group.released(address)
                log.info(
                    "%s: %s node %s (%s) is %s again, though no longer listed: kept",
                    *_named(spec, node),
                    node.state.value,
                )
                continue
            held_requests = len(node.bound)
            try:
                await membership.retire(node, force)
            except ValueError as exc:
                log.info("%s: %s; removal tried again next round", spec.source, exc)
                continue
            group.removed(address)
            if force:
                log.warning(
                    "%s: %s node %s (%s) removed %g s after it left DNS, failing its %d requests",
                    *_named(spec, node),
                    drain_timeout,
                    held_requests,
                )
            else:
                log.info("%s: %s node %s (%s) drained and removed", *_named(spec, node))
    except StateUnavailable:
        pass  # --state with Redis away (the pool logs it): what was not made is planned again
    return joining


def _idle(node: Node) -> bool:
    return not node.bound and node.in_use == 0


def _named(spec: DnsSpec, node: Node) -> tuple[str, str, int, str]:
    return spec.source, spec.role, node.id, node.url


def _log_outcome(group: Group, answer: Answer) -> None:
    # By outcome only: a server that is away answers "refused" and "timed out" by turns.
    if answer.failure is None and answer.unknown != group.last_unknown:
        group.last_unknown = answer.unknown
        if answer.unknown:
            log.warning(
                "%s: %s lookups fail (%s); the addresses of %s are kept as they are",
                group.spec.source,
                " and ".join(sorted(answer.unknown)),
                answer.partial,
                " and ".join(sorted(answer.unknown)),
            )
        else:
            log.info("%s: lookups of every address family answer again", group.spec.source)
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

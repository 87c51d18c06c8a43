"""The live fleet: every node by stable id, the decode pool, and the binding table. No I/O.

The binding table is the truth for what a node's death affects: a request is bound to its
decode node from reservation to its end, and to its prefill node while prefilling. A
binding is removed on every path (end, abort, eviction), so the table never outgrows the
requests in flight.

A node's death fails exactly the requests bound to it, each through its own handle, once;
nothing else is touched. The request whose own attempt showed the node dead is spared: it
already has its error, and goes to another node if the engine never got it. Failing is
synchronous: each request is cancelled and sends its own one terminal error from its own
cleanup point.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from .errors import NodeDead, RouterError, Unavailable
from .nodes import HealthPolicy, Node, Role, RoundRobin, State
from .pool import DecodePool

log = logging.getLogger("pd_router.fleet")


class Handle(Protocol):
    """What the fleet needs of an in-flight request."""

    request_id: str

    def fail(self, error: RouterError) -> None:
        """End the request with ``error`` as its one terminal outcome (idempotent)."""


class Binding:
    __slots__ = ("handle", "prefill", "decode")

    def __init__(self, handle: Handle, decode: Node) -> None:
        self.handle = handle
        self.decode = decode
        self.prefill: Node | None = None


class Fleet:
    def __init__(
        self, prefill: list[Node], decode: list[Node], policy: HealthPolicy | None = None
    ) -> None:
        self.policy = policy or HealthPolicy()
        self.prefill = RoundRobin(prefill)
        self.pool = DecodePool(decode)
        self.bindings: dict[str, Binding] = {}
        self._next_id = len(prefill) + len(decode)

    @property
    def nodes(self) -> list[Node]:
        return [*self.prefill.nodes, *self.pool.nodes]

    def node(self, node_id: int) -> Node | None:
        return next((node for node in self.nodes if node.id == node_id), None)

    def serving_view(self) -> list[int]:
        """Original nodes minus dead minus draining: what new requests can land on."""
        return [node.id for node in self.nodes if node.serving]

    # Bindings

    def unique_id(self, request_id: str) -> str:
        """Ids are the keys of the table and of abort-by-id: a reused one gets a suffix."""
        candidate, n = request_id, 1
        while candidate in self.bindings:
            n += 1
            candidate = f"{request_id}.{n}"
        return candidate

    @contextmanager
    def bind(self, handle: Handle, decode: Node) -> Iterator[Binding]:
        binding = Binding(handle, decode)
        rid = handle.request_id
        self.bindings[rid] = binding
        decode.bound.add(rid)
        try:
            yield binding
        finally:
            self.set_prefill(binding, None)
            binding.decode.bound.discard(rid)
            if self.bindings.get(rid) is binding:
                del self.bindings[rid]

    def set_decode(self, binding: Binding, node: Node) -> None:
        rid = binding.handle.request_id
        binding.decode.bound.discard(rid)
        binding.decode = node
        node.bound.add(rid)

    def set_prefill(self, binding: Binding, node: Node | None) -> None:
        rid = binding.handle.request_id
        if binding.prefill is not None:
            binding.prefill.bound.discard(rid)
        binding.prefill = node
        if node is not None:
            node.bound.add(rid)

    # What the prober and the relay saw

    def failed(
        self, node: Node, error: str, *, fatal: bool = False, reporter: Handle | None = None
    ) -> None:
        """``reporter``, the request that saw the failure, already has its own error and
        deals with it (a request the engine never got goes to another node): the node's
        death does not fail it."""
        if node.failed(error, self.policy, fatal=fatal):
            message = f"{node.role} node {node.id} ({node.url}) is dead: {error}"
            failing = self.fail_bound(node, NodeDead(message), spare=reporter)
            log.warning("%s; failing its %d requests", message, failing)
            self._decode_changed()

    def succeeded(self, node: Node) -> None:
        if node.succeeded(self.policy):
            log.warning("%s node %s (%s) is back: readmitted", node.role, node.id, node.url)
            self.pool.wake()

    def _decode_changed(self) -> None:
        """No decode node takes new requests any more: queued waiters are told at once."""
        if not any(node.serving for node in self.pool.nodes):
            self.pool.fail_waiters(Unavailable("no live decode node"))

    def fail_bound(self, node: Node, error: RouterError, spare: Handle | None = None) -> int:
        failing = 0
        for rid in list(node.bound):
            binding = self.bindings.get(rid)
            if binding is not None and binding.handle is not spare:
                binding.handle.fail(error)
                failing += 1
        return failing

    # Administration

    def add(self, url: str, role: Role, slots: int) -> Node:
        node = Node(id=self._next_id, url=url, slots=slots, role=role)
        self._next_id += 1
        if role == "decode":
            self.pool.nodes.append(node)
            self.pool.wake()
        else:
            self.prefill.nodes.append(node)
        return node

    def drain(self, node: Node) -> None:
        if node.state is State.SERVING:
            node.state = State.DRAINING
            self._decode_changed()

    def remove(self, node: Node, *, force: bool = False) -> None:
        """Forget a drained (or dead) node; ``force`` fails its bound requests first."""
        if node.bound and not force:
            raise ValueError(f"node {node.id} still has {len(node.bound)} requests in flight")
        if node.state is State.SERVING and not force:
            raise ValueError(f"node {node.id} is serving: drain it first")
        node.state = State.DEAD
        self.fail_bound(node, NodeDead(f"{node.role} node {node.id} ({node.url}) was removed"))
        group = self.pool.nodes if node.role == "decode" else self.prefill.nodes
        group.remove(node)
        self._decode_changed()

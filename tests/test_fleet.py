"""The live fleet's rules with no server, under asyncio and trio: bindings, death,
readmission, drain and removal."""

from __future__ import annotations

import anyio
import pytest

from pd_router.errors import NodeDead, RouterError, Unavailable
from pd_router.fleet import Fleet
from pd_router.nodes import HealthPolicy, Node, State

pytestmark = pytest.mark.anyio


class Request:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.errors: list[RouterError] = []

    def fail(self, error: RouterError) -> None:
        self.errors.append(error)


def make_fleet(decode: int = 2, slots: int = 1) -> Fleet:
    prefill = [Node(id=0, url="http://p0", slots=1, role="prefill")]
    nodes = [Node(id=i + 1, url=f"http://d{i}", slots=slots) for i in range(decode)]
    return Fleet(prefill, nodes, HealthPolicy(unhealthy_after=3, healthy_after=2))


async def test_a_dead_decode_node_fails_only_its_own_requests_once() -> None:
    fleet = make_fleet(decode=2, slots=4)
    requests = [Request(f"r{i}") for i in range(8)]
    with_bindings = []
    for request in requests:
        reservation = await fleet.pool.acquire(0)
        binding = fleet.bind(request, reservation.node)
        binding.__enter__()
        with_bindings.append((request, reservation, binding))
    d0 = fleet.pool.nodes[0]
    on_d0 = {r.request_id for r, res, _ in with_bindings if res.node is d0}
    assert len(on_d0) == 4 and d0.bound == on_d0
    fleet.failed(d0, "refused", fatal=True)
    fleet.failed(d0, "refused again", fatal=True)  # a second report changes nothing
    for request, reservation, binding in with_bindings:
        if request.request_id in on_d0:
            assert len(request.errors) == 1 and isinstance(request.errors[0], NodeDead)
            assert "node 1 (http://d0) is dead" in request.errors[0].message
        else:
            assert request.errors == []
        binding.__exit__(None, None, None)
        reservation.release()
    assert fleet.bindings == {} and all(not n.bound for n in fleet.nodes)
    assert fleet.pool.in_use == 0
    assert d0.state is State.DEAD
    for _ in range(4):
        reservation = await fleet.pool.acquire(0)
        assert reservation.node is not d0, "a dead node is never picked"
    assert fleet.serving_view() == [0, 2]


async def test_failures_count_up_to_the_threshold_and_successes_reset_them() -> None:
    fleet = make_fleet()
    node = fleet.pool.nodes[0]
    fleet.failed(node, "500")
    fleet.failed(node, "500")
    fleet.succeeded(node)
    fleet.failed(node, "500")
    fleet.failed(node, "500")
    assert node.state is State.SERVING and node.failures == 2
    fleet.failed(node, "timeout")
    assert node.state is State.DEAD and node.last_error == "timeout"


async def test_no_live_decode_node_fails_waiters_at_once_and_new_requests_too() -> None:
    fleet = make_fleet(decode=1)
    held = await fleet.pool.acquire(0)
    failures: list[Unavailable] = []

    async def waiter() -> None:
        try:
            await fleet.pool.acquire(60)
        except Unavailable as error:
            failures.append(error)

    with anyio.fail_after(5):  # not the 60 s queue timeout
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(waiter)
            while fleet.pool.queue_depth < 3:
                await anyio.sleep(0)
            fleet.failed(fleet.pool.nodes[0], "refused", fatal=True)
    assert len(failures) == 3 and all(e.status == 503 for e in failures)
    assert str(failures[0]) == "no live decode node"
    with pytest.raises(Unavailable):
        await fleet.pool.acquire(60)
    held.release()
    assert fleet.pool.in_use == 0


async def test_a_readmitted_node_serves_the_queue() -> None:
    fleet = make_fleet(decode=2)
    d0, d1 = fleet.pool.nodes
    fleet.failed(d0, "refused", fatal=True)
    held = await fleet.pool.acquire(0)
    assert held.node is d1
    served: list[Node] = []

    async def waiter() -> None:
        async with fleet.pool.reserve(10) as reservation:
            served.append(reservation.node)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        while fleet.pool.queue_depth < 1:
            await anyio.sleep(0)
        fleet.succeeded(d0)
        assert d0.state is State.DEAD, "one probe is not enough"
        fleet.succeeded(d0)
        assert d0.state is State.SERVING
    assert served == [d0]
    held.release()


async def test_drain_then_remove_with_stable_ids() -> None:
    fleet = make_fleet(decode=2)
    d0, d1 = fleet.pool.nodes
    request = Request("r1")
    reservation = await fleet.pool.acquire(0)
    assert reservation.node is d0
    binding = fleet.bind(request, d0)
    binding.__enter__()
    fleet.drain(d0)
    assert (await fleet.pool.acquire(0)).node is d1, "no new request lands on a draining node"
    with pytest.raises(ValueError, match="in flight"):
        fleet.remove(d0)
    with pytest.raises(ValueError, match="drain it first"):
        fleet.remove(d1)
    binding.__exit__(None, None, None)
    reservation.release()
    fleet.remove(d0)
    added = fleet.add("http://d9", "decode", 2)
    assert [n.id for n in fleet.nodes] == [0, 2, 3] and added.id == 3
    assert request.errors == []


async def test_forced_removal_fails_the_bound_requests() -> None:
    fleet = make_fleet(decode=1)
    request = Request("r1")
    reservation = await fleet.pool.acquire(0)
    with fleet.bind(request, reservation.node):
        fleet.remove(reservation.node, force=True)
        assert len(request.errors) == 1 and "removed" in request.errors[0].message
    reservation.release()
    assert fleet.pool.nodes == [] and fleet.bindings == {}


async def test_reused_request_ids_get_a_suffix() -> None:
    fleet = make_fleet()
    reservation = await fleet.pool.acquire(0)
    with fleet.bind(Request("same"), reservation.node):
        assert fleet.unique_id("same") == "same.2"
    assert fleet.unique_id("same") == "same"

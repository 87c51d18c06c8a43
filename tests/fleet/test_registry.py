"""The live fleet's rules with no server, under asyncio and trio: bindings, the two
verdicts (unhealthy, dead) and their evidence, readmission, drain and removal."""

from __future__ import annotations

import anyio
import pytest

from pd_router.errors import Evidence, NodeDead, RouterError, Unavailable
from pd_router.fleet.holdings import describe
from pd_router.fleet.nodes import Failure, HealthPolicy, Node, State
from pd_router.fleet.registry import GONE, LOOP, LOOP_HOLD, TIMEOUT, TIMEOUT_HOLD, Fleet

pytestmark = pytest.mark.anyio

REFUSED = Failure("unreachable", "connection refused", Evidence.FATAL)
BROKEN = Failure("broken stream", "stream broken", Evidence.HARD)
SLOW = Failure("probe timeout", "no answer within 1 s", Evidence.SOFT)
HTTP_500 = Failure("http 5xx", "500", Evidence.SOFT)


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
    fleet.failed(d0, REFUSED)
    fleet.failed(d0, REFUSED)  # a second report changes nothing
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


async def test_a_drained_node_refusing_probes_lets_its_requests_finish_and_stays_drained() -> None:
    """An engine shutting down gracefully (its pod scaled down: gone from DNS, then
    terminated) refuses new connections, probes included, while it completes the requests
    it holds. Its node, drained, takes no new work whatever the evidence, and its requests
    are not failed for it: each learns from its own connection if the engine did die. Before,
    refused probes made it dead, its requests but flowing streams failed with it (a 502
    within seconds for a non-streamed request), and good probes later made it serving again,
    the drain forgotten."""
    fleet = make_fleet(decode=2, slots=2)
    d0 = fleet.pool.nodes[0]
    request = Request("finishing")
    reservation = await fleet.pool.acquire(0)
    assert reservation.node is d0
    with fleet.bind(request, d0):
        fleet.drain(d0)
        for _ in range(5):
            fleet.failed(d0, REFUSED)
        assert (d0.state, request.errors, d0.bound) == (State.DRAINING, [], {"finishing"})
        for _ in range(3):
            fleet.probed(d0)
        assert d0.state is State.DRAINING
    reservation.release()
    for _ in range(3):
        reservation = await fleet.pool.acquire(0)
        assert reservation.node is not d0, "a drained node takes no new work"
        reservation.release()


async def test_soft_failures_make_a_node_unhealthy_never_dead() -> None:
    fleet = make_fleet()
    node = fleet.pool.nodes[0]
    fleet.failed(node, HTTP_500)
    fleet.failed(node, HTTP_500)
    fleet.served(node)  # a real request that succeeded ends the streak
    fleet.failed(node, SLOW)
    fleet.failed(node, SLOW)
    assert node.state is State.SERVING and node.failures == 2
    fleet.failed(node, SLOW)
    assert node.state is State.UNHEALTHY and node.reason == "probe timeout"
    for _ in range(20):
        fleet.failed(node, SLOW)
    assert node.state is State.UNHEALTHY, "slow is not dead, however long"


async def test_hard_failures_in_a_row_make_a_node_dead_and_a_refusal_at_once() -> None:
    fleet = make_fleet(decode=3)
    d0, d1, d2 = fleet.pool.nodes
    fleet.failed(d0, BROKEN)
    fleet.failed(d0, SLOW)  # soft failures do not end a streak of hard ones
    fleet.failed(d0, BROKEN)
    assert d0.state is State.UNHEALTHY  # three failures in a row, two of them hard
    fleet.failed(d0, BROKEN)
    assert d0.state is State.DEAD and d0.reason == "broken stream"
    fleet.failed(d1, REFUSED)
    assert d1.state is State.DEAD and d1.reason == "unreachable"
    assert d2.state is State.SERVING


async def test_an_unhealthy_node_keeps_its_requests_and_gets_no_new_ones() -> None:
    fleet = make_fleet(decode=2, slots=4)
    d0, d1 = fleet.pool.nodes
    request = Request("running")
    reservation = await fleet.pool.acquire(0)
    assert reservation.node is d0
    with fleet.bind(request, d0):
        for _ in range(3):
            fleet.failed(d0, SLOW)
        assert d0.state is State.UNHEALTHY
        assert request.errors == [], "unhealthy fails nothing"
        for _ in range(4):
            assert (await fleet.pool.acquire(0)).node is d1
        assert fleet.serving_view() == [0, 2]
    reservation.release()


async def test_with_every_node_unhealthy_new_requests_still_go_to_them() -> None:
    """A slow engine serves better than a 503: with no serving node of a role, the
    unhealthy ones take new requests (never the dead or draining ones)."""
    fleet = make_fleet(decode=2, slots=2)
    d0, d1 = fleet.pool.nodes
    prefill = fleet.prefill.nodes[0]
    for node in (d0, d1, prefill):
        for _ in range(3):
            fleet.failed(node, SLOW)
    assert {d0.state, d1.state, prefill.state} == {State.UNHEALTHY}
    assert fleet.prefill.pick(0) is prefill
    taken = [await fleet.pool.acquire(0) for _ in range(2)]
    assert {r.node for r in taken} == {d0, d1}
    fleet.failed(d0, REFUSED)
    assert (await fleet.pool.acquire(0)).node is d1, "a dead node is never used"
    fleet.probed(d1)
    fleet.probed(d1)
    assert d1.state is State.SERVING and fleet.serving_view() == [0, 2]
    fleet.probed(prefill)
    fleet.probed(prefill)
    assert fleet.prefill.pick(0) is prefill and prefill.state is State.SERVING


async def test_a_stalled_node_fails_its_silent_streams_and_is_held_out() -> None:
    now = [100.0]
    prefill = [Node(id=0, url="http://p0", slots=1, role="prefill")]
    decode = [Node(id=1, url="http://d0", slots=4), Node(id=2, url="http://d1", slots=4)]
    fleet = Fleet(prefill, decode, HealthPolicy(3, 2), clock=lambda: now[0])
    d0 = decode[0]
    stalled, waiting = Request("stalled"), Request("waiting for its KV")
    with fleet.bind(stalled, d0) as silent, fleet.bind(waiting, d0):
        fleet.stalled(d0, [silent], 42.0, hold=30.0)
        assert [e.code for e in stalled.errors] == ["stalled"] and waiting.errors == []
        assert stalled.errors[0].status == 504 and "42 s" in stalled.errors[0].message
    assert d0.state is State.UNHEALTHY and d0.reason == "stalled"
    assert d0.last_error is not None and d0.last_error.startswith("stalled 42 s")
    # Its /health says 200 all along: good probes readmit it only after the hold.
    for _ in range(5):
        fleet.probed(d0)
    assert d0.state is State.UNHEALTHY
    now[0] += 30
    fleet.probed(d0)
    assert d0.state is State.SERVING


def test_a_node_that_loops_is_dead_at_once_and_held_out() -> None:
    now = [100.0]
    prefill = [Node(id=0, url="http://p0", slots=1, role="prefill")]
    decode = [Node(id=1, url="http://d0", slots=4), Node(id=2, url="http://router-b", slots=4)]
    fleet = Fleet(prefill, decode, HealthPolicy(3, 2), clock=lambda: now[0])
    loop = decode[1]
    fleet.failed(loop, Failure(LOOP, "loop detected: ...", Evidence.FATAL))
    assert loop.state is State.DEAD and loop.reason == "loop"
    # Another router's /health answers 200: probes readmit it only after the hold.
    for _ in range(5):
        fleet.probed(loop)
    assert loop.state is State.DEAD
    now[0] += LOOP_HOLD
    fleet.probed(loop)
    assert loop.state is State.SERVING


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
            fleet.failed(fleet.pool.nodes[0], REFUSED)
    assert len(failures) == 3 and all(e.status == 503 for e in failures)
    assert str(failures[0]) == "no live decode node"
    with pytest.raises(Unavailable):
        await fleet.pool.acquire(60)
    held.release()
    assert fleet.pool.in_use == 0


async def test_a_readmitted_node_serves_the_queue() -> None:
    fleet = make_fleet(decode=2)
    d0, d1 = fleet.pool.nodes
    fleet.failed(d0, REFUSED)
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
        fleet.probed(d0)
        assert d0.state is State.DEAD, "one probe is not enough"
        fleet.probed(d0)
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


def test_request_ids_are_unique_from_arrival_to_end() -> None:
    """Queued requests (no slot, no binding yet) hold their id too."""
    fleet = make_fleet()
    first, second, third = Request("same"), Request("same"), Request("same")
    assert fleet.admit("same", first) == "same"
    assert fleet.admit("same", second) == "same.2"
    assert fleet.requests == {"same": first, "same.2": second}
    fleet.leave("same")
    assert fleet.admit("same", third) == "same"


async def test_a_death_spares_the_streams_still_flowing_on_the_node() -> None:
    """Refused probes (an engine shutting down gracefully refuses new connections) never
    end a stream whose bytes still flow: it ends on its own, whole or broken."""
    fleet = make_fleet(decode=1, slots=4)
    (d0,) = fleet.pool.nodes
    flowing, silent, unstarted = Request("flowing"), Request("silent"), Request("no KV yet")
    with fleet.bind(flowing, d0) as a, fleet.bind(silent, d0) as b, fleet.bind(unstarted, d0):
        a.stream = b.stream = object()  # type: ignore[assignment]
        b.silent = 3.0
        for _ in range(3):
            fleet.failed(d0, Failure("probe refused", "refused", Evidence.HARD))
        assert d0.state is State.DEAD
        assert flowing.errors == []
        assert [type(e) for e in silent.errors + unstarted.errors] == [NodeDead, NodeDead]
        fleet.remove(d0, force=True)  # an operator's forced removal spares nothing
        assert len(flowing.errors) == 1


def test_good_probes_do_not_hide_requests_failing() -> None:
    """An engine whose /health answers while every generation fails (5xx): the requests'
    failures add up to unhealthy however the probes answer between them. Before, each good
    probe ended the streak, and the node served failure after failure for as long as its
    probes passed. A probe's own failures are still ended by a good probe."""
    fleet = make_fleet(decode=2)
    d0 = fleet.pool.nodes[0]
    for _ in range(2):
        fleet.failed(d0, Failure("http 5xx", "HTTP 500", Evidence.SOFT))
        fleet.probed(d0)
    assert d0.state is State.SERVING and d0.failures == 2
    fleet.failed(d0, Failure("http 5xx", "HTTP 500", Evidence.SOFT))
    assert d0.state is State.UNHEALTHY
    # Readmitted by probes, afresh; then a real request's success ends what is left.
    for _ in range(2):
        fleet.probed(d0)
    assert d0.state is State.SERVING and d0.failures == 0
    timeout = Failure("probe timeout", "no answer", Evidence.SOFT)
    for _ in range(2):
        fleet.failed(d0, timeout, probe=True)
        fleet.probed(d0)
    fleet.failed(d0, timeout, probe=True)
    assert d0.state is State.SERVING and d0.failures == 1, "probes' streaks end at a good one"


def test_undoing_a_drain_gives_the_node_back_its_health() -> None:
    """A drained node added again (an operator), or listed again in DNS while probing is
    off, is what it was before its drain, less what the evidence said since: unhealthy
    stays unhealthy until good probes readmit it. Before, it came back serving whatever
    its health."""
    fleet = make_fleet(decode=2)
    d0 = fleet.pool.nodes[0]
    for _ in range(3):
        fleet.failed(d0, Failure("probe timeout", "slow", Evidence.SOFT), probe=True)
    assert d0.state is State.UNHEALTHY
    reason = d0.reason
    fleet.drain(d0)
    fleet.undrain(d0)
    assert (d0.state, d0.reason) == (State.UNHEALTHY, reason), "its reason back with it"
    for _ in range(2):
        fleet.probed(d0)
    assert d0.state is State.SERVING
    # Serving when drained, failing since: unhealthy once the drain is undone.
    fleet.drain(d0, "gone")
    for _ in range(3):
        fleet.failed(d0, Failure("probe timeout", "slow", Evidence.SOFT), probe=True)
    assert fleet.rejoin(d0, "gone", joining=False) and d0.state is State.UNHEALTHY


def test_a_node_found_dead_forgets_what_it_was_predicted_to_hold() -> None:
    """A dead engine most often comes back as a new process with an empty cache: what the
    router predicted it held is forgotten at the verdict, its own or another router's.
    Before, a decode node readmitted after a restart was still predicted to hold a long
    conversation, and ``--max-local-prefill`` sent it the whole history to compute."""
    fleet = make_fleet(decode=2)
    first, second = fleet.pool.nodes
    prompt = describe({"model": "m", "prompt": "lorem ipsum " * 3000}, fleet.kv.ratio)
    for node in (first, second):
        fleet.kv.placed(node.id, node.role, node.url, prompt)
        assert fleet.kv.of(node.id).held(prompt.chunks) == len(prompt.chunks)
    fleet.failed(first, REFUSED)
    fleet.told(second, State.DEAD, "unreachable", "connection refused")
    assert first.state is State.DEAD and second.state is State.DEAD
    for node in (first, second):
        assert fleet.kv.of(node.id).held(prompt.chunks) == 0


def test_a_prefill_timeout_holds_its_node_out_only_once_it_made_it_unhealthy() -> None:
    """A prefill silent for the read timeout is a soft failure; the node is held out 60 s
    once such failures made it unhealthy, not on the first one (a node that stays serving
    would keep a later, unrelated verdict the longer)."""
    now = [1000.0]
    fleet = make_fleet()
    fleet.clock = lambda: now[0]
    prefill = fleet.prefill.nodes[0]
    timeout = Failure(TIMEOUT, "no byte from the engine for 600 s", Evidence.SOFT)
    fleet.failed(prefill, timeout)
    assert prefill.state is State.SERVING and prefill.hold_until == 0
    fleet.failed(prefill, HTTP_500)
    fleet.failed(prefill, HTTP_500)
    assert prefill.state is State.UNHEALTHY and prefill.hold_until == 0
    for _ in range(2):
        fleet.probed(prefill)
    assert prefill.state is State.SERVING, "an unrelated verdict: readmitted at once"
    for _ in range(3):
        fleet.failed(prefill, timeout)
    assert prefill.state is State.UNHEALTHY and prefill.hold_until == now[0] + TIMEOUT_HOLD
    for _ in range(2):
        fleet.probed(prefill)
    assert prefill.state is State.UNHEALTHY, "held out"
    now[0] += TIMEOUT_HOLD
    fleet.probed(prefill)
    assert prefill.state is State.SERVING


async def test_a_node_added_to_a_full_pool_serves_the_oldest_waiter_and_counts_the_slot() -> None:
    """``wake``: the waiters in the order they came, each slot it hands out counted."""
    fleet = make_fleet(decode=1)
    held = await fleet.pool.acquire(0)
    served: list[str] = []

    async def waiter(name: str) -> None:
        async with fleet.pool.reserve(10) as reservation:
            served.append(name)
            await anyio.sleep(0.05)
            assert reservation.node.in_use <= reservation.node.slots

    async with anyio.create_task_group() as tg:
        for name in "abc":
            tg.start_soon(waiter, name)
            while fleet.pool.queue_depth < "abc".index(name) + 1:
                await anyio.sleep(0)
        added = fleet.add("http://d9", "decode", 1)
        fleet.probed(added)
        fleet.probed(added)
        await anyio.sleep(0)
        assert added.in_use == 1 and fleet.pool.try_acquire() is None
    held.release()
    assert served == ["a", "b", "c"] and fleet.pool.in_use == 0


async def test_with_every_node_unhealthy_a_freed_slot_reaches_the_waiter() -> None:
    fleet = make_fleet(decode=1)
    (d0,) = fleet.pool.nodes
    for _ in range(3):
        fleet.failed(d0, SLOW)
    assert d0.state is State.UNHEALTHY
    held = await fleet.pool.acquire(0)
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fleet.pool.acquire, 10)
            while fleet.pool.queue_depth < 1:
                await anyio.sleep(0)
            held.release()
    assert fleet.pool.queue_depth == 0


def test_readmission_needs_good_probes_in_a_row() -> None:
    fleet = make_fleet(decode=1)
    (d0,) = fleet.pool.nodes
    for _ in range(3):
        fleet.failed(d0, SLOW, probe=True)
    fleet.probed(d0)
    fleet.failed(d0, SLOW, probe=True)
    fleet.probed(d0)
    assert d0.state is State.UNHEALTHY, "a failure between two good probes: not in a row"


def test_what_another_router_or_a_stall_says_leaves_a_drained_node_drained() -> None:
    """A drained node finishes what it holds: a stall, another router's dead or unhealthy
    verdict, neither fails its requests nor puts it back into service."""
    fleet = make_fleet(decode=2)
    d0, d1 = fleet.pool.nodes
    request = Request("r1")
    with fleet.bind(request, d0):
        fleet.drain(d0)
        fleet.stalled(d0, [], 30.0, 60.0)
        fleet.told(d0, State.DEAD, "unreachable", "refused (found by router x)")
        fleet.told(d0, State.UNHEALTHY, "probe timeout", "slow (found by router x)")
        assert d0.state is State.DRAINING and d0.id not in fleet.serving_view()
        assert request.errors == []
    fleet.failed(d1, REFUSED)
    fleet.stalled(d1, [], 30.0, 60.0)
    assert d1.state is State.DEAD, "a stall does not revive a dead node as unhealthy"


def test_an_operators_drain_holds_a_dead_node_out_and_outlasts_dns() -> None:
    fleet = make_fleet(decode=2)
    d0, d1 = fleet.pool.nodes
    fleet.failed(d0, REFUSED)
    fleet.drain(d0)
    fleet.probed(d0)
    fleet.probed(d0)
    assert d0.state is State.DRAINING, "good probes do not undo an operator's drain"
    fleet.drain(d1, GONE)
    fleet.drain(d1)  # the operator's now
    assert not fleet.rejoin(d1, GONE) and d1.state is State.DRAINING


def test_an_unhealthy_node_is_drained_before_it_is_removed() -> None:
    fleet = make_fleet(decode=2)
    d0, _ = fleet.pool.nodes
    for _ in range(3):
        fleet.failed(d0, SLOW)
    assert d0.state is State.UNHEALTHY
    with pytest.raises(ValueError, match="drain it first"):
        fleet.remove(d0)

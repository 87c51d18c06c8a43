"""What a router does with the shared fleet's records and verdicts (``membership.apply``),
with no server: nodes adopted under the fleet's ids, admin states, deaths and readmissions
found elsewhere failing only this router's requests on the node, once."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from pd_router.errors import Evidence, NodeDead
from pd_router.fleet.membership import LocalMembership, Record, Verdict, apply
from pd_router.fleet.nodes import Failure, HealthPolicy, Node, State
from pd_router.fleet.registry import GONE, Fleet
from tests.fleet.test_registry import Request

pytestmark = pytest.mark.anyio

P = Record(0, "prefill", "http://p0", 1)
D1 = Record(1, "decode", "http://d1", 4, {"zone": "a"})
D2 = Record(2, "decode", "http://d2", 4)
DEAD = Verdict(State.DEAD, "unreachable", "connection refused", "r-other")
SLOW = Verdict(State.UNHEALTHY, "probe timeout", "no answer within 1 s", "r-other")
BACK = Verdict(State.SERVING, None, "", "r-other")


def fleet_of(*records: Record) -> Fleet:
    fleet = Fleet([], [], HealthPolicy(unhealthy_after=3, healthy_after=2))
    apply(fleet, {r.id: r for r in records}, {})
    return fleet


def test_records_become_nodes_under_their_ids_and_follow_changes() -> None:
    fleet = fleet_of(P, Record(7, "decode", "http://d7", 2, {"zone": "b"}))
    d7 = fleet.node(7)
    assert d7 is not None and d7.slots == 2 and d7.labels == {"zone": "b"}
    assert [n.id for n in fleet.pool.nodes] == [7] and [n.id for n in fleet.prefill.nodes] == [0]
    records = {0: P, 7: Record(7, "decode", "http://d7", 5, {}, "draining")}
    apply(fleet, records, {})
    assert fleet.node(7) is d7 and d7.slots == 5 and d7.labels == {}
    assert d7.state is State.DRAINING and fleet.pool.capacity == 0
    apply(fleet, {**records, 7: Record(7, "decode", "http://d7", 5)}, {})
    assert d7.state is State.SERVING and fleet.pool.capacity == 5, "added again: serving"
    apply(fleet, {**records, 7: Record(7, "decode", "http://d7", 5, {}, "removed")}, {})
    assert fleet.node(7) is None and fleet.pool.nodes == []
    assert fleet.add("http://new", "decode", 1).id == 8, "a local id never takes a shared one"


def test_a_node_removed_and_added_again_unseen_starts_afresh_unless_it_has_requests() -> None:
    """A reload that came after both the removal and the add (``before``: what the fleet
    matched last) sees only a newer incarnation: the old node's death is not kept."""
    dead = Failure("unreachable", "connection refused", Evidence.FATAL)
    again = {0: P, 1: Record(1, "decode", "http://d1", 4, source="admin", incarnation=1)}
    for busy in (False, True):
        fleet = fleet_of(P, D1)
        d1 = fleet.node(1)
        assert d1 is not None
        fleet.failed(d1, dead)
        with fleet.bind(Request("r1"), d1) if busy else nullcontext():
            apply(fleet, again, {}, before={0: P, 1: D1})
        fresh = fleet.node(1)
        assert fresh is not None
        if busy:  # as if it had seen the removal: drained, not removed, then serving again
            assert fresh is d1 and d1.state is State.DEAD
        else:
            assert fresh is not d1 and fresh.state is State.JOINING and fresh.failures == 0
            apply(fleet, again, {}, before=again)
            assert fleet.node(1) is fresh, "the same incarnation read again changes nothing"


def test_a_removal_made_elsewhere_fails_what_still_runs_here_only_if_forced() -> None:
    fleet = fleet_of(P, D1, D2)
    d1 = fleet.node(1)
    assert d1 is not None
    late, other = Request("started-here-since"), Request("other")
    removed = {0: P, 1: Record(1, "decode", "http://d1", 4, {}, "removed"), 2: D2}
    with fleet.bind(late, d1):
        apply(fleet, removed, {})
        assert d1.state is State.DRAINING and fleet.node(1) is d1, "it finishes first"
    apply(fleet, removed, {})
    assert fleet.node(1) is None and late.errors == []
    fleet = fleet_of(P, D1, D2)
    d1 = fleet.node(1)
    assert d1 is not None
    here = Request("here")
    with fleet.bind(here, d1), fleet.bind(other, fleet.pool.nodes[1]):
        forced = {**removed, 1: Record(1, "decode", "http://d1", 4, {}, "removed", True)}
        apply(fleet, forced, {})
        apply(fleet, forced, {})
    assert [type(e) for e in here.errors] == [NodeDead] and other.errors == []
    assert "was removed" in here.errors[0].message and fleet.node(1) is None


def test_a_death_found_elsewhere_fails_only_this_routers_requests_on_it_once() -> None:
    fleet = fleet_of(P, D1, D2)
    d1, d2 = fleet.pool.nodes
    on_d1, on_d2 = Request("a"), Request("b")
    records = {0: P, 1: D1, 2: D2}
    with fleet.bind(on_d1, d1), fleet.bind(on_d2, d2):
        apply(fleet, records, {1: DEAD})
        apply(fleet, records, {1: DEAD})  # the same verdict read again changes nothing
        assert d1.state is State.DEAD and d1.reason == "unreachable"
        assert "found by router r-other" in (d1.last_error or "")
    assert len(on_d1.errors) == 1 and isinstance(on_d1.errors[0], NodeDead)
    assert on_d2.errors == []
    assert fleet.serving_view() == [0, 2]
    apply(fleet, records, {1: BACK})
    assert d1.state is State.SERVING and fleet.serving_view() == [0, 1, 2]
    with fleet.bind(on_d1, d1):
        apply(fleet, records, {1: SLOW})
    assert d1.state is State.UNHEALTHY and len(on_d1.errors) == 1, "unhealthy fails nothing"
    apply(fleet, records, {1: BACK})
    assert d1.state is State.SERVING


def test_a_readmission_found_elsewhere_waits_for_a_stall_hold_found_here() -> None:
    now = [100.0]
    fleet = Fleet([], [], clock=lambda: now[0])
    apply(fleet, {1: D1}, {})
    d1 = fleet.pool.nodes[0]
    fleet.stalled(d1, [], 30, hold=30)
    apply(fleet, {1: D1}, {1: BACK})
    assert d1.state is State.UNHEALTHY
    now[0] += 30
    apply(fleet, {1: D1}, {1: BACK})
    assert d1.state is State.SERVING


def test_a_verdict_found_here_and_not_yet_in_redis_stands_over_the_stored_one() -> None:
    fleet = fleet_of(P, D1)
    d1 = fleet.pool.nodes[0]
    fleet.failed(d1, Failure("unreachable", "refused", Evidence.FATAL))
    apply(fleet, {0: P, 1: D1}, {1: BACK}, own={d1})
    assert d1.state is State.DEAD
    apply(fleet, {0: P, 1: D1}, {1: BACK})
    assert d1.state is State.SERVING


def test_a_drained_node_stays_drained_whatever_its_verdicts() -> None:
    """A drained node takes no new work, and what it holds is let finish: another router's
    verdict that it is dead fails nothing here (its engine may be shutting down gracefully,
    refusing probes while it completes its requests)."""
    drained = Record(1, "decode", "http://d1", 4, {}, "draining")
    fleet = fleet_of(P, drained)
    d1 = fleet.pool.nodes[0]
    d1.bound.add("finishing")
    apply(fleet, {0: P, 1: drained}, {1: DEAD})
    assert d1.state is State.DRAINING and d1.bound == {"finishing"}
    apply(fleet, {0: P, 1: drained}, {1: BACK})
    assert d1.state is State.DRAINING


def test_the_fleet_tells_of_its_own_verdicts_only() -> None:
    fleet = fleet_of(P, D1, D2)
    told: list[tuple[int, State]] = []
    fleet.on_verdict = lambda node: told.append((node.id, node.state))
    d1, d2 = fleet.pool.nodes
    fleet.failed(d1, Failure("unreachable", "refused", Evidence.FATAL))
    fleet.failed(d1, Failure("unreachable", "refused", Evidence.FATAL))
    fleet.probed(d1)
    fleet.probed(d1)
    for _ in range(3):
        fleet.failed(d2, Failure("probe timeout", "slow", Evidence.SOFT))
    fleet.stalled(d1, [], 30, hold=0)
    apply(fleet, {0: P, 1: D1, 2: D2}, {2: DEAD})
    apply(fleet, {0: P, 1: D1, 2: D2}, {2: BACK})
    assert told == [(1, State.DEAD), (1, State.SERVING), (2, State.UNHEALTHY)]


def test_a_discovered_node_joins_and_a_dns_drain_is_undone_by_its_return_only() -> None:
    found = Record(5, "decode", "http://d5", 4, source="dns:decode.test:8200")
    fleet = fleet_of(P, found)
    d5 = fleet.node(5)
    assert d5 is not None and (d5.state, d5.source) == (State.JOINING, found.source)
    apply(fleet, {0: P, 5: found}, {5: BACK})
    assert d5.state is State.SERVING, "another router's first good probe admits it"
    gone = Record(5, "decode", "http://d5", 4, admin="draining", source=found.source, gone=True)
    assert Record.parse(5, gone.body(), gone.admin_value.encode()) == gone
    apply(fleet, {0: P, 5: gone}, {})
    assert (d5.state, d5.reason) == (State.DRAINING, GONE)
    apply(fleet, {0: P, 5: found}, {})
    assert d5.state is State.JOINING, "listed again: it joins afresh"
    apply(fleet, {0: P, 5: Record(5, "decode", "http://d5", 4, admin="draining")}, {})
    apply(fleet, {0: P, 5: found}, {})
    # An operator's drain undone by an operator's add: the node is as before the drain,
    # joining (before, serving though no probe had answered since it came back).
    assert d5.state is State.JOINING


def test_records_and_verdicts_read_back_as_written() -> None:
    assert Record.parse(1, D1.body(), b"draining") == Record(
        1, "decode", "http://d1", 4, {"zone": "a"}, "draining"
    )
    assert Verdict.parse(DEAD.body()) == DEAD
    with pytest.raises(ValueError):
        Record.parse(1, D1.body(), b"gone")
    forced = Record.parse(1, D1.body(), b"removed forced")
    assert forced.forced and forced.admin == "removed" and forced.admin_value == "removed forced"
    node = Node(id=3, url="http://d3", slots=2, labels={"gpu": "h100"})
    assert Record.of(node) == Record(3, "decode", "http://d3", 2, {"gpu": "h100"})


async def test_the_local_membership_is_the_fleet_of_this_process() -> None:
    fleet = fleet_of(P, D1)
    members = LocalMembership(fleet)
    node = await members.add("http://d9", "decode", 3, {"zone": "c"})
    assert node.id == 2 and node.labels == {"zone": "c"} and node in fleet.pool.nodes
    assert node.state is State.JOINING, "as every source's: serving from its first good probe"
    fleet.probed(node)
    with pytest.raises(ValueError, match="drain it first"):
        await members.remove(node, False)
    await members.drain(node)
    await members.remove(node, False)
    assert fleet.node(2) is None and await members.in_flight() is None

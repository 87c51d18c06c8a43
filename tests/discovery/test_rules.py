"""What a DNS answer changes in the fleet (``discovery/rules.py``, applied by
``discovery_loop.apply`` to a real ``Fleet``), with no server: specs, additions that join,
drains, rejoins, removals once empty or after the bound, and answers that change nothing."""

from __future__ import annotations

import logging

import anyio
import pytest

from pd_router.discovery.loop import apply
from pd_router.discovery.rules import IPV6, Answer, Discovery, Group, dns_spec, parse_dns_spec
from pd_router.errors import Evidence
from pd_router.fleet.membership import LocalMembership
from pd_router.fleet.nodes import Failure, Node, State, make_nodes
from pd_router.fleet.registry import GONE, Fleet

A, B, C = "http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://10.0.0.3:8200"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(*static: str) -> tuple[Fleet, Discovery, Clock]:
    clock = Clock()
    prefill = make_nodes(["http://p:1"], 1, role="prefill")
    fleet = Fleet(prefill, make_nodes(list(static), 4, first_id=1), clock=clock)
    spec = parse_dns_spec("decode.test:8200,slots=8,zone=a", "decode")
    return fleet, Discovery([Group(spec)], decode_slots=4, drain_timeout=30), clock


def answer(
    fleet: Fleet, discovery: Discovery, *addresses: str, failure: str | None = None
) -> list[Node]:
    return applied(discovery, Answer(frozenset(addresses), failure), fleet)


def applied(discovery: Discovery, answer: Answer, fleet: Fleet) -> list[Node]:
    """The loop's ``apply`` of the first name, through this process's fleet (no --state)."""
    group, members = discovery.groups[0], LocalMembership(fleet)
    return anyio.run(apply, group, answer, fleet, discovery, members)


def by_url(fleet: Fleet) -> dict[str, tuple[int, State]]:
    return {node.url: (node.id, node.state) for node in fleet.pool.nodes}


# Specs


@pytest.mark.parametrize(
    ("text", "name", "port", "slots", "labels"),
    [
        ("vllm-decode:8200", "vllm-decode", 8200, None, {}),
        (
            "vllm-decode.ns.svc.cluster.local.:8200,slots=8",
            "vllm-decode.ns.svc.cluster.local.",
            8200,
            8,
            {},
        ),
        ("d:1,zone=a,gpu=h100", "d", 1, None, {"zone": "a", "gpu": "h100"}),
        ("_http._tcp.vllm-decode,slots=2", "_http._tcp.vllm-decode", None, 2, {}),
        ("d:65535", "d", 65535, None, {}),
    ],
)
def test_specs(
    text: str, name: str, port: int | None, slots: int | None, labels: dict[str, str]
) -> None:
    spec = parse_dns_spec(text, "decode")
    assert (spec.name, spec.port, spec.slots, dict(spec.labels)) == (name, port, slots, labels)
    assert spec.srv is (port is None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vllm-decode", "the port is missing: NAME:PORT"),
        ("vllm-decode:0", "the port must be a whole number from 1 to 65535"),
        ("vllm-decode:http", "the port must be a whole number from 1 to 65535"),
        ("http://vllm-decode:8200", "expected a DNS name and port"),
        ("http://vllm-decode", "expected a DNS name and port"),
        ("vllm-decode:65536", "the port must be a whole number from 1 to 65535"),
        # ASCII digits only, as slots= and kv_events= take them (int() took all of these).
        ("d:8_200", "the port must be a whole number from 1 to 65535"),
        ("d:+8200", "the port must be a whole number from 1 to 65535"),
        ("d:٨٢٠٠", "the port must be a whole number from 1 to 65535"),
        ("bad name:1", "expected a DNS name and port"),
        ("_http._tcp.d:8200", "an SRV name (starting with _) takes its port from the records"),
        ("d:1,slots=0", "slots must be at least 1"),
        ("d:1,slots=x", "slots must be a whole number"),
        ("d:1,slots=1000001", "slots must be at most 1000000"),
        ("d:1,slots=٣", "slots must be a whole number"),
        ("d:1,kv_events=²", "kv_events must be a port number"),
        # More digits than int() reads: its own ValueError, which said so, before.
        ("d:" + "0" * 5000 + "1", "the port must be a whole number from 1 to 65535"),
        ("d:1,slots=" + "0" * 5000 + "1", "slots must be a whole number"),
        ("d:1,kv_events=" + "0" * 5000 + "1", "kv_events must be a port number"),
        ("d:1,slot=4", "unknown option 'slot' (did you mean slots?)"),
        ("d:1,zone", "expected KEY=VALUE options"),
        ("d:1,a b=c", "label name 'a b'"),
    ],
)
def test_bad_specs_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_dns_spec(text, "decode")
    assert str(raised.value).startswith(f"{text!r}: ") and message in str(raised.value)


def test_a_label_may_hold_a_url() -> None:
    """Only the name is no URL: a label's value is the operator's (it was refused as
    "expected a DNS name and port")."""
    spec = parse_dns_spec("d:8200,docs=http://wiki/decode", "decode")
    assert (spec.name, spec.port, dict(spec.labels)) == ("d", 8200, {"docs": "http://wiki/decode"})


def test_a_spec_from_a_table_is_checked_the_same_way() -> None:
    assert dns_spec("decode", "d", 8200, 2, {"zone": "a"}) == parse_dns_spec(
        "d:8200,slots=2,zone=a", "decode"
    )
    with pytest.raises(ValueError, match="port is missing"):
        dns_spec("decode", "d", None)
    # A config file's slots are bounded as a flag's are (they were not).
    with pytest.raises(ValueError, match="slots must be at most 1000000"):
        dns_spec("decode", "d", 8200, 2_000_000)


# Reconciliation


def test_new_addresses_join_with_the_groups_slots_labels_and_source() -> None:
    fleet, discovery, _ = setup()
    joined = answer(fleet, discovery, A, B)
    assert [node.url for node in joined] == [A, B]
    for node in joined:
        assert (node.state, node.slots, node.labels, node.source) == (
            State.JOINING,
            8,
            {"zone": "a"},
            "dns:decode.test:8200",
        )
    assert fleet.serving_view() == [0], "no request before a good probe"
    fleet.probed(joined[0])
    assert fleet.serving_view() == [0, joined[0].id]
    # Failures before the first good probe leave it joining: it never served.
    for _ in range(5):
        fleet.failed(joined[1], Failure("probe refused", "refused", Evidence.HARD))
    assert joined[1].state is State.JOINING
    assert answer(fleet, discovery, A, B) == [], "the same answer changes nothing"
    assert discovery.groups[0].changes["added"] == 2


def test_an_address_already_in_the_fleet_is_not_added_twice() -> None:
    fleet, discovery, _ = setup(A)
    assert [node.url for node in answer(fleet, discovery, A, B)] == [B]
    assert [node.url for node in fleet.pool.nodes] == [A, B]


@pytest.mark.parametrize("failure", [None, "A decode.test: no answer within 1 s"])
def test_a_failed_or_empty_lookup_changes_nothing(failure: str | None) -> None:
    fleet, discovery, _ = setup()
    for node in answer(fleet, discovery, A, B):
        fleet.probed(node)
    before = by_url(fleet)
    assert answer(fleet, discovery, failure=failure) == []
    assert by_url(fleet) == before
    group = discovery.groups[0]
    assert group.lookups == {
        "ok": 1,
        "empty": int(failure is None),
        "failed": int(failure is not None),
    }
    assert group.listed == 2, "the last real answer's count stays"


def test_a_gone_address_drains_and_is_removed_once_empty() -> None:
    fleet, discovery, clock = setup()
    a, b = answer(fleet, discovery, A, B)
    fleet.probed(a)
    fleet.probed(b)
    a.bound.add("r1")  # a request in flight on A
    a.in_use = 1
    answer(fleet, discovery, B)
    assert (a.state, a.reason) == (State.DRAINING, GONE)
    assert a in fleet.pool.nodes and fleet.serving_view() == [0, b.id]
    clock.now += 10
    answer(fleet, discovery, B)
    assert a in fleet.pool.nodes, "kept while its request runs"
    a.bound.clear()
    a.in_use = 0
    answer(fleet, discovery, B)
    assert a not in fleet.pool.nodes
    assert discovery.groups[0].changes == {"added": 2, "drained": 1, "rejoined": 0, "removed": 1}


def test_a_gone_node_still_busy_after_the_bound_is_removed_failing_its_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pd_router.discovery")
    fleet, discovery, clock = setup()
    (a,) = answer(fleet, discovery, A)
    fleet.probed(a)
    failed = []

    class Handle:
        request_id = "r1"

        def fail(self, error: object) -> None:
            failed.append(error)

    with fleet.bind(Handle(), a):
        answer(fleet, discovery, B)
        clock.now += 29
        answer(fleet, discovery, B)
        assert a in fleet.pool.nodes and not failed
        clock.now += 1
        answer(fleet, discovery, B)
        assert a not in fleet.pool.nodes
        assert [type(e).__name__ for e in failed] == ["NodeDead"]
        assert "was removed" in str(failed[0])
    (removal,) = (r for r in caplog.records if "removed" in r.getMessage())
    assert removal.levelno == logging.WARNING
    assert removal.getMessage().endswith("removed 30 s after it left DNS, failing its 1 requests")


def test_an_address_back_before_removal_rejoins_under_its_id_after_removal_gets_a_new_one() -> None:
    fleet, discovery, _ = setup()
    (a,) = answer(fleet, discovery, A)
    fleet.probed(a)
    a.bound.add("r1")
    answer(fleet, discovery, B)
    assert a.state is State.DRAINING
    rejoined = answer(fleet, discovery, A, B)
    assert a in rejoined and a.state is State.JOINING
    fleet.probed(a)
    assert a.state is State.SERVING and discovery.groups[0].changes["rejoined"] == 1
    a.bound.clear()
    answer(fleet, discovery, B)  # gone, and empty: removed at once
    assert a not in fleet.pool.nodes
    (again,) = (node for node in answer(fleet, discovery, A, B) if node.url == A)
    assert again.id != a.id


def test_an_operators_drain_is_not_undone_and_an_operators_removal_is_redone() -> None:
    fleet, discovery, _ = setup()
    a, b = answer(fleet, discovery, A, B)
    fleet.probed(a)
    fleet.drain(a)  # the operator's
    answer(fleet, discovery, A, B)
    assert (a.state, a.reason) == (State.DRAINING, "drained")
    fleet.remove(b, force=True)  # the operator's: the name still lists it
    (back,) = answer(fleet, discovery, A, B)
    assert back.url == B and back.id != b.id


class Handle:
    """A request bound to a node: what it is told when the node goes."""

    request_id = "r1"

    def __init__(self) -> None:
        self.errors: list[object] = []

    def fail(self, error: object) -> None:
        self.errors.append(error)


def test_a_gone_node_an_operator_added_again_is_kept_past_the_drain_bound() -> None:
    """The operator put the engine back (POST /admin/nodes: 200 serving): the name that
    lost its address no longer removes it, nor fails what runs on it."""
    fleet, discovery, clock = setup()
    (a,) = answer(fleet, discovery, A)
    fleet.probed(a)
    handle = Handle()
    with fleet.bind(handle, a):
        answer(fleet, discovery, B)
        assert (a.state, a.reason) == (State.DRAINING, GONE)
        fleet.add_again(a, 8, {})
        assert a.state is State.SERVING
        clock.now += 31  # past the drain bound (30 s)
        answer(fleet, discovery, B)
        answer(fleet, discovery, B)
        assert a in fleet.pool.nodes and a.state is State.SERVING and handle.errors == []
        assert A not in discovery.groups[0].members
        # Listed again: the name's again, the same node (before, adding it again raised at
        # every round, and no name's answers were applied any more).
        answer(fleet, discovery, A, B)
        assert discovery.groups[0].members[A].node_id == a.id and a.state is State.SERVING
        assert [n.url for n in fleet.pool.nodes].count(A) == 1


def test_a_gone_node_taken_back_is_kept_whatever_its_health_since() -> None:
    """Dead (its engine stopped answering) after the operator took it back: still not the
    name's to remove."""
    fleet, discovery, clock = setup()
    (a,) = answer(fleet, discovery, A)
    fleet.probed(a)
    a.bound.add("r1")
    answer(fleet, discovery, B)
    fleet.add_again(a, 8, {})
    for _ in range(fleet.policy.unhealthy_after):
        fleet.failed(a, Failure("connection refused", "refused", Evidence.HARD))
    assert a.state is State.DEAD
    clock.now += 31
    answer(fleet, discovery, B)
    assert a in fleet.pool.nodes


def test_a_stalled_node_whose_address_flaps_is_not_readmitted_by_one_good_probe() -> None:
    """A hung engine answers /health: its stall hold (and --healthy-after) must still run
    out after its address left DNS and came back, as without the flap."""
    fleet, discovery, clock = setup()
    (a,) = answer(fleet, discovery, A)
    fleet.probed(a)
    fleet.stalled(a, [], 30.0, hold=600.0)
    assert a.state is State.UNHEALTHY
    a.bound.add("r1")  # kept while it drains
    answer(fleet, discovery, B)
    assert (a.state, a.reason) == (State.DRAINING, GONE)
    answer(fleet, discovery, A, B)
    clock.now += 1
    fleet.probed(a)
    assert a.state is State.UNHEALTHY, "one good probe, its hold still running"
    clock.now += 600
    for _ in range(fleet.policy.healthy_after):
        fleet.probed(a)
    assert a.state is State.SERVING


def test_a_drained_dead_node_stays_out_when_its_engine_answers_again() -> None:
    fleet, discovery, _ = setup()
    (a,) = answer(fleet, discovery, A)
    fleet.probed(a)
    for _ in range(fleet.policy.unhealthy_after):
        fleet.failed(a, Failure("connection refused", "refused", Evidence.HARD))
    assert a.state is State.DEAD and a.reason is not None
    reason = a.reason
    fleet.drain(a)  # the operator's
    for _ in range(fleet.policy.healthy_after + 1):
        fleet.probed(a)
    assert a.state is State.DRAINING and a.id not in fleet.serving_view()
    fleet.undrain(a)
    # Back as the evidence left it, its reason with it: readmitted by probes.
    assert (a.state, a.reason) == (State.DEAD, reason)


def test_an_operators_drain_of_a_node_gone_from_dns_is_kept_when_the_address_returns() -> None:
    fleet, discovery, _ = setup()
    (a,) = answer(fleet, discovery, A)
    fleet.probed(a)
    a.bound.add("r1")  # kept while it drains
    answer(fleet, discovery, B)
    fleet.drain(a)  # the operator's, while it drains for DNS
    assert (a.state, a.reason) == (State.DRAINING, "drained")
    answer(fleet, discovery, A, B)
    assert (a.state, a.reason) == (State.DRAINING, "drained")
    assert discovery.groups[0].changes["rejoined"] == 0, "the node did not join again"


def test_a_joining_node_gone_before_its_first_probe_is_removed() -> None:
    fleet, discovery, _ = setup()
    (a,) = answer(fleet, discovery, A)
    answer(fleet, discovery, B)
    assert a not in fleet.pool.nodes and [n.url for n in fleet.pool.nodes] == [B]


def test_prefill_names_make_prefill_nodes_with_one_slot() -> None:
    fleet, _, _ = setup()
    discovery = Discovery([Group(parse_dns_spec("prefill.test:8100", "prefill"))], decode_slots=4)
    (node,) = applied(discovery, Answer(frozenset({C})), fleet)
    assert node in fleet.prefill.nodes and (node.role, node.slots) == ("prefill", 1)


def test_a_dns_name_gives_its_engines_kv_event_port_as_it_gives_their_http_port() -> None:
    spec = parse_dns_spec("prefill.test:8100,kv_events=5557", "prefill")
    assert spec.labels == {"kv_events": "5557"}
    with pytest.raises(ValueError, match="kv_events must be a port number"):
        parse_dns_spec("prefill.test:8100,kv_events=lots", "prefill")


def test_a_node_gone_from_dns_stays_gone_while_its_address_family_does_not_answer() -> None:
    """README: a family whose queries fail keeps the addresses it listed, as they are. Not
    one the name had stopped listing: its node drains on, and is not taken back (joining,
    then serving at its next good probe) because AAAA queries started to fail."""
    fleet, discovery, _ = setup()
    v6 = "http://[fd00::1]:8200"
    a, b = answer(fleet, discovery, A, v6)
    assert b.url == v6
    fleet.probed(a)
    fleet.probed(b)
    b.bound.add("r1")  # kept while it drains
    answer(fleet, discovery, A)  # both families answered: the IPv6 address is gone
    assert (b.state, b.reason) == (State.DRAINING, GONE)
    refused = Answer(frozenset({A}), unknown=frozenset({IPV6}), partial="AAAA decode.test: REFUSED")
    for _ in range(2):
        assert applied(discovery, refused, fleet) == []
        assert (b.state, b.reason) == (State.DRAINING, GONE)
    assert discovery.groups[0].changes == {"added": 2, "drained": 1, "rejoined": 0, "removed": 0}
    b.bound.clear()
    applied(discovery, refused, fleet)
    assert b not in fleet.pool.nodes, "drained and removed, as without the failing family"


def test_a_gone_node_with_a_slot_still_reserved_is_not_removed() -> None:
    """A request holds a slot on the node before it is bound to it (between its
    reservation and its first byte to the engine): the node is not idle yet."""
    fleet, discovery, _ = setup()
    a, b = answer(fleet, discovery, A, B)
    fleet.probed(a)
    fleet.probed(b)
    a.in_use = 1
    answer(fleet, discovery, B)
    answer(fleet, discovery, B)
    assert a in fleet.pool.nodes and (a.state, a.reason) == (State.DRAINING, GONE)
    a.in_use = 0
    answer(fleet, discovery, B)
    assert a not in fleet.pool.nodes


def test_lookup_outcomes_are_logged_when_they_change_not_once_per_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """README: the first failure of a run, the first empty answer, the first answer after
    either; a family that stops answering once, and once when it answers again."""
    caplog.set_level(logging.INFO, logger="pd_router.discovery")
    fleet, discovery, _ = setup()
    failed = Answer(failure="A decode.test: no answer within 1 s")
    partial = Answer(frozenset({A}), unknown=frozenset({IPV6}), partial="AAAA decode.test: REFUSED")
    rounds = [
        Answer(frozenset({A})),
        *[failed] * 3,
        *[Answer()] * 2,
        *[Answer(frozenset({A}))] * 2,
        *[partial] * 2,
        failed,  # says nothing of the families: the IPv6 warning stands
        partial,
        *[Answer(frozenset({A}))] * 2,
    ]
    for round_answer in rounds:
        applied(discovery, round_answer, fleet)
    source = "dns:decode.test:8200"
    lines = [
        r.getMessage().removeprefix(f"{source}: ")
        for r in caplog.records
        if r.name == "pd_router.discovery" and " node " not in r.getMessage()
    ]
    assert lines == [
        "lookup failed: A decode.test: no answer within 1 s; the fleet is kept as it is",
        "the name lists no address; the fleet is kept as it is",
        "lookups answer again (1 addresses)",
        "IPv6 lookups fail (AAAA decode.test: REFUSED); the addresses of IPv6 are kept as they are",
        "lookup failed: A decode.test: no answer within 1 s; the fleet is kept as it is",
        "lookups answer again (1 addresses)",
        "lookups of every address family answer again",
    ]
    assert discovery.groups[0].lookups == {"ok": 8, "empty": 2, "failed": 4}

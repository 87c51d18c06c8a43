"""Lookups against a real DNS server on 127.0.0.1 (``tests/dns_server.py``), under asyncio
and trio: A and AAAA, SRV, NXDOMAIN and NODATA (empty), SERVFAIL and a server that is gone
(failed), and an SRV target that fails; and one round of the discovery loop."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import pytest

from pd_router.discovery.loop import discover_once
from pd_router.discovery.resolver import Resolver
from pd_router.discovery.rules import Answer, Discovery, Group, parse_dns_spec
from pd_router.fleet.membership import LocalMembership
from pd_router.fleet.nodes import Node, State
from pd_router.fleet.registry import Fleet
from tests.dns_server import DnsServer

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def server() -> Iterator[DnsServer]:
    with DnsServer() as server:
        yield server


def resolver(server: DnsServer) -> Resolver:
    return Resolver(("127.0.0.1", server.port), timeout=0.5)


async def test_a_and_aaaa_records_become_node_urls(server: DnsServer) -> None:
    server.set({"decode.test.": {"A": ["10.0.0.1", "10.0.0.2"], "AAAA": ["fd00::1"]}})
    answer = await resolver(server).lookup(parse_dns_spec("decode.test:8200", "decode"))
    assert answer == Answer(
        frozenset({"http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://[fd00::1]:8200"})
    )
    assert answer.outcome == "ok"


async def test_srv_records_give_the_port_and_their_targets_the_addresses(
    server: DnsServer,
) -> None:
    server.set(
        {
            "_http._tcp.decode.test.": {
                "SRV": [[0, 0, 8200, "d0.decode.test."], [0, 0, 8201, "d1.decode.test."]]
            },
            "d0.decode.test.": {"A": ["10.0.0.1"]},
            "d1.decode.test.": {"AAAA": ["fd00::2"]},
        }
    )
    answer = await resolver(server).lookup(parse_dns_spec("_http._tcp.decode.test", "decode"))
    assert answer.addresses == {"http://10.0.0.1:8200", "http://[fd00::2]:8201"}


async def test_an_srv_record_with_port_0_is_skipped_and_the_rest_is_the_answer(
    server: DnsServer,
) -> None:
    """Before, its URL raised out of the lookup, and out of the discovery round: no name's
    answer was applied, round after round."""
    server.set(
        {
            "_http._tcp.decode.test.": {
                "SRV": [[0, 0, 0, "d0.decode.test."], [0, 0, 8201, "d1.decode.test."]]
            },
            "d0.decode.test.": {"A": ["10.0.0.1"]},
            "d1.decode.test.": {"A": ["10.0.0.2"]},
        }
    )
    answer = await resolver(server).lookup(parse_dns_spec("_http._tcp.decode.test", "decode"))
    assert answer.outcome == "ok" and answer.addresses == {"http://10.0.0.2:8201"}


async def test_an_srv_target_of_dot_is_not_looked_up(server: DnsServer) -> None:
    """RFC 2782: a target of "." says the service is not there. Looking it up anyway (here
    a query nobody answers, as from a forwarder with no way out) would fail every lookup of
    the name, and the fleet would no longer follow it."""
    server.set(
        {
            "_http._tcp.decode.test.": {
                "SRV": [[0, 0, 8200, "."], [0, 0, 8201, "d1.decode.test."]]
            },
            ".": {"drop": ["A", "AAAA"]},
            "d1.decode.test.": {"A": ["10.0.0.2"]},
        }
    )
    answer = await resolver(server).lookup(parse_dns_spec("_http._tcp.decode.test", "decode"))
    assert answer.outcome == "ok" and answer.addresses == {"http://10.0.0.2:8201"}


async def test_a_name_that_does_not_exist_or_has_no_address_is_empty(server: DnsServer) -> None:
    server.set({"other.test.": {"TXT": ['"x"']}})
    for spec in ("missing.test:1", "other.test:1", "_http._tcp.missing.test"):
        answer = await resolver(server).lookup(parse_dns_spec(spec, "decode"))
        assert answer == Answer() and answer.outcome == "empty", spec


async def test_servfail_fails_the_lookup(server: DnsServer) -> None:
    server.set({"broken.test.": {"rcode": "SERVFAIL"}})
    answer = await resolver(server).lookup(parse_dns_spec("broken.test:1", "decode"))
    assert answer.outcome == "failed" and not answer.addresses
    assert "SERVFAIL" in str(answer.failure)


async def test_a_failing_srv_target_fails_the_whole_lookup(server: DnsServer) -> None:
    """Half an answer would drain the nodes behind the target that did not answer."""
    server.set(
        {
            "_http._tcp.decode.test.": {
                "SRV": [[0, 0, 8200, "d0.decode.test."], [0, 0, 8200, "d1.decode.test."]]
            },
            "d0.decode.test.": {"A": ["10.0.0.1"]},
            "d1.decode.test.": {"rcode": "SERVFAIL"},
        }
    )
    answer = await resolver(server).lookup(parse_dns_spec("_http._tcp.decode.test", "decode"))
    assert answer.outcome == "failed"


@pytest.mark.parametrize("aaaa", [{"rcode AAAA": "REFUSED"}, {"drop": ["AAAA"]}])
async def test_a_resolver_that_refuses_or_drops_aaaa_queries_still_gives_the_ipv4_nodes(
    server: DnsServer, aaaa: dict[str, object]
) -> None:
    """Such resolvers exist: before, every lookup failed and the router never found a node.
    What the failed family listed is not known: its nodes are kept as they are."""
    server.set({"decode.test.": {"A": ["10.0.0.1", "10.0.0.2"], **aaaa}})
    answer = await resolver(server).lookup(parse_dns_spec("decode.test:8200", "decode"))
    assert answer.addresses == {"http://10.0.0.1:8200", "http://10.0.0.2:8200"}
    assert answer.outcome == "ok" and answer.unknown == {"IPv6"} and "AAAA" in str(answer.partial)
    group = Group(parse_dns_spec("decode.test:8200", "decode"))
    group.joined("http://[fd00::1]:8200", 7)
    group.joined("http://10.0.0.3:8200", 8)
    plan = group.update(answer, (), {7, 8})
    assert plan.drain == (8,), "the IPv6 node is kept, the IPv4 one no longer listed goes"
    assert set(plan.add) == {"http://10.0.0.1:8200", "http://10.0.0.2:8200"}


async def test_no_server_fails_the_lookup_within_its_timeout() -> None:
    with DnsServer() as gone:
        port = gone.port
    answer = await Resolver(("127.0.0.1", port), timeout=0.3).lookup(
        parse_dns_spec("decode.test:8200", "decode")
    )
    assert answer.outcome == "failed" and "no answer within 0.3 s" in str(answer.failure)


async def test_the_loop_applies_real_answers_to_the_fleet(server: DnsServer) -> None:
    """One round of the discovery loop as the router runs it, on this backend: lookups of
    every name at once, the plan applied, the new nodes probed (here: answered at once)."""
    fleet = Fleet([], [])
    members = LocalMembership(fleet)
    discovery = Discovery(
        [
            Group(parse_dns_spec("prefill.test:8100", "prefill")),
            Group(parse_dns_spec("decode.test:8200,slots=3", "decode")),
        ]
    )
    probed: list[str] = []

    async def probe(node: Node) -> None:
        probed.append(node.url)
        fleet.probed(node)

    server.set(
        {"prefill.test.": {"A": ["10.0.0.1"]}, "decode.test.": {"A": ["10.0.1.1", "10.0.1.2"]}}
    )
    await discover_once(discovery, fleet, members, resolver(server).lookup, probe)
    assert sorted(probed) == [
        "http://10.0.0.1:8100",
        "http://10.0.1.1:8200",
        "http://10.0.1.2:8200",
    ]
    assert [(n.url, n.slots, n.state) for n in fleet.pool.nodes] == [
        ("http://10.0.1.1:8200", 3, State.SERVING),
        ("http://10.0.1.2:8200", 3, State.SERVING),
    ]
    server.set({"prefill.test.": {"rcode": "SERVFAIL"}, "decode.test.": {"A": ["10.0.1.2"]}})
    await discover_once(discovery, fleet, members, resolver(server).lookup, probe)
    assert [n.url for n in fleet.nodes] == ["http://10.0.0.1:8100", "http://10.0.1.2:8200"]
    assert discovery.groups[0].lookups == {"ok": 1, "empty": 0, "failed": 1}


async def test_one_engine_found_in_both_roles_is_a_prefill_node_and_a_decode_node(
    server: DnsServer,
) -> None:
    """README, "One engine, one node": an engine may serve both roles. Before, the decode
    name's address counted as taken by the prefill node, and no decode node was made."""
    fleet, look = discovering(server, "prefill engine.test:8000", "decode engine.test:8000")
    server.set({"engine.test.": {"A": ["10.0.0.1"]}})
    for _ in range(2):
        await look()
    assert sorted((n.role, n.url, n.state) for n in fleet.nodes) == [
        ("decode", "http://10.0.0.1:8000", State.SERVING),
        ("prefill", "http://10.0.0.1:8000", State.SERVING),
    ]


async def test_an_address_two_names_list_stays_until_neither_does(server: DnsServer) -> None:
    """README: an address listed by two names is one node, and only an answer that really
    lists fewer addresses removes nodes. One name dropping it hands the node to the other,
    which drains it only once it drops it too. Before, the first name's drain stood while
    the second still listed it, and the node was removed at the drain timeout, failing
    what it held (then added again by the second name under a new id)."""
    fleet, look = discovering(server, "decode a.test:8200", "decode b.test:8200")

    async def round_of(a: list[str], b: list[str]) -> list[tuple[int, State]]:
        server.set({"a.test.": {"A": a}, "b.test.": {"A": b}})
        await look()
        return [(n.id, n.state) for n in fleet.pool.nodes]

    assert await round_of(["10.0.0.1"], ["10.0.0.1"]) == [(0, State.SERVING)]
    assert await round_of(["10.0.0.2"], ["10.0.0.1"]) == [(0, State.SERVING), (1, State.SERVING)]
    assert await round_of(["10.0.0.2"], ["10.0.0.1"]) == [(0, State.SERVING), (1, State.SERVING)]
    # Dropped by both: drained, and removed at once (it holds nothing).
    assert await round_of(["10.0.0.2"], ["10.0.0.3"]) == [(1, State.SERVING), (2, State.SERVING)]


async def test_a_decode_address_its_name_drops_goes_though_a_prefill_name_lists_it(
    server: DnsServer,
) -> None:
    """Only another name of the node's role keeps a node its name stopped listing: one engine
    serving both roles is a prefill node and a decode node, followed each by its own name.
    The decode name dropping the address drains (and, idle, removes) the decode node; the
    prefill node stays the prefill name's, and goes when that name drops it in turn."""
    fleet, look = discovering(server, "prefill p.test:8000", "decode d.test:8000")

    async def round_of(p: list[str], d: list[str]) -> list[tuple[str, str, State]]:
        server.set({"p.test.": {"A": p}, "d.test.": {"A": d}})
        await look()
        return sorted((n.role, n.url, n.state) for n in fleet.nodes)

    one, two, three = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
    assert await round_of(["10.0.0.1"], ["10.0.0.1"]) == [
        ("decode", one, State.SERVING),
        ("prefill", one, State.SERVING),
    ]
    for _ in range(2):
        assert await round_of(["10.0.0.1"], ["10.0.0.2"]) == [
            ("decode", two, State.SERVING),
            ("prefill", one, State.SERVING),
        ]
    assert await round_of(["10.0.0.3"], ["10.0.0.2"]) == [
        ("decode", two, State.SERVING),
        ("prefill", three, State.SERVING),
    ]


async def test_a_name_listing_again_an_address_it_handed_over_finds_no_new_node(
    server: DnsServer,
) -> None:
    """The node stays the other name's, which still lists it: the first name does not find
    it again (an ``added`` more in ``pd_router_discovery_changes``, a "found" log line, a
    probe of a serving node), and takes it back only when the other name drops it."""
    fleet = Fleet([], [])
    members = LocalMembership(fleet)
    first = Group(parse_dns_spec("a.test:8200", "decode"))
    second = Group(parse_dns_spec("b.test:8200", "decode"))
    discovery = Discovery([first, second])
    probed: list[str] = []

    async def probe(node: Node) -> None:
        probed.append(node.url)
        fleet.probed(node)

    async def round_of(a: list[str], b: list[str]) -> list[str]:
        probed.clear()
        server.set({"a.test.": {"A": a}, "b.test.": {"A": b}})
        await discover_once(discovery, fleet, members, resolver(server).lookup, probe)
        return [n.url for n in fleet.pool.nodes]

    one, two, three = "http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://10.0.0.3:8200"
    assert await round_of(["10.0.0.1"], ["10.0.0.1"]) == [one]
    assert await round_of(["10.0.0.2"], ["10.0.0.1"]) == [one, two]  # the second name's now
    assert await round_of(["10.0.0.1", "10.0.0.2"], ["10.0.0.1"]) == [one, two]
    assert probed == [] and (first.changes["added"], second.changes["added"]) == (2, 0)
    assert await round_of(["10.0.0.1", "10.0.0.2"], ["10.0.0.3"]) == [one, two, three]
    assert await round_of(["10.0.0.2"], ["10.0.0.3"]) == [two, three]
    assert first.changes == {"added": 2, "drained": 1, "rejoined": 0, "removed": 1}
    assert second.changes == {"added": 1, "drained": 0, "rejoined": 0, "removed": 0}


def discovering(server: DnsServer, *names: str) -> tuple[Fleet, Callable[[], Awaitable[None]]]:
    """An empty fleet discovering ``names`` ("ROLE NAME:PORT"), and one round of its loop
    against ``server``, every node found answering its first probe."""
    fleet = Fleet([], [])
    members = LocalMembership(fleet)
    groups = []
    for name in names:
        role, spec = name.split()
        groups.append(Group(parse_dns_spec(spec, "prefill" if role == "prefill" else "decode")))
    discovery = Discovery(groups)

    async def probe(node: Node) -> None:
        fleet.probed(node)

    async def look() -> None:
        await discover_once(discovery, fleet, members, resolver(server).lookup, probe)

    return fleet, look

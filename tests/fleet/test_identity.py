"""A node's identity: its role and canonical URL, from every source. No I/O."""

from __future__ import annotations

import pytest

from pd_router.discovery import rules
from pd_router.errors import Evidence
from pd_router.fleet.membership import LocalMembership, Record, apply
from pd_router.fleet.nodes import Failure, State, make_nodes, normalise_url
from pd_router.fleet.registry import Fleet


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("HTTP://127.0.0.1:021201/", "http://127.0.0.1:21201"),
        ("http://Engine-1.Example:8200", "http://engine-1.example:8200"),
        ("http://e:80", "http://e"),
        ("https://e:443/", "https://e"),
        ("https://e:80", "https://e:80"),
        ("http://[0:0::1]:8200/v1//", "http://[::1]:8200/v1"),
        ("http://[FE80::A]:8200", "http://[fe80::a]:8200"),
        ("http://e:8200/V1", "http://e:8200/V1"),  # a path is case-sensitive
        ("  http://localhost:8200  ", "http://localhost:8200"),  # a name is not resolved
    ],
)
def test_an_engine_url_has_one_canonical_spelling(given: str, canonical: str) -> None:
    assert normalise_url(given) == canonical
    assert normalise_url(canonical) == canonical


def test_a_discovered_address_is_spelt_as_a_configured_one() -> None:
    assert rules.url("0:0:0:0:0:0:0:1", 8200) == normalise_url("http://[::1]:8200")
    assert rules.url("10.0.3.7", 8200) == "http://10.0.3.7:8200"


@pytest.mark.parametrize("bad", ["http://[zz]:8", "http://[::1:8", "http://:8", "http://e:0"])
def test_a_url_that_is_no_engine_address_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        normalise_url(bad)


def test_a_fleet_refuses_one_engine_twice_in_a_role() -> None:
    prefill = make_nodes(["http://p:1"], 1, role="prefill")
    with pytest.raises(ValueError, match="is given twice: one engine is one node"):
        Fleet(prefill, make_nodes(["http://d:1", "HTTP://D:01/"], 1, first_id=1))
    fleet = Fleet(prefill, make_nodes(["http://p:1"], 1, first_id=1))  # two roles: two nodes
    with pytest.raises(ValueError, match="in the fleet already"):
        fleet.add("http://p:1", "decode", 2)


@pytest.mark.anyio
async def test_adding_an_engine_again_changes_its_node() -> None:
    fleet = Fleet(
        make_nodes(["http://p:1"], 1, role="prefill"), make_nodes(["http://d:1"], 2, first_id=1)
    )
    members = LocalMembership(fleet)
    first = await members.add("http://d:2", "decode", 2, {})
    assert first.state is State.JOINING and first.id == 2
    fleet.drain(first)
    again = await members.add("http://d:2", "decode", 4, {"zone": "b"})
    assert again is first and again.id == 2 and again.slots == 4 and again.labels == {"zone": "b"}
    # Drained no more, and as before its drain: joining until its first good probe (before,
    # serving with no engine ever heard from).
    assert again.state is State.JOINING and again.reason == "not yet probed"
    # Its probes failing: joining still, and the reason says why (not "not yet probed").
    fleet.failed(again, Failure("probe refused", "connection refused", Evidence.FATAL), probe=True)
    assert (again.state, again.reason) == (State.JOINING, "probe refused")
    fleet.probed(again)
    assert again.state is State.SERVING
    assert fleet.pool.capacity == 2 + 4 and len(fleet.nodes) == 3
    deaf = LocalMembership(Fleet([], []), probes=False)
    assert (await deaf.add("http://d:3", "decode", 1, {})).state is State.SERVING


def test_shared_records_of_one_engine_spelt_two_ways_are_one_node() -> None:
    fleet = Fleet(make_nodes(["http://p:1"], 1, role="prefill"), [])
    older = Record(4, "decode", "http://d:1", 2).body()
    spelt = older.replace(b"http://d:1", b"HTTP://D:01/")
    records = {4: Record.parse(4, older, None), 7: Record.parse(7, spelt, None)}
    apply(fleet, records, {})
    assert [(node.id, node.url) for node in fleet.pool.nodes] == [(4, "http://d:1")]

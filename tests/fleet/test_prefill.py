"""Prefill node selection (``fleet/prefill.py``), with no server.

The concurrent test runs under asyncio and trio: outstanding prefills are requests bound to
a node, as the relay binds them, and the bound must hold while many are in flight at once.
"""

from __future__ import annotations

from collections import Counter

import anyio
import pytest

from pd_router.fleet.nodes import Node, State, make_nodes
from pd_router.fleet.prefill import (
    KEY_CHARS,
    LOAD_FACTOR,
    POLICIES,
    LeastLoaded,
    Prefix,
    RecentPrefixes,
    RoundRobin,
    prefix_key,
)
from pd_router.fleet.registry import Fleet

SYSTEM = "You are a careful assistant. " * 40  # longer than KEY_CHARS: shared by all


def prefill_nodes(count: int, first: int = 0) -> list[Node]:
    urls = [f"http://p{index}:8100" for index in range(first, first + count)]
    return make_nodes(urls, 1, role="prefill", first_id=first)


def chat(conversation: int, turns: int) -> dict[str, object]:
    """Turn ``turns`` of a conversation: the system prompt, then its turns so far."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"conversation {conversation} turn {turn}"})
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    messages.append({"role": "user", "content": f"conversation {conversation} turn {turns}"})
    return {"model": "m", "messages": messages}


def test_every_turn_of_a_conversation_has_the_key_of_its_first() -> None:
    keys = {prefix_key(chat(7, turns)) for turns in range(6)}
    assert len(keys) == 1
    assert prefix_key(chat(8, 0)) not in keys, "the first user message tells them apart"
    assert prefix_key({**chat(7, 0), "model": "other"}) not in keys


def test_a_completion_prompt_is_keyed_by_its_leading_characters() -> None:
    opening = "x" * KEY_CHARS
    first = prefix_key({"model": "m", "prompt": opening + " first turn"})
    assert prefix_key({"model": "m", "prompt": opening + " later turn, longer"}) == first
    assert prefix_key({"model": "m", "prompt": [opening + " batch", "another"]}) == first
    assert prefix_key({"model": "m", "prompt": "y" + opening}) != first
    ids = list(range(1000))
    assert prefix_key({"model": "m", "prompt": ids}) == prefix_key(
        {"model": "m", "prompt": ids + [5, 6]}
    )


def test_the_same_conversation_goes_to_the_same_node_from_independent_routers() -> None:
    """Two policies that share nothing (other Node objects, ids in another order) agree,
    because the ranking depends on the key and the URLs only."""
    one = Prefix(prefill_nodes(4))
    urls = [node.url for node in reversed(prefill_nodes(4))]
    other = Prefix(make_nodes(urls, 1, "prefill", first_id=10))
    picks = Counter()
    for conversation in range(200):
        for turns in (0, 3):
            key = prefix_key(chat(conversation, turns))
            a, b = one.pick(key), other.pick(key)
            assert a is not None and b is not None and a.url == b.url
            picks[a.url] += 1
    assert len(picks) == 4 and min(picks.values()) > 200 / 4 / 2, picks


def test_adding_or_removing_a_node_moves_about_one_key_in_n() -> None:
    keys = [prefix_key(chat(conversation, 0)) for conversation in range(2000)]
    four = Prefix(prefill_nodes(4))
    five = Prefix(prefill_nodes(5))
    before = [four.pick(key) for key in keys]
    after = [five.pick(key) for key in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b is not None and b.url != a.url]
    # Only keys the new node wins move, and all of them to it: ~1/5 of them.
    assert all(a.url == "http://p4:8100" for _, a in moved)
    assert 0.15 < len(moved) / len(keys) < 0.25
    three = Prefix(prefill_nodes(4)[:3])
    left = [three.pick(key) for key in keys]
    changed = [b for b, a in zip(before, left, strict=True) if b.url != a.url]
    assert {node.url for node in changed} == {"http://p3:8100"}, "only p3's keys move"
    assert 0.2 < len(changed) / len(keys) < 0.3


def test_dead_draining_and_unhealthy_nodes_are_skipped() -> None:
    nodes = prefill_nodes(3)
    policy = Prefix(nodes)
    keys = [prefix_key(chat(conversation, 0)) for conversation in range(100)]
    homes = {key: policy.pick(key) for key in keys}
    nodes[0].state, nodes[1].state = State.DEAD, State.DRAINING
    policy.refresh()
    assert {policy.pick(key) for key in keys} == {nodes[2]}
    nodes[0].state = nodes[1].state = State.SERVING
    nodes[2].state = State.UNHEALTHY
    policy.refresh()
    for key in keys:
        node = policy.pick(key)
        assert node is not nodes[2]
        if homes[key] is not nodes[2]:
            assert node is homes[key], "a key whose home serves stays home"
        assert policy.pick(key, avoid=node) is not node


def test_with_every_node_unhealthy_they_still_take_requests() -> None:
    nodes = prefill_nodes(2)
    for node in nodes:
        node.state = State.UNHEALTHY
    for policy in POLICIES.values():
        chosen = policy(nodes)
        assert chosen.pick(1) in nodes
        nodes[1].state = State.DEAD
        chosen.refresh()
        assert chosen.pick(1) is nodes[0] and chosen.pick(1, avoid=nodes[0]) is None
        nodes[1].state = State.UNHEALTHY


def bind(node: Node, count: int) -> None:
    node.bound.update(f"{node.id}-{index}" for index in range(len(node.bound), count))


def test_a_hot_prefix_spills_to_its_second_node_under_load() -> None:
    nodes = prefill_nodes(4)
    policy = Prefix(nodes)
    key = prefix_key(chat(1, 0))
    home = policy.pick(key)
    assert home is not None
    second = policy.pick(key, avoid=home)
    bind(home, 1)
    assert policy.pick(key) is home, "one in flight is no reason to leave"
    # Mean 2/4 = 0.5: the limit is 1.25 * 0.5 + 1 = 1.625, and home carries 2.
    bind(home, 2)
    assert policy.pick(key) is second
    # Another router sends the same hot key to the same second node.
    other = Prefix(make_nodes([n.url for n in reversed(nodes)], 1, "prefill", first_id=10))
    for node in other.nodes:
        bind(node, len(next(n for n in nodes if n.url == node.url).bound))
    assert other.pick(key).url == second.url


def test_a_node_at_the_load_bound_keeps_its_keys_and_one_beyond_it_spills() -> None:
    """Passed over is a node carrying *more* than LOAD_FACTOR x the mean + 1: one carrying
    exactly that much keeps its keys (it is within what bounded loads allow)."""
    nodes = prefill_nodes(2)
    policy = Prefix(nodes)
    key = prefix_key(chat(1, 0))
    home = policy.pick(key)
    other = next(node for node in nodes if node is not home)
    bind(home, 6)
    bind(other, 2)
    # Mean 8/2 = 4: the limit is 1.25 * 4 + 1 = 6, what home carries.
    assert LOAD_FACTOR * 8 / 2 + 1 == 6
    assert policy.pick(key) is home
    bind(home, 7)
    assert policy.pick(key) is other


async def test_concurrent_requests_on_one_hot_prefix_stay_within_the_bound(
    anyio_backend: str,
) -> None:
    """64 prefills of one key at once, bound while they run as the relay binds them: no
    node carries more than LOAD_FACTOR x the mean + 1 + 1 (the one that tipped it)."""
    fleet = Fleet(prefill_nodes(4), make_nodes(["http://d0:8200"], 1, first_id=4))
    key = prefix_key(chat(3, 0))
    peak = Counter[str]()
    started = anyio.Event()

    async def prefill(index: int) -> None:
        node = fleet.prefill.pick(key)
        assert node is not None
        node.bound.add(f"r{index}")
        loads = [len(n.bound) for n in fleet.prefill.nodes]
        assert max(loads) <= LOAD_FACTOR * sum(loads) / len(loads) + 2
        peak[node.url] = max(peak[node.url], len(node.bound))
        try:
            await started.wait()
        finally:
            node.bound.discard(f"r{index}")

    async with anyio.create_task_group() as group:
        for index in range(64):
            group.start_soon(prefill, index)
        await anyio.wait_all_tasks_blocked()
        started.set()
    assert len(peak) == 4 and max(peak.values()) <= 64 / 4 * LOAD_FACTOR + 2, peak
    assert all(not node.bound for node in fleet.prefill.nodes), "released on every path"


def test_least_loaded_takes_the_idlest_node_and_ties_in_turn() -> None:
    nodes = prefill_nodes(3)
    policy = LeastLoaded(nodes)
    assert [policy.pick(0) for _ in range(3)] == nodes
    bind(nodes[0], 2)
    bind(nodes[2], 1)
    assert {policy.pick(0) for _ in range(3)} == {nodes[1]}


def test_round_robin_ignores_the_key() -> None:
    nodes = prefill_nodes(3)
    policy = RoundRobin(nodes)
    assert [policy.pick(42) for _ in range(6)] == nodes * 2


def test_recent_prefixes_say_hit_when_a_key_returns_to_its_node() -> None:
    a, b = prefill_nodes(2)
    recent = RecentPrefixes(capacity=2)
    assert not recent.record(1, a), "a new key is a miss"
    assert recent.record(1, a)
    assert not recent.record(1, b)
    recent.record(2, a)
    recent.record(1, b)  # key 1 used last: key 2 is the oldest
    recent.record(3, a)  # and is forgotten
    assert not recent.record(2, a)
    assert recent.record(3, a)


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_fleet_builds_each_policy(name: str) -> None:
    fleet = Fleet(
        prefill_nodes(2), make_nodes(["http://d0:8200"], 1, first_id=2), prefill_policy=name
    )
    assert fleet.prefill.name == name
    added = fleet.add("http://p9:8100", "prefill", 1)
    assert added in fleet.prefill.nodes
    fleet.drain(added)
    assert all(fleet.prefill.pick(key) is not added for key in range(50))

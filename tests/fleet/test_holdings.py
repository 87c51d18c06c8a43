"""What each engine is predicted to hold (``fleet/holdings.py``) and the ``cost`` prefill
policy that reads it (``fleet/prefill.py``), with no server.

The concurrent test runs under asyncio and trio: prefills placed and released from many
tasks at once, as relays do.
"""

from __future__ import annotations

from collections import Counter

import anyio
import pytest

from pd_router.fleet.holdings import (
    CALIBRATION_WEIGHT,
    CHUNK_BYTES,
    CHUNK_TOKENS,
    Holdings,
    KvView,
    describe,
)
from pd_router.fleet.nodes import make_nodes
from pd_router.fleet.prefill import Cost
from pd_router.fleet.registry import Fleet
from tests.fleet.test_prefill import SYSTEM, prefill_nodes

# A shared opening far longer than any fixed cut (the prefix key's 1024 characters).
OPENING = "Instructions for the agent, to follow to the letter. " * 160


def chat(conversation: int, turns: int) -> dict[str, object]:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"c{conversation} t{turn}. " * 60})
        messages.append({"role": "assistant", "content": f"answer {turn} " * 60})
    messages.append({"role": "user", "content": f"c{conversation} t{turns}. " * 60})
    return {"model": "m", "messages": messages}


def completion(conversation: int, turns: int) -> dict[str, object]:
    text = OPENING + "".join(
        f"Q{conversation}.{turn}: what next? A: this, at length. " * 12 for turn in range(turns + 1)
    )
    return {"model": "m", "prompt": text}


def test_a_later_turn_extends_the_chunks_of_the_earlier_one() -> None:
    for body in (chat, completion):
        first, second = describe(body(1, 0)), describe(body(1, 1))
        assert len(second.chunks) > len(first.chunks) > 0
        # All but the last chunk of a chat turn: its closing brace becomes a comma.
        shared = first.chunks[:-1] if body is chat else first.chunks
        assert second.chunks[: len(shared)] == shared
        other = describe(body(2, 0))
        assert other.chunks[0] == first.chunks[0], "the shared opening"
        assert other.chunks[-1] not in first.chunks, "then the conversations part"
    assert describe({**chat(1, 0), "model": "n"}).chunks[0] != describe(chat(1, 0)).chunks[0]


def test_completions_shared_opening_of_any_length_is_shared_chunk_for_chunk() -> None:
    a, b = describe(completion(1, 0)), describe(completion(2, 0))
    common = len(OPENING.encode()) // CHUNK_BYTES
    assert a.chunks[:common] == b.chunks[:common]
    assert len(a.chunks) > common and a.chunks[-1] != b.chunks[-1]


def test_token_ids_count_exactly_and_match_as_ids() -> None:
    ids = list(range(1000, 1000 + 300))
    prompt = describe({"model": "m", "prompt": ids})
    assert prompt.tokens == 300
    assert len(prompt.chunks) == 300 // CHUNK_TOKENS
    longer = describe({"model": "m", "prompt": [ids + [7, 8, 9] * 20]})
    assert longer.chunks[: len(prompt.chunks)] == prompt.chunks
    assert describe({"model": "m", "prompt": "text"}).tokens == 1


def test_holdings_forget_the_least_recent_prompts_tails_first() -> None:
    holdings = Holdings(capacity_tokens=10 * CHUNK_TOKENS)
    a, b = list(range(6)), list(range(100, 106))
    holdings.insert(a)
    assert holdings.held(a) == 6 and holdings.held(b) == 0
    holdings.insert(b)
    assert len(holdings) == 10
    # ``a`` is older: its last two chunks went, its first four are still held.
    assert holdings.held(a) == 4 and holdings.held(b) == 6
    holdings.clear()
    assert holdings.held(b) == 0


def test_a_conversations_turns_go_back_to_the_node_that_holds_them() -> None:
    """64 conversations one after the other (nothing ever waits): the share term spreads
    them over every node although the first node holding the shared opening is the
    cheapest for each new one, and their later turns go back where they were."""
    for body in (chat, completion):
        policy = Cost(prefill_nodes(4))
        homes = {}
        for conversation in range(64):
            prompt = describe(body(conversation, 0))
            node = policy.pick(0, prompt=prompt)
            assert node is not None
            policy.release(policy.place(node, 0, prompt))
            homes[conversation] = node
        spread = Counter(node.id for node in homes.values())
        assert len(spread) == 4 and max(spread.values()) <= 1.5 * min(spread.values()), spread
        home = 0
        for turns in range(1, 4):
            for conversation in range(64):
                prompt = describe(body(conversation, turns))
                node = policy.pick(0, prompt=prompt)
                assert node is not None
                placement = policy.place(node, 0, prompt)
                if node is homes[conversation]:
                    home += 1
                    assert placement.cached and placement.cached > prompt.tokens // 2
                homes[conversation] = node
                policy.release(placement)
        # The rest moved where the share term sent them, and stay there.
        assert home >= 0.8 * 64 * 3, (body.__name__, home)


def test_waiting_work_moves_a_prefill_to_an_idle_node_when_it_costs_less() -> None:
    nodes = prefill_nodes(2)
    policy = Cost(nodes)
    first = describe(completion(1, 0))
    home = policy.pick(0, prompt=first)
    assert home is not None
    policy.release(policy.place(home, 0, first))
    # Another conversation on the other node: both have their share, only waiting differs.
    other = next(node for node in nodes if node is not home)
    policy.release(policy.place(other, 0, describe(completion(2, 0))))
    later = describe(completion(1, 1))
    saving = later.cached(len(first.chunks)) - later.cached(len(OPENING.encode()) // CHUNK_BYTES)
    # Work waiting there, less than the cache saves: still home.
    policy.waiting[home.id] = saving // 2
    assert policy.pick(0, prompt=later) is home
    # More than it saves: the other node.
    policy.waiting[home.id] = saving + 64
    assert policy.pick(0, prompt=later) is not home
    policy.waiting.clear()
    placement = policy.place(home, 0, later)
    assert policy.waiting == {home.id: later.tokens - later.cached(len(first.chunks))}
    policy.release(placement)
    assert not policy.waiting, "released work is forgotten"


def test_two_routers_that_share_nothing_break_ties_alike() -> None:
    """Each router knows the shared opening is everywhere; the first turn of a new
    conversation goes to the same node from either."""
    one, two = Cost(prefill_nodes(4)), Cost(prefill_nodes(4))
    for policy in (one, two):
        for node in policy.nodes:
            policy.release(policy.place(node, 0, describe(completion(99, 0))))
    for conversation in range(20):
        prompt = describe(completion(conversation, 0))
        picked = one.pick(0, prompt=prompt), two.pick(0, prompt=prompt)
        assert picked[0] is not None and picked[1] is not None
        assert picked[0].url == picked[1].url


def test_memory_is_bounded_by_the_engine_cache() -> None:
    view = KvView(cache_tokens=100 * CHUNK_TOKENS)
    policy = Cost(prefill_nodes(2), view)
    for conversation in range(200):
        prompt = describe(completion(conversation, 2))
        node = policy.pick(0, prompt=prompt)
        assert node is not None
        policy.release(policy.place(node, 0, prompt))
    assert all(len(view.of(node.id)) <= 100 for node in policy.nodes)


async def test_concurrent_prefills_spread_and_leave_no_waiting_work(anyio_backend: str) -> None:
    fleet = Fleet(
        prefill_nodes(4), make_nodes(["http://d0:8200"], 1, first_id=4), prefill_policy="cost"
    )
    policy = fleet.prefill
    started = anyio.Event()
    used = Counter[int]()

    async def prefill(index: int) -> None:
        prompt = describe(completion(index, 0))
        node = policy.pick(0, prompt=prompt)
        assert node is not None
        placement = policy.place(node, 0, prompt)
        used[node.id] += 1
        try:
            await started.wait()
        finally:
            policy.release(placement)

    async with anyio.create_task_group() as group:
        for index in range(64):
            group.start_soon(prefill, index)
        await anyio.wait_all_tasks_blocked()
        # The shared opening is computed once; waiting work then spreads the rest evenly.
        assert max(used.values()) - min(used.values()) <= 2, used
        started.set()
    assert isinstance(policy, Cost) and not policy.waiting


def test_what_answers_teach_of_tokens_is_bounded_to_what_text_can_be() -> None:
    """One answer for a prompt that is mostly an image's base64 (1 MB: ~1,200 tokens) taught
    a ratio of 0.005: every text prompt then looked short to ``--max-local-prefill``, and
    every engine's predicted cache was 200 times as large. Outside 0.25-4 tokens per 4 bytes,
    an answer teaches nothing; the predicted cache stays bounded whatever the ratio."""
    view = KvView(cache_tokens=1 << 24)
    image = describe({"model": "m", "messages": [{"role": "user", "content": "x" * 1_000_000}]})
    view.calibrate(image, 1200)
    assert view.ratio == 1.0
    text = describe({"model": "m", "prompt": "a " * 1000})
    view.calibrate(text, 1000)
    assert view.ratio == 2.0
    assert describe({"model": "m", "prompt": "b " * 190}, view.ratio).tokens == 190
    view.calibrate(text, 125)  # 0.25: the lowest an answer may say
    assert view.ratio < 2.0
    assert Holdings(1 << 30, 0.25).capacity == (1 << 24) // CHUNK_TOKENS


def test_a_prompt_used_again_outlives_one_used_once_since() -> None:
    """The prediction is an LRU, as vLLM's cache is: a shared opening every request reads
    again is the most recent, and what goes first when the cache is full is the prompt
    nobody used since (before the opening used again, not after it by first use)."""
    holdings = Holdings(capacity_tokens=4 * CHUNK_TOKENS)
    opening, once, new = [1, 2], [11, 12], [21, 22]
    holdings.insert(opening)
    holdings.insert(once)
    holdings.insert(opening)
    holdings.insert(new)
    assert holdings.held(opening) == 2 and holdings.held(new) == 2
    assert holdings.held(once) == 0


def test_what_is_predicted_held_follows_the_engines_tokens_once_they_are_known() -> None:
    """An engine whose tokens are twice the router's estimate holds half as many chunks of
    text in the same cache: the prediction of a node seen before calibration shrinks too
    (before, it kept the estimate's size and predicted hits the engine had evicted)."""
    view = KvView(cache_tokens=100 * CHUNK_TOKENS)
    before = view.of(0)
    prompt = describe(completion(1, 0))
    view.calibrate(prompt, 2 * prompt.estimate)
    assert view.ratio == 2.0
    before.insert(list(range(1000, 1100)))
    after = view.of(1)
    after.insert(list(range(1000, 1100)))
    assert len(before) == len(after) == 50


def test_a_node_removed_from_the_fleet_takes_its_prediction_with_it() -> None:
    view = KvView()
    chunks = describe(completion(1, 0)).chunks
    for node_id in (0, 1):
        view.of(node_id).insert(chunks)
    view.forget({1})
    assert view.of(0).held(chunks) == 0 and view.of(1).held(chunks) == len(chunks)


def test_one_answer_moves_the_learned_ratio_only_a_little() -> None:
    """The first engine count sets the tokens-per-estimate ratio; later ones move it by
    CALIBRATION_WEIGHT of their difference, so one unusual prompt (code, another script)
    does not resize every prediction at once."""
    view = KvView()
    prompt = describe(completion(1, 0))
    view.calibrate(prompt, 2 * prompt.estimate)
    view.calibrate(prompt, prompt.estimate)
    assert view.ratio == pytest.approx(2.0 - CALIBRATION_WEIGHT)

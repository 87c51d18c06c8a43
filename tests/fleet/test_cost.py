"""The ``cost`` prefill policy's decisions (``fleet/prefill.py``), with no server: what a
production router should do with a conversation's later turn, a hot document and a new
conversation, each checked against the policy's own arithmetic.
"""

from __future__ import annotations

from collections import Counter

import pytest

from pd_router.fleet import prefill
from pd_router.fleet.holdings import CHUNK_BYTES, Prompt, describe
from pd_router.fleet.nodes import Node, State, make_nodes
from pd_router.fleet.prefill import (
    HOT_WAIT,
    LOAD_FACTOR,
    MISS_WEIGHT,
    PREFILL_TOKENS,
    RECENT_PER_NODE,
    Cost,
)

# A shared opening far longer than any fixed cut, then each conversation's own turns.
OPENING = "Instructions for the agent, to follow to the letter. " * 160


def prefill_nodes(count: int) -> list[Node]:
    return make_nodes([f"http://p{index}:8100" for index in range(count)], 1, role="prefill")


def completion(conversation: int, turns: int) -> dict[str, object]:
    text = OPENING + "".join(
        f"Q{conversation}.{turn}: what next? A: this, at length. " * 12 for turn in range(turns + 1)
    )
    return {"model": "m", "prompt": text}


def conversation_at_home() -> tuple[Cost, Node]:
    """Four nodes, each holding the opening (another router's conversation there), and
    the first of them, home, conversation 1's first turn too."""
    nodes = prefill_nodes(4)
    policy = Cost(nodes)
    for index, node in enumerate(nodes):
        policy.heard(node, describe(completion(100 + index, 0)))
    policy.heard(nodes[0], describe(completion(1, 0)))
    return policy, nodes[0]


def place(policy: Cost, body: dict[str, object]) -> tuple[Node, int]:
    """Pick and place one prefill and release it (nothing waits): where, and the tokens
    it was predicted to compute."""
    prompt = describe(body)
    node = policy.pick(0, prompt=prompt)
    assert node is not None
    placement = policy.place(node, 0, prompt)
    policy.release(placement)
    return node, placement.work


def test_a_later_turn_stays_unless_the_wait_there_costs_more_than_recomputing_twice() -> None:
    """Finishing first is not the goal: a turn moved to an idle node recomputes its
    history there, which whatever queues behind it on that node waits for too. It moves
    only when the work waiting at home exceeds MISS_WEIGHT x what it would recompute."""
    nodes = prefill_nodes(2)
    policy = Cost(nodes)
    home, _ = place(policy, completion(1, 0))
    other = next(node for node in nodes if node is not home)
    # Another conversation on the other node: both hold the opening, each its own turn,
    # and each was given one prefill (no share term either way).
    policy.release(policy.place(other, 0, describe(completion(2, 0))))
    later = describe(completion(1, 1))
    # What moving would recompute: the first turn, held at home only.
    opening = len(OPENING.encode()) // CHUNK_BYTES
    first = describe(completion(1, 0))
    saving = later.cached(len(first.chunks)) - later.cached(opening)
    assert saving > 0
    # Waiting at home longer than the turn's history takes to recompute (the old policy,
    # finishing first, moved here) but shorter than MISS_WEIGHT times it: home.
    policy.waiting[home.id] = int(saving * (1 + MISS_WEIGHT) / 2)
    assert policy.waiting[home.id] > saving
    assert policy.pick(0, prompt=later) is home
    # Longer than that: the idle node.
    policy.waiting[home.id] = int(saving * MISS_WEIGHT) + 64
    assert policy.pick(0, prompt=later) is other


def test_a_new_conversation_goes_to_the_node_given_fewest_prefills_when_costs_tie() -> None:
    """Every node holds the shared opening and none is busy: the new conversation goes
    where the fewest recent prefills went, not where a hash happens to rank first (which
    over 32 conversations left one node of four with twice another's)."""
    for conversation in range(20):
        nodes = prefill_nodes(4)
        policy = Cost(nodes)
        # Three nodes each prefilled one other conversation (heard, as from a router
        # sharing --state); the fourth holds the opening too, and was given nothing.
        for index, node in enumerate(nodes[:3]):
            policy.heard(node, describe(completion(100 + index, 0)))
        policy.view.of(nodes[3].id).insert(describe(completion(99, 0)).chunks)
        assert policy.pick(0, prompt=describe(completion(conversation, 0))) is nodes[3]


def test_a_burst_of_new_conversations_behind_one_opening_is_bounded_per_node() -> None:
    """Eight new conversations at once behind an opening no node holds, nothing released,
    on a router that has served other traffic: after the first, the node computing the
    opening is the cheapest for each (each adds only its own few tokens of work there, and
    recomputing the opening elsewhere costs twice its tokens), but none carries more in
    flight than bounded loads allow, LOAD_FACTOR x the mean + 1, as ``prefix`` bounds it
    (without the bound, four of them queued on each of two nodes)."""
    nodes = prefill_nodes(4)
    policy = Cost(nodes)
    other = "Some other opening entirely, for the earlier traffic. " * 160
    for earlier in range(8):
        for node in nodes:
            body = {"model": "m", "prompt": other + f"conversation {node.id}.{earlier} " * 30}
            policy.heard(node, describe(body))
    inflight: Counter[int] = Counter()
    for conversation in range(8):
        prompt = describe(completion(conversation, 0))
        node = policy.pick(0, prompt=prompt)
        assert node is not None
        limit = LOAD_FACTOR * sum(inflight.values()) / len(nodes) + 1
        assert inflight[node.id] <= limit, (conversation, inflight)
        policy.place(node, 0, prompt)
        inflight[node.id] += 1
    assert max(inflight.values()) <= 3, inflight


def test_a_new_session_does_not_queue_behind_a_hot_opening_if_computing_it_is_sooner() -> None:
    """A burst of new conversations behind a 400-word opening no node held, nothing
    released: the first two share a node (the second waits for the opening there), the
    third goes to another node (the burst bound), which computes the opening again. The
    fourth would wait there for the whole opening, then its own 40 words and a prefill's
    PREFILL_TOKENS: more than HOT_WAIT later than computing it all on an idle node, so
    it goes to an idle node. Before, the burst bound let it pair with the third (one more
    in flight than the least busy node), each node's second session a moment after its
    first, the first wave's slowest requests: the completions shape's TTFT p99 was 1.06 x
    round_robin's. Questions on a 1,000-word document, whose own part is short beside
    it, pair all the same: waiting for the document is sooner than computing a copy."""

    def first_turn(opening: str, conversation: int, words: int) -> Prompt:
        own = " ".join(f"w{conversation}.{word}" for word in range(words))
        return describe({"model": "m", "prompt": opening + own})

    for opening_words, own_words, pairs in ((400, 40, False), (1000, 7, True)):
        opening = "".join(f"op{word} " for word in range(opening_words))
        policy = Cost(prefill_nodes(4))
        placed = []
        for conversation in range(3):
            prompt = first_turn(opening, conversation, own_words)
            node = policy.pick(0, prompt=prompt)
            assert node is not None
            policy.place(node, 0, prompt)
            placed.append(node)
        assert placed[0] is placed[1] is not placed[2], "paired, then the burst bound"
        third = placed[2]
        fourth = first_turn(opening, 3, own_words)
        held = policy.view.of(third.id).held(fourth.chunks)
        there = fourth.tokens - fourth.cached(held) + policy.waiting[third.id] + PREFILL_TOKENS
        assert (there > (1 + HOT_WAIT) * fourth.tokens) is not pairs, there / fourth.tokens
        node = policy.pick(0, prompt=fourth)
        assert (node is third) is pairs
        assert node is not placed[0]


def test_a_later_turn_is_not_moved_by_counts_a_new_conversation_avoids() -> None:
    """Its home was given a few more of the recent prefills than the others: a new
    conversation goes elsewhere, but the conversation's next turn stays home, where its
    history is (before, the share term moved it and it recomputed its first turn)."""
    policy, home = conversation_at_home()
    # Home was given three more prefills than each of the others.
    for index in range(2):
        policy.heard(home, describe(completion(200 + index, 0)))
    assert policy.pick(0, prompt=describe(completion(2, 0))) is not home
    assert policy.pick(0, prompt=describe(completion(1, 1))) is home


def document(number: int) -> str:
    return f"Document {number}, to answer questions from. " * 100


def question(doc: int, number: int) -> dict[str, object]:
    """A RAG request: a long document, then a question of its own."""
    messages = [
        {"role": "system", "content": document(doc)},
        {"role": "user", "content": f"Question {number} about document {doc}? " * 3},
    ]
    return {"model": "m", "messages": messages}


def rag_fleet() -> tuple[Cost, list[Node]]:
    """Four nodes, each given three questions on documents of its own (document 0 on node
    0, 1 on node 1, ...), all answered: every node holds its document, none is over its
    share."""
    nodes = prefill_nodes(4)
    policy = Cost(nodes)
    for node in nodes:
        for number in range(3):
            policy.release(policy.place(node, 0, describe(question(node.id, number))))
    return policy, nodes


def test_a_question_waits_behind_other_documents_rather_than_computing_its_own_again() -> None:
    """Node 0 holds document 0 and is within its share, but is computing two prefills
    of another document: the next question on document 0 waits there (the work waiting
    is in the cost, and less than computing the document again), rather than computing
    the whole document on an idle node. Before, the in-flight bound (2 in flight > 1.25 x
    the mean + 1) sent it elsewhere: in the RAG shape a rarely asked document was
    computed on a second and a third node this way (share of the ceiling 91.7%)."""
    policy, nodes = rag_fleet()
    home = nodes[0]
    # Node 0 now computes document 5 (a new one) and a question behind it, and each
    # other node was given one more prefill, so the shares stay level.
    busy = [policy.place(home, 0, describe(question(5, number))) for number in range(2)]
    for node in nodes[1:]:
        policy.release(policy.place(node, 0, describe(question(node.id, 9))))
    limit = LOAD_FACTOR * len(busy) / len(nodes) + 1
    assert len(busy) > limit
    ask = describe(question(0, 7))
    # What waits on node 0 costs less than computing document 0 elsewhere.
    assert policy.waiting[home.id] < MISS_WEIGHT * (ask.tokens - ask.cached(0))
    assert policy.pick(0, prompt=ask) is home
    # Document 5 is not hot (one of the last four placements, one copy): its next
    # question waits for what node 0 computes too, rather than computing it elsewhere
    # (before, the in-flight bound sent it to an idle node, which computed it again).
    assert policy.pick(0, prompt=describe(question(5, 9))) is home
    # Once those end, node 0 takes document 5's questions all the more.
    for placement in busy:
        policy.release(placement)
    assert policy.pick(0, prompt=describe(question(5, 9))) is home


def test_a_burst_of_questions_on_one_document_is_spread_while_it_is_hot() -> None:
    """Three questions in a row on a document one node holds, nothing released: the
    document had more of the last placements than it has copies, so the third goes
    elsewhere (waiting behind two there, as behind its computation, is what computing
    it again costs, and a burst's questions are spread as bounded loads spread them)."""
    policy, nodes = rag_fleet()
    home = nodes[0]
    busy = [policy.place(home, 0, describe(question(0, 10 + number))) for number in range(2)]
    assert policy.pick(0, prompt=describe(question(0, 12))) is not home
    for placement in busy:
        policy.release(placement)
    assert policy.pick(0, prompt=describe(question(0, 12))) is home


def test_the_share_term_does_not_copy_a_document_that_is_not_hot() -> None:
    """Node 0 holds document 0 and was given the most of the recent prefills (other
    documents' questions), node 3 the fewest: the share term sends new sessions that
    every node would compute alike to node 3, but a question on document 0, which has
    as many copies as it had of the last placements, stays with its holder. Before, the
    credit and the penalty together outweighed computing the document again, and node
    3 computed a second copy for one question (in the RAG shape, late in each run)."""
    nodes = prefill_nodes(4)
    policy = Cost(nodes)
    for node in nodes:
        policy.release(policy.place(node, 0, describe(question(node.id, 0))))
    for number in range(12):
        node = nodes[number % 3]
        policy.release(policy.place(node, 0, describe(question(10 + number % 3, number))))
    for number in range(6):
        policy.release(policy.place(nodes[0], 0, describe(question(20 + number % 2, number))))
    counts = [policy._counts.get(node.id, 0) for node in nodes]
    assert counts[0] == max(counts) and counts[3] == min(counts), counts
    assert policy.pick(0, prompt=describe(question(30, 0))) is nodes[3]
    assert policy.pick(0, prompt=describe(question(0, 1))) is nodes[0]


def test_a_later_turn_is_not_pulled_to_a_node_given_few_prefills() -> None:
    """Home holds conversation 1's first turn; node 3 was given far fewer of the recent
    prefills than the others. A new conversation goes to
    node 3, but the conversation's next turn stays home: moving it recomputes its history
    and queues it behind whatever else was pulled there (before, the share term's credit
    pulled such turns to node 3 one after another, the agent shape's slowest requests)."""
    nodes = prefill_nodes(4)
    policy = Cost(nodes)
    home = nodes[0]
    for index, node in enumerate(nodes):
        policy.heard(node, describe(completion(100 + index, 0)))
    for number in range(12):
        policy.heard(nodes[number % 3], describe(completion(200 + number, 0)))
    policy.heard(home, describe(completion(1, 0)))
    assert policy.pick(0, prompt=describe(completion(2, 0))) is nodes[3]
    assert policy.pick(0, prompt=describe(completion(1, 1))) is home


def test_the_first_sessions_behind_a_new_opening_start_on_every_node() -> None:
    """Eight sessions at once behind an opening no node holds, nothing released, on a
    router whose recent prefills went to node 0 once more than to the others (another
    workload): two start on
    each node. Each brings its later turns where it starts, so three on each of two
    nodes and none on another leave that node idle for the whole workload (before: the
    agent shape's max/min prefills per engine reached 2.2)."""
    nodes = prefill_nodes(4)
    policy = Cost(nodes)
    other = "Some other opening entirely, for the earlier traffic. " * 160
    for earlier in range(13):
        node = nodes[earlier % 4]
        policy.heard(node, describe({"model": "m", "prompt": other + f"c{earlier} " * 30}))
    started: Counter[int] = Counter()
    for conversation in range(8):
        prompt = describe(completion(conversation, 0))
        node = policy.pick(0, prompt=prompt)
        assert node is not None
        policy.place(node, 0, prompt)
        started[node.id] += 1
    assert sorted(started.values()) == [2, 2, 2, 2], started


SHORT_SYSTEM = "Answer in one short sentence, please. " * 8  # one chunk, shared


def short_question(number: int, words: int = 4) -> dict[str, object]:
    messages = [
        {"role": "system", "content": SHORT_SYSTEM},
        {"role": "user", "content": f"question {number}: " + "why so? " * words},
    ]
    return {"model": "m", "messages": messages}


def test_a_prefill_costs_more_than_its_few_tokens() -> None:
    """Short questions behind a shared system prompt both nodes hold: three are in flight
    on node 0, one longer one on node 1, each node given as many recent prefills. Node 0
    has fewer uncached tokens waiting, but three prefills to get through: the next
    question goes to node 1 (before, to node 0, behind all three: the short shape's
    p99 was 1.12 x round_robin's in route_replay, now 1.00)."""
    nodes = prefill_nodes(2)
    policy = Cost(nodes)
    for node in nodes:
        policy.release(policy.place(node, 0, describe(short_question(100 + node.id))))
    for number in range(3):
        policy.release(policy.place(nodes[1], 0, describe(short_question(200 + number))))
    for number in range(3):
        policy.place(nodes[0], 0, describe(short_question(300 + number)))
    policy.place(nodes[1], 0, describe(short_question(400, words=56)))
    assert policy.waiting[nodes[0].id] < policy.waiting[nodes[1].id], policy.waiting
    assert policy.pick(0, prompt=describe(short_question(500))) is nodes[1]


def test_the_policys_windows_follow_the_fleet_when_it_shrinks() -> None:
    """The share window is the last ``RECENT_PER_NODE`` x nodes placements and the hot
    window the last ``len(nodes)``: a fleet scaled down from 16 prefill nodes to 2 has
    windows for 2 (before, each kept its old length for good, one entry dropped for each
    added, and the share term and hotness weighed the 16-node fleet's history)."""
    nodes = prefill_nodes(16)
    policy = Cost(nodes)
    for conversation in range(200):
        place(policy, completion(conversation, 0))
    del policy.nodes[2:]
    policy.refresh()
    assert len(policy._recent) == RECENT_PER_NODE * 2 and len(policy._lately) == 2
    assert sum(policy._counts.values()) == len(policy._recent)
    for conversation in range(200, 220):
        place(policy, completion(conversation, 0))
    assert len(policy._recent) == RECENT_PER_NODE * 2 and len(policy._lately) == 2
    # Only the two nodes left are in the windows now, each given its share.
    assert sorted(policy._counts.items()) == [(0, RECENT_PER_NODE), (1, RECENT_PER_NODE)]


def test_a_later_turn_is_bounded_by_the_prefills_in_flight_at_home() -> None:
    """A long conversation's next turn, its home computing three other conversations'
    short turns (little work waiting, far less than recomputing the history elsewhere):
    home carries more in flight than LOAD_FACTOR x the mean + 1, so the turn is passed
    over to the idle node, as ``prefix`` bounds load. Without the bound, a conversation's
    turns queue behind every burst at home however many prefills wait there."""
    nodes = prefill_nodes(2)
    policy = Cost(nodes)
    home, other = nodes
    policy.release(policy.place(home, 0, describe(completion(1, 10))))
    policy.release(policy.place(other, 0, describe(completion(2, 0))))
    later = describe(completion(1, 11))
    assert policy.pick(0, prompt=later) is home
    busy = [policy.place(home, 0, describe(completion(3 + number, 0))) for number in range(3)]
    history = later.cached(policy.view.of(home.id).held(later.chunks))
    assert policy.waiting[home.id] < MISS_WEIGHT * history, "home is the cheapest"
    assert len(busy) > LOAD_FACTOR * len(busy) / len(nodes) + 1
    assert policy.pick(0, prompt=later) is other
    for placement in busy:
        policy.release(placement)
    assert policy.pick(0, prompt=later) is home


def test_a_later_turn_is_pushed_off_a_home_given_far_more_than_its_share() -> None:
    """The share term never pulls a conversation's next turn, but it pushes it off a home
    given more of the recent prefills than the mean plus the wider band, once that costs
    more than recomputing its short history elsewhere (a node every conversation's turns
    went to, the others idle, is what the share term is there to prevent)."""
    policy, home = conversation_at_home()
    assert policy.pick(0, prompt=describe(completion(1, 1))) is home
    for number in range(6):
        policy.heard(home, describe(completion(200 + number, 0)))
    assert policy.pick(0, prompt=describe(completion(1, 1))) is not home


def doc_question(doc: int, number: int, words: int = 3) -> dict[str, object]:
    """A document of exactly 20 whole chunks, then a question: a short one (a few words)
    lies in the partial tail, so the prompt's last whole chunk is the document's."""
    text = f"Document {doc}, to answer questions from. " * 200
    text = text[: 20 * CHUNK_BYTES] + f"Question {number}: " + "why so? " * words
    return {"model": "m", "prompt": text}


def test_a_hot_documents_holder_busy_with_other_prompts_still_takes_its_questions() -> None:
    """Node 0 holds document 0, on which two short questions ended (so what it holds is
    shared, not one conversation's history), and had two of the last four placements
    (hot). It now computes two prefills of another document, little work left to wait
    for: a longer question on document 0 goes there, not to an idle node that would
    compute the document again. The burst bound counts only the prefills behind the
    document's opening on its holders (none in flight here), and the in-flight bound of
    a conversation's next turn (which two prefills at home would exceed) does not apply
    to a prompt extending what two prompts ended at."""
    nodes = prefill_nodes(4)
    policy = Cost(nodes)
    home = nodes[0]
    for node in nodes:
        for number in range(3):
            policy.release(policy.place(node, 0, describe(doc_question(node.id, number))))
    for node in nodes[1:]:
        for number in range(4):
            policy.release(policy.place(node, 0, describe(doc_question(node.id, 10 + number))))
    for number in range(2):
        policy.release(policy.place(home, 0, describe(doc_question(0, 20 + number))))
    busy = [policy.place(home, 0, describe(doc_question(5, number))) for number in range(2)]
    assert len(set(policy._counts.values())) == 1, "every node given as many prefills"
    assert len(busy) > LOAD_FACTOR * len(busy) / len(nodes) + 1
    ask = describe(doc_question(0, 99, words=150))
    held = policy.view.of(home.id).held(ask.chunks)
    assert held == 20 < len(ask.chunks)
    assert policy.waiting[home.id] < MISS_WEIGHT * ask.cached(held)
    assert policy.pick(0, prompt=ask) is home
    # Nor does it leave for an idle node when more than HOT_WAIT x the whole prompt waits
    # there, short of what computing the document again costs: that is other prompts'
    # work, not the document's computation, which only a session behind it waits for.
    policy.waiting[home.id] = int((1 + HOT_WAIT) * ask.tokens) + 100
    queued = policy.waiting[home.id] + PREFILL_TOKENS * len(busy)
    assert MISS_WEIGHT * (ask.tokens - ask.cached(held)) + queued < MISS_WEIGHT * ask.tokens
    assert policy.pick(0, prompt=ask) is home


def test_a_session_no_node_holds_any_of_starts_within_the_burst_bound() -> None:
    """A prompt no node holds a chunk of (a new opening: hot by definition) goes only to a
    node with at most BURST_SLACK more prefills in flight than the least busy one, even
    where the share term would pull it to a node given fewer recent prefills that is
    busy with three cheap ones (each session brings its later turns where it starts)."""
    nodes = prefill_nodes(2)
    policy = Cost(nodes)
    busy_node, idle = nodes
    for number in range(12):
        policy.heard(idle, describe(completion(100 + number, 0)))
    policy.release(policy.place(busy_node, 0, describe(completion(1, 0))))
    busy = [policy.place(busy_node, 0, describe(completion(1, 0))) for _ in range(3)]
    assert policy.waiting[busy_node.id] < CHUNK_BYTES, "little work waiting there"
    fresh = describe({"model": "m", "prompt": "A new opening, held nowhere. " * 200})
    assert all(policy.view.of(node.id).held(fresh.chunks) == 0 for node in nodes)
    assert policy.pick(0, prompt=fresh) is idle
    for placement in busy:
        policy.release(placement)
    assert policy.pick(0, prompt=fresh) is busy_node, "the share term, once it is idle"


def test_what_the_policy_remembers_of_prompt_ends_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each prompt placed leaves its (node, last chunk) for ``_continues``: the last
    RECENT_KEYS only, whatever the number of conversations a router serves."""
    monkeypatch.setattr(prefill, "RECENT_KEYS", 16)
    policy = Cost(prefill_nodes(2))
    for conversation in range(100):
        place(policy, completion(conversation, 0))
    assert len(policy._ends) == 16


def test_the_share_weight_is_the_mean_size_of_the_prompts_in_its_window() -> None:
    """The share term costs the window's mean prompt size per prefill beyond the band: its
    chunks in all follow the window as it slides (before the window is full and long
    after), so that what a router served hours ago does not inflate the share term."""
    policy = Cost(prefill_nodes(4))
    for conversation in range(300):
        place(policy, completion(conversation, conversation % 7))
        assert policy._chunks == sum(chunks for _, chunks in policy._recent)


def test_the_shares_are_of_the_nodes_that_can_take_the_prefill() -> None:
    """A node that died after it was given many of the recent prefills: the mean the
    shares are measured against is the live nodes', so a later turn's home given far more
    than the others left is still pushed off (before the window forgets the dead node's
    prefills, they made every live node look under its share)."""
    nodes = prefill_nodes(5)
    policy = Cost(nodes)
    home, dead = nodes[0], nodes[4]
    for number in range(10):
        policy.heard(dead, describe(completion(300 + number, 0)))
    for index, node in enumerate(nodes[:4]):
        policy.heard(node, describe(completion(100 + index, 0)))
    policy.heard(home, describe(completion(1, 0)))
    for number in range(6):
        policy.heard(home, describe(completion(200 + number, 0)))
    dead.state = State.DEAD
    policy.refresh()
    assert policy.pick(0, prompt=describe(completion(1, 1))) not in (home, dead)

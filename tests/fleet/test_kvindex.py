"""What an engine holds by its KV events, in token space (``fleet/kvindex.py``), how the
router links it to the text it routes on, and the ``cost`` policy reading it; no server.

An "engine" here is what vLLM does, in a few lines: block hashes chained from a seed the
router does not know, ``BlockStored`` with the blocks' token ids and parent hash, eviction
of the least recently used block with ``BlockRemoved``.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from pd_router.fleet import kvindex
from pd_router.fleet.holdings import CHUNK_BYTES, KvView, chunk_keys, describe
from pd_router.fleet.kvevents import SETTLE, EventStreams, decode
from pd_router.fleet.kvindex import BlockIndex, Links, block_keys, cached_tokens
from pd_router.fleet.nodes import Node, make_nodes
from pd_router.fleet.prefill import Cost

BLOCK = 16


class Engine:
    """vLLM's prefix cache and its events, as its ZMQ publisher sends them (0.32's maps)."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.seed = random.randbytes(8)  # what PYTHONHASHSEED makes of vLLM's hashes
        self.capacity = capacity
        self.blocks: dict[bytes, None] = {}  # an LRU
        self.seq = 0

    def hashes(self, ids: list[int]) -> list[bytes]:
        parent, out = self.seed, []
        for start in range(0, len(ids) - BLOCK + 1, BLOCK):
            parent = hashlib.sha256(parent + repr(ids[start : start + BLOCK]).encode()).digest()
            out.append(parent)
        return out

    def cached(self, ids: list[int]) -> int:
        """What vLLM reports as ``cached_tokens`` for the prompt."""
        held = 0
        for block_hash in self.hashes(ids):
            if block_hash not in self.blocks:
                break
            held += 1
        return cached_tokens(held, BLOCK, len(ids))

    def prefill(self, ids: list[int]) -> list[bytes]:
        """Computes the prompt; the message its publisher sends."""
        hashes = self.hashes(ids)
        new = [index for index, block_hash in enumerate(hashes) if block_hash not in self.blocks]
        for block_hash in reversed(hashes):
            self.blocks.pop(block_hash, None)
            self.blocks[block_hash] = None
        events: list[Any] = []
        if new:
            first = new[0]
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes[first:],
                    "parent_block_hash": hashes[first - 1] if first else None,
                    "token_ids": ids[first * BLOCK : len(hashes) * BLOCK],
                    "block_size": BLOCK,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(next(iter(self.blocks)))
            del self.blocks[evicted[-1]]
        for block_hash in evicted:
            events.append({"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU"})
        return self.message(events)

    def reset(self) -> list[bytes]:
        self.blocks.clear()
        return self.message([{"type": "AllBlocksCleared"}])

    def message(self, events: list[Any]) -> list[bytes]:
        payload = msgpack.packb([time.time(), events, None])
        self.seq += 1
        return [b"kv-events", (self.seq - 1).to_bytes(8, "big"), payload]


def apply(streams: EventStreams, node_id: int, frames: list[bytes]) -> None:
    streams.apply(node_id, decode(frames, msgpack.unpackb(frames[2], raw=False)))


def tokens(text: str) -> list[int]:
    """A stand-in tokenizer: one token a word (the router never sees it)."""
    return [
        int.from_bytes(hashlib.blake2b(w.encode(), digest_size=3).digest()) for w in text.split()
    ]


def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{index}" for index in range(count))


def test_the_index_holds_exactly_the_blocks_the_events_say_keyed_by_their_tokens() -> None:
    engine = Engine(capacity=20)
    streams = EventStreams(KvView())
    streams.watch(0, "tcp://p0:5557")
    index = streams.streams[0].index
    first = tokens(words("a", 200))  # 12 whole blocks
    apply(streams, 0, engine.prefill(first))
    assert index.block_size == BLOCK and len(index) == 12
    # Another process hashes the same tokens to other hashes: the router's keys are its own.
    keys = block_keys(first, BLOCK)
    assert index.held(keys, len(keys)) == 12
    assert cached_tokens(index.held(keys, len(keys)), BLOCK, len(first)) == engine.cached(first)
    # A prompt that starts with it: held as far as it goes.
    longer = first + tokens(words("b", 60))
    longer_keys = block_keys(longer, BLOCK)
    assert index.held(longer_keys, len(longer_keys)) == 12
    apply(streams, 0, engine.prefill(longer))  # stored from the 13th block on, its parent known
    assert index.held(longer_keys, len(longer_keys)) == len(longer_keys) == 16
    # The cache holds 20 blocks: another prompt evicts the oldest, the first prompt's tail.
    apply(streams, 0, engine.prefill(tokens(words("c", 96))))
    held = index.held(longer_keys, len(longer_keys))
    assert held * BLOCK == engine.cached(longer) == 14 * BLOCK  # 16 + 6 blocks, 2 evicted
    apply(streams, 0, engine.reset())
    assert index.held(longer_keys, len(longer_keys)) == 0 and len(index) == 0


def test_blocks_whose_parent_the_router_never_heard_of_are_not_keyed() -> None:
    engine = Engine()
    engine.prefill(tokens(words("a", 64)))  # before the router subscribed
    streams = EventStreams(KvView())
    stream = streams.watch(0, "tcp://p0:5557")
    apply(streams, 0, engine.prefill(tokens(words("a", 64) + " " + words("b", 64))))
    # Followed (the engine holds them, and their removal says so), never compared.
    assert stream.unkeyed == 4 and stream.index.keyed == 0 and stream.index.blocks == 4


def test_blocks_with_extra_keys_are_other_blocks() -> None:
    index = BlockIndex()
    ids = list(range(32))
    assert index.stored([b"x", b"y"], None, ids, BLOCK, [["salt"], None])
    keys = block_keys(ids, BLOCK)
    # A salted first block (vLLM's cache_salt) is not the unsalted prompt's.
    assert index.held(keys, 2) == 0
    assert index.stored([b"u", b"v"], None, ids, BLOCK)
    assert index.held(keys, 2) == 2
    index.removed([b"u"])
    assert index.held(keys, 2) == 0
    # Token ids that are not numbers key nothing and break nothing.
    assert not index.stored([b"z"], None, [{}] * BLOCK, BLOCK)


def test_links_remember_what_a_text_was_in_tokens_and_a_later_turn_extends_it() -> None:
    links = Links()
    text = words("w", 300)
    prompt = describe({"model": "m", "prompt": text})
    ids = tokens(text)
    links.learn(prompt.chunks[-1], len(prompt.chunks) * 256, prompt.data, ids, BLOCK)
    turn = describe({"model": "m", "prompt": text + " " + words("n", 40)})
    match = links.match(turn.chunks, turn.data)
    assert match is not None and match.extends == len(turn.data) - len(prompt.data)
    assert list(match.blocks[: match.count]) == block_keys(ids, BLOCK)
    # A prompt that shares only the whole chunks: the blocks they surely cover, no more.
    other = describe({"model": "m", "prompt": text[:-3] + "zzz " + words("n", 40)})
    partial = links.match(other.chunks, other.data)
    assert partial is not None and partial.extends is None
    covered = len(tokens(text[: len(prompt.chunks) * 256]))
    assert 0 < partial.count * BLOCK <= covered
    assert links.match(describe({"model": "m", "prompt": words("x", 300)}).chunks, b"") is None


def test_links_are_bounded_by_the_block_keys_they_hold() -> None:
    links = Links(max_blocks=100)
    for conversation in range(20):
        text = words(f"c{conversation}x", 200)
        prompt = describe({"model": "m", "prompt": text})
        links.learn(prompt.chunks[-1], len(prompt.chunks) * 256, prompt.data, tokens(text), BLOCK)
        assert links.blocks <= 100
    assert len(links) == 100 // 12
    last = describe({"model": "m", "prompt": words("c19x", 200)})
    assert links.match(last.chunks, last.data) is not None
    first = describe({"model": "m", "prompt": words("c0x", 200)})
    assert links.match(first.chunks, first.data) is None


def prefill_nodes(count: int) -> list[Node]:
    return make_nodes([f"http://p{i}:8100" for i in range(count)], 1, role="prefill")


class Fleet:
    """Two engines with live event streams behind a ``cost`` policy, and what a relay does:
    pick, place, send (the engine computes it and publishes), learn from the answer."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.view = KvView()
        self.nodes = prefill_nodes(2)
        self.policy = Cost(self.nodes, self.view)
        self.streams = EventStreams(self.view)
        self.engines = [Engine(capacity), Engine(capacity)]
        for node in self.nodes:
            self.streams.watch(node.id, f"tcp://p{node.id}:5557")
            # The stream's first message: live from then on.
            apply(self.streams, node.id, self.engines[node.id].message([]))

    def serve(self, text: str, on: int | None = None) -> tuple[int, int, str, int]:
        """(node, predicted cached tokens, their source, the engine's cached tokens)."""
        prompt = describe({"model": "m", "prompt": text})
        node = self.policy.pick(0, prompt=prompt) if on is None else self.nodes[on]
        assert node is not None
        placement = self.policy.place(node, 0, prompt)
        self.policy.release(placement)
        ids = tokens(text)
        engine = self.engines[node.id]
        reported = engine.cached(ids)
        apply(self.streams, node.id, engine.prefill(ids))
        self.view.learn(node.id, prompt, ids)
        assert placement.cached is not None
        return node.id, placement.cached, placement.source, reported


def test_a_turn_is_predicted_exactly_from_events_once_the_text_was_learned() -> None:
    fleet = Fleet()
    text = words("s", 400)
    node, _, source, _ = fleet.serve(text)
    assert source == "prediction", "nothing learned of this text yet"
    for turn in range(3):
        text += " " + words(f"t{turn}x", 50)
        picked, predicted, source, reported = fleet.serve(text)
        assert (picked, source) == (node, "events")
        assert predicted == reported > 0


def test_another_routers_placement_is_seen_and_an_eviction_followed() -> None:
    """What prediction alone cannot see: the engine that held the conversation was reset
    and another router sent its next turn to the other engine; then that engine evicted it
    computing other routers' prompts."""
    fleet = Fleet(capacity=60)
    text = words("s", 400)
    first, _, _, _ = fleet.serve(text)
    other = 1 - first
    apply(fleet.streams, first, fleet.engines[first].reset())
    text += " " + words("t0x", 50)
    apply(fleet.streams, other, fleet.engines[other].prefill(tokens(text)))  # another router
    text += " " + words("t1x", 50)
    prompt = describe({"model": "m", "prompt": text})
    assert fleet.view.of(other).held(prompt.chunks) == 0, "this router placed nothing there"
    picked, predicted, source, reported = fleet.serve(text)
    # What this router learned (the first turn's 25 blocks) is held there, by its events.
    assert (picked, source, predicted) == (other, "events", 400)
    assert reported == 448, "and the other router's turn, which this one never saw the tokens of"
    # Other routers' prompts evict the conversation there: this router's prediction still
    # says it holds all of it, its events say what the engine will report.
    for index in range(3):
        apply(fleet.streams, other, fleet.engines[other].prefill(tokens(words(f"x{index}y", 300))))
    text += " " + words("t2x", 50)
    prompt = describe({"model": "m", "prompt": text})
    held = fleet.view.of(other).held(prompt.chunks)
    assert prompt.cached(held) > 400
    cached = fleet.view.cached(other, prompt, held)
    assert cached == fleet.engines[other].cached(tokens(text)) < 400
    assert fleet.view.source(other, prompt) == "events"


def test_without_a_live_stream_the_prediction_stands() -> None:
    fleet = Fleet()
    text = words("s", 400)
    node, _, _, _ = fleet.serve(text)
    fleet.streams.fault(node, "gap", "missed batches")
    text += " " + words("t0x", 50)
    picked, predicted, source, _ = fleet.serve(text)
    assert (picked, source) == (node, "prediction") and predicted > 0


def test_token_ids_an_engine_lies_about_teach_nothing_and_raise_nothing() -> None:
    """A prefill answer's ``prompt_token_ids`` that are not token ids (lists, strings, ids
    beyond 64 bits) are the engine's lie: the request goes on, nothing is linked, and the
    next turn is predicted as if the engine had not answered them."""
    fleet = Fleet()
    fleet.serve(words("w", 400), on=0)  # the engine's block size is known from here on
    node = fleet.nodes[0]
    text = words("s", 400)
    for lie in ([[1]] * 400, ["x"] * 400, [1 << 80] * 400):
        prompt = describe({"model": "m", "prompt": text})
        fleet.view.learn(node.id, prompt, lie)
        assert fleet.view.links.match(prompt.chunks, prompt.data) is None


def test_a_block_stored_twice_is_held_until_both_copies_are_removed() -> None:
    """vLLM does not de-duplicate its cache: two requests computing one prefix at once each
    cache a copy under the same hash, and evict each on its own. Before, the first removal
    took the block out of the index while the other copy still served hits, and the next
    turn, chained to it, was unkeyed."""
    index = BlockIndex()
    ids = list(range(4 * BLOCK))
    hashes = [101, 102, 103, 104]
    assert index.stored(hashes, None, ids, BLOCK)
    assert index.stored(hashes, None, ids, BLOCK)
    keys = block_keys(ids + list(range(100, 100 + 2 * BLOCK)), BLOCK)
    assert index.removed([104, 103]) == 2
    assert index.held(keys, 4) == 4 and index.blocks == 6
    assert index.stored([201, 202], 104, list(range(100, 100 + 2 * BLOCK)), BLOCK)
    assert index.held(keys, 6) == 6
    assert index.removed([104, 103, 999]) == 2, "a hash never stored is no block followed"
    assert index.held(keys, 6) == 2 and index.blocks == 6


def test_what_the_index_never_heard_of_the_prediction_answers() -> None:
    """After a gap in a node's events the index starts again empty: it knows nothing of
    what the engine held before. Live again, it answered 0 for the conversation the node
    still held, and the next turn was computed afresh elsewhere. What it never heard of (as
    against what it saw evicted) is the prediction's to say."""
    fleet = Fleet()
    now = [100.0]
    fleet.streams.clock = lambda: now[0]
    text = words("s", 400)
    node, _, _, _ = fleet.serve(text)
    text += " " + words("t0x", 50)
    assert fleet.serve(text)[:3] == (node, 400, "events")
    engine = fleet.engines[node]
    engine.seq += 3  # three messages the subscriber fell behind on
    apply(fleet.streams, node, engine.message([]))
    now[0] += SETTLE
    apply(fleet.streams, node, engine.message([]))
    assert fleet.streams.live(node) and len(fleet.streams.streams[node].index) == 0
    text += " " + words("t1x", 50)
    picked, predicted, source, reported = fleet.serve(text)
    assert (picked, source) == (node, "prediction") and predicted >= 400 and reported >= 400


def test_a_router_started_after_its_engine_predicts_what_came_before() -> None:
    """A router that starts (or subscribes) while the engine holds a shared system prompt:
    every later block chains to one the index never heard of, and is unkeyed. Its events
    cannot say the engine lacks them: the prediction does, from the router's own
    placements (before, the events said 0 for every turn of such conversations)."""
    fleet = Fleet()
    system = words("sys", 400)
    for node in fleet.nodes:
        fleet.engines[node.id].prefill(tokens(system))  # before the router heard
        fleet.streams.drop(node.id)
        fleet.streams.watch(node.id, f"tcp://p{node.id}:5557")
        apply(fleet.streams, node.id, fleet.engines[node.id].message([]))
    assert not any(stream.index.whole for stream in fleet.streams.streams.values())
    text = system + " " + words("q0x", 50)
    node, _, _, _ = fleet.serve(text)
    text += " " + words("t0x", 50)
    picked, predicted, source, reported = fleet.serve(text)
    assert (picked, source) == (node, "prediction") and predicted >= 400
    assert reported >= 448


def test_an_index_followed_since_the_cache_was_empty_knows_what_the_engine_lacks() -> None:
    """The router heard the engine's first message (or a clear): a block it never heard
    stored, the engine does not hold, whatever the router's own placements predict (a
    prefill that failed, another router's prompt that the engine evicted before...)."""
    fleet = Fleet()  # every engine's first message is sequence number 0
    text = words("s", 400)
    node, _, _, _ = fleet.serve(text, on=0)
    other = 1 - node
    fleet.serve(words("o", 100), on=other)  # another prompt: its block size is known there
    assert fleet.streams.streams[other].index.whole
    text += " " + words("t0x", 50)
    prompt = describe({"model": "m", "prompt": text})
    fleet.view.placed(other, "prefill", f"http://p{other}:8100", prompt)
    held = fleet.view.of(other).held(prompt.chunks)
    assert prompt.cached(held) > 400, "predicted held there"
    assert fleet.view.cached(other, prompt, held) == 0
    assert fleet.view.source(other, prompt) == "events"
    # A clear, heard: whole again; a gap: not.
    apply(fleet.streams, other, fleet.engines[other].reset())
    assert fleet.streams.streams[other].index.whole
    fleet.engines[other].seq += 2
    apply(fleet.streams, other, fleet.engines[other].message([]))
    assert not fleet.streams.streams[other].index.whole


def test_an_eviction_an_index_saw_is_believed_though_it_joined_late() -> None:
    """An index that did not follow the engine from an empty cache knows what it saw
    stored and then evicted: there its events answer, not the prediction."""
    index = BlockIndex()
    index.clear(empty=False)
    ids = list(range(3 * BLOCK))
    assert index.stored([1, 2, 3], None, ids, BLOCK)
    keys = block_keys(ids, BLOCK)
    assert index.removed([3]) == 1
    assert index.knows(keys, 3) == (2, True)
    assert index.knows(block_keys(list(range(100, 100 + 3 * BLOCK)), BLOCK), 3) == (0, False)


def test_an_engine_computes_a_prompts_last_token_itself() -> None:
    """vLLM computes at least the last prompt token: a prompt of whole blocks, all held, is
    served one block short of its length from cache (the cost counts that block's work)."""
    assert cached_tokens(4, BLOCK, 4 * BLOCK) == 3 * BLOCK
    assert cached_tokens(4, BLOCK, 4 * BLOCK + 1) == 4 * BLOCK
    assert cached_tokens(2, BLOCK, 4 * BLOCK) == 2 * BLOCK


def test_what_an_index_remembers_of_evictions_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The evicted keys an index remembers (what it knows the engine lacks) are the last
    GONE: an engine that turns its cache over for hours does not grow the router's memory,
    and the oldest evictions are the prediction's to answer again."""
    monkeypatch.setattr(kvindex, "GONE", 3)
    index = BlockIndex()
    first, second = list(range(3 * BLOCK)), list(range(500, 500 + 3 * BLOCK))
    assert index.stored([1, 2, 3], None, first, BLOCK)
    assert index.stored([11, 12, 13], None, second, BLOCK)
    assert index.removed([3, 2, 1]) == 3
    assert index.knows(block_keys(first, BLOCK), 3) == (0, True)
    assert index.removed([13, 12, 11]) == 3
    assert index.knows(block_keys(second, BLOCK), 3) == (0, True)
    assert index.knows(block_keys(first, BLOCK), 3) == (0, False)


def test_every_node_is_costed_in_the_tokens_the_engines_counted() -> None:
    """Long words: the router's estimate (4 bytes a token) is several times what the
    engine counted. Once learned, the next turn's tokens are the engine's for every node
    alike, the first one costed too: the turn stays where its history is (before, the
    first node was costed in the estimate, the others in the engine's count, and the
    turn moved off the node holding it)."""
    fleet = Fleet()
    long_words = " ".join(f"extraordinarily-long-word-{index}" for index in range(400))
    text = long_words
    fleet.serve(text, on=0)
    text += " " + words("t0x", 50)
    prompt = describe({"model": "m", "prompt": text})
    estimate = prompt.tokens
    assert fleet.policy.pick(0, prompt=prompt) is fleet.nodes[0]
    assert prompt.tokens < estimate / 3, "the engine's count replaced the estimate"
    picked, predicted, source, reported = fleet.serve(text)
    assert (picked, source) == (0, "events") and predicted == reported > 0


def test_what_was_learned_in_another_block_size_is_not_read_from_the_index() -> None:
    """The engine restarted with 32-token blocks: what the router learned of a text in its
    old 16-token blocks keys no block of the new index. The prediction answers for it, not
    the index, which would say the engine holds none of it."""
    fleet = Fleet()
    text = words("s", 400)
    fleet.serve(text, on=0)
    event = {
        "type": "BlockStored",
        "block_hashes": [b"a", b"b"],
        "parent_block_hash": None,
        "token_ids": list(range(64)),
        "block_size": 32,
        "medium": "GPU",
    }
    restart = [b"kv-events", bytes(8), msgpack.packb([time.time(), [event], None])]
    apply(fleet.streams, 0, restart)
    stream = fleet.streams.streams[0]
    assert stream.restarts == 1 and stream.block_size == 32 and fleet.streams.live(0)
    fleet.view.placed(0, "prefill", "http://p0:8100", describe({"model": "m", "prompt": text}))
    prompt = describe({"model": "m", "prompt": text + " " + words("t0x", 50)})
    held = fleet.view.of(0).held(prompt.chunks)
    assert fleet.view.source(0, prompt) == "prediction"
    assert fleet.view.cached(0, prompt, held) == prompt.cached(held) > 0


def test_a_text_sharing_only_whole_chunks_is_given_no_block_where_the_texts_part() -> None:
    """A prompt that shares a learned prompt's whole chunks but not the bytes after them
    is given the blocks the shared bytes surely cover: their share of the tokens, less a
    block (a token may straddle where the texts part, and the block holding it is not
    this prompt's)."""
    links = Links()
    data = bytes(range(256)) * 3 + b"the learned prompt's own tail " * 3
    chunked = 3 * CHUNK_BYTES
    ids = list(range(len(data) // 4))
    links.learn(chunk_keys(data)[-1], chunked, data, ids, BLOCK)
    other = data[:chunked] + b"another tail entirely, as long " * 3
    match = links.match(chunk_keys(other), other)
    assert match is not None and match.extends is None
    shared = len(ids) * chunked // len(data)
    assert match.count == shared // BLOCK - 1
    assert match.count * BLOCK <= shared - BLOCK


def test_token_ids_that_are_not_the_events_blocks_are_not_followed() -> None:
    """A BlockStored whose token ids do not fill its blocks is no engine's: it keys no
    block a prompt could be compared with, and is not counted as held."""
    index = BlockIndex()
    assert not index.stored([1, 2], None, list(range(BLOCK)), BLOCK)
    assert not index.stored([3], None, list(range(BLOCK + 1)), BLOCK)
    assert len(index) == 0 and index.blocks == 0
    assert index.held(block_keys(list(range(BLOCK)), BLOCK), 1) == 0


def test_a_prompt_learned_again_counts_its_blocks_once() -> None:
    """The same prompt learned again (a retry, a second engine's answer) replaces its link:
    the blocks the links hold are counted once, so the bound evicts no other link for it
    (before, each relearning added its blocks, and the bound emptied the links)."""
    links = Links(max_blocks=40)
    data = bytes(range(256)) * 3
    ids = list(range(10 * BLOCK))
    other = bytes(range(255, -1, -1)) * 2
    links.learn(chunk_keys(other)[-1], len(other), other, ids, BLOCK)
    for _ in range(10):
        links.learn(chunk_keys(data)[-1], len(data), data, ids, BLOCK)
    assert len(links) == 2 and links.blocks == 20
    assert links.match(chunk_keys(other), other) is not None

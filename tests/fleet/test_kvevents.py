"""What KV cache events in vLLM's wire format tell the router (``fleet/kvevents.py``), with
no server: the messages are built as vLLM's publisher builds them (msgpack, three frames)."""

from __future__ import annotations

import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from pd_router.fleet.holdings import CHUNK_TOKENS, MAX_CACHE_TOKENS, KvView
from pd_router.fleet.kvevents import (
    DEGRADED,
    LIVE,
    SETTLE,
    EventError,
    EventStreams,
    Removed,
    Stored,
    decode,
)


def message(seq: int, *events: list[Any]) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), msgpack.packb([time.time(), list(events)])]


def batch(seq: int, *events: list[Any]) -> Any:
    frames = message(seq, *events)
    return decode(frames, msgpack.unpackb(frames[2], raw=False))


def stored(count: int, size: int = 16) -> list[Any]:
    hashes = [b"h%d" % index for index in range(count)]
    return ["BlockStored", hashes, None, list(range(count * size)), size, None, None]


def test_vllm_messages_decode_and_garbage_does_not() -> None:
    # vLLM 0.32 encodes each event as a map tagged by "type" (msgspec tag=True, not
    # array_like); older publishers as a tagged array. Both are read.
    as_map = {
        "type": "BlockStored",
        "block_hashes": [b"h0", b"h1"],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    for event in (as_map, stored(2)):
        parsed = batch(7, event, ["BlockRemoved", [b"h0"], None], {"type": "AllBlocksCleared"})
        assert parsed.seq == 7
        first, removed, cleared = parsed.events
        assert isinstance(first, Stored) and first.hashes == [b"h0", b"h1"]
        assert (first.parent, first.ids, first.block_size) == (None, list(range(32)), 16)
        assert isinstance(removed, Removed) and removed.hashes == [b"h0"]
        assert cleared is None
    # Another medium (an offloading tier) or KV cache group is not the prefix cache, and a
    # BlockStored of no blocks says nothing.
    empty = {**as_map, "block_hashes": [], "token_ids": []}
    assert batch(1, {**as_map, "medium": "CPU"}, {**as_map, "group_idx": 1}, empty).events == ()
    # Newer vLLM versions add fields at the end (a data-parallel rank): still understood.
    frames = message(8, stored(1))
    assert decode(frames, [1.0, [stored(1)], 0]).seq == 8
    for frames, payload in [
        (frames[:2], None),
        ([b"t", b"\x00", b""], [1.0, []]),
        (frames, {"ts": 1.0}),
        (frames, [1.0, [["BlockStored", [b"h"], None, [], "sixteen"]]]),
        (frames, [1.0, [{**as_map, "block_hashes": [[1]]}]]),
        (frames, [1.0, [["SomethingElse"]]]),
        # No engine's block size: it would be taken as the engine's, and the capacity
        # learned from its evictions would be as large.
        (frames, [1.0, [{**as_map, "block_hashes": [], "token_ids": [], "block_size": 1 << 62}]]),
        (frames, [1.0, "events"]),
        # A hash longer than any engine's: each block would cost what the publisher wants.
        (frames, [1.0, [{**as_map, "block_hashes": [b"h" * 65, b"h1"]}]]),
        (frames, [1.0, [{**as_map, "parent_block_hash": "p" * 65}]]),
    ]:
        with pytest.raises(EventError):
            decode(frames, payload)


def test_a_clear_or_a_restart_empties_the_engines_predicted_holdings() -> None:
    view = KvView()
    streams = EventStreams(view)
    stream = streams.watch(0, "tcp://p0:5557")
    view.of(0).insert([1, 2, 3])
    streams.apply(0, batch(0, stored(3)))
    assert stream.state == LIVE and streams.live(0) and view.of(0).held([1, 2, 3]) == 3
    streams.apply(0, batch(1, ["AllBlocksCleared"]))
    assert view.of(0).held([1, 2, 3]) == 0 and stream.clears == 1 and stream.index.blocks == 0
    view.of(0).insert([1, 2, 3])
    streams.apply(0, batch(2, stored(1)))
    # The sequence starts again: a new engine process, with an empty cache.
    streams.apply(0, batch(0, stored(1)))
    assert view.of(0).held([1, 2, 3]) == 0 and stream.restarts == 1
    # A disconnect is most often the engine's process ending: forgotten at once, not at
    # the new process's first events (after the first requests to it were picked).
    view.of(0).insert([1, 2, 3])
    streams.fault(0, "disconnected", "tcp://p0:5557: disconnected")
    assert view.of(0).held([1, 2, 3]) == 0 and len(stream.index) == 0
    assert stream.state == DEGRADED


def test_a_gap_degrades_the_stream_until_messages_come_in_order_again() -> None:
    now = [100.0]
    streams = EventStreams(KvView(), clock=lambda: now[0])
    stream = streams.watch(0, "tcp://p0:5557")
    streams.apply(0, batch(0, stored(1)))
    assert stream.state == LIVE, "the first message heard is in order"
    streams.apply(0, batch(5, stored(1)))
    assert stream.state == DEGRADED and not streams.live(0) and stream.faults == {"gap": 1}
    # In order again, but a flood drops a message every few thousand: not live yet.
    now[0] += SETTLE / 2
    streams.apply(0, batch(6, stored(1)))
    assert stream.state == DEGRADED
    streams.apply(0, batch(9, stored(1)))
    now[0] += SETTLE / 2
    streams.apply(0, batch(10, stored(1)))
    assert stream.state == DEGRADED and stream.faults == {"gap": 2}
    # In order for SETTLE since the last gap: live, at the next message or the next tick
    # (an engine may say nothing for a while).
    now[0] += SETTLE / 2
    streams.settle()
    assert stream.state == LIVE and streams.live(0)
    streams.fault(0, "garbage", "not msgpack")
    assert not streams.live(0) and stream.faults == {"gap": 2, "garbage": 1}
    # A fault since the last message: no tick makes it live, only a message in order.
    now[0] += 2 * SETTLE
    streams.settle()
    assert stream.state == DEGRADED
    streams.apply(0, batch(11, stored(1)))
    assert stream.state == LIVE


def test_a_publisher_that_stores_and_never_evicts_is_bounded() -> None:
    """No engine holds more than ``max_blocks``: the index of one that says so is emptied
    (an overflow fault, degraded) instead of growing without end."""
    streams = EventStreams(KvView(), max_blocks=100)
    stream = streams.watch(0, "tcp://p0:5557")
    for seq in range(30):
        # A new prompt's 8 blocks each time.
        hashes = [seq * 8 + index for index in range(8)]
        event = ["BlockStored", hashes, None, list(range(seq * 128, seq * 128 + 128)), 16]
        streams.apply(0, batch(seq, [*event, None, None]))
        assert len(stream.index) <= 100
    assert stream.faults == {"overflow": 2} and stream.state == DEGRADED
    # A removal after it teaches no cache larger than an index may hold: of a block never
    # stored, nothing; of one stored, no more than ``max_blocks``.
    streams.apply(0, batch(30, ["BlockRemoved", [10**6], None]))
    assert stream.capacity is None
    streams.apply(0, batch(31, ["BlockRemoved", [29 * 8], None]))
    assert stream.capacity is not None and stream.capacity <= 100 * 16


def test_a_sha256_hash_or_a_64_bit_int_is_a_hash() -> None:
    event = ["BlockStored", [b"h" * 32, 2**64 - 1], "p" * 64, list(range(32)), 16, None, None]
    assert batch(0, event).events[0].hashes == [b"h" * 32, 2**64 - 1]


def test_blocks_of_another_size_are_garbage_and_what_events_teach_is_bounded() -> None:
    """An engine's blocks are of one size: a run of larger ones would make the capacity
    learned from its evictions (blocks x size) as large as a lie wants, and with it the
    prediction of what the engine holds, which would then forget nothing."""
    view = KvView(cache_tokens=1_000_000)
    streams = EventStreams(view)
    streams.watch(0, "tcp://p0:5557")
    streams.apply(0, batch(0, stored(4)))
    big = ["BlockStored", [b"x0", b"x1"], None, list(range(2 * 1024)), 1024, None, None]
    with pytest.raises(EventError, match="1024-token blocks after 16-token ones"):
        streams.apply(0, batch(1, big))
    # The engine restarted with another block size (its count starts again): taken.
    streams.apply(0, batch(0, ["BlockStored", [b"y0", b"y1"], None, list(range(64)), 32]))
    assert streams.streams[0].block_size == 32
    view.set_capacity(0, 10**12)
    assert view.of(0).capacity == MAX_CACHE_TOKENS // CHUNK_TOKENS


def test_evictions_teach_the_engines_capacity() -> None:
    view = KvView(cache_tokens=1_000_000)
    streams = EventStreams(view)
    stream = streams.watch(0, "tcp://p0:5557")
    streams.apply(0, batch(0, stored(40)))
    assert stream.capacity is None
    streams.apply(0, batch(1, ["BlockRemoved", [b"h0", b"h1"], None], stored(2)))
    assert stream.capacity == 40 * 16
    # The router's prediction of that engine is bounded by it from now on.
    assert view.of(0).capacity == 40 * 16 // CHUNK_TOKENS
    view.of(0).insert(list(range(100)))
    assert len(view.of(0)) == 40 * 16 // CHUNK_TOKENS


def test_a_router_that_joins_a_full_cache_learns_its_capacity_once_it_turned_over() -> None:
    """A router started while the engine's cache was full hears each step evict an old block
    it never saw stored and store a new one. Those removals teach nothing; once the cache
    has turned over, the evictions are of blocks it saw stored, and what it holds then is
    the cache. Before, every removal counted, the count of blocks held stayed near 1, and
    the capacity learned was one block (16 tokens) for the engine's 320,000."""
    view = KvView(cache_tokens=1_000_000)
    streams = EventStreams(view)
    stream = streams.watch(0, "tcp://p0:5557")
    blocks = 2_000
    old = list(range(blocks))  # held before the router listened
    new = 10**6
    for step in range(2 * blocks):
        gone = old[step] if step < blocks else new - blocks
        stored_one = ["BlockStored", [new], None, list(range(16)), 16, None, None]
        streams.apply(0, batch(500 + step, ["BlockRemoved", [gone], None], stored_one))
        new += 1
        if step < blocks:
            assert stream.capacity is None
    assert stream.capacity == blocks * 16


def test_an_engine_restarted_after_its_first_message_is_a_restart() -> None:
    """A new engine process numbers its messages from 0 again: one that restarted after
    sending only its first is no gap (which would leave its old prediction standing and
    the stream degraded) but a restart, its cache empty and followed whole."""
    view = KvView()
    streams = EventStreams(view)
    stream = streams.watch(0, "tcp://p0:5557")
    streams.apply(0, batch(0, stored(3)))
    view.of(0).insert([1, 2, 3])
    streams.apply(0, batch(0, stored(1)))
    assert stream.restarts == 1 and not stream.faults
    assert view.of(0).held([1, 2, 3]) == 0 and stream.index.blocks == 1
    assert stream.index.whole and streams.live(0)


def test_a_gap_does_not_shrink_the_capacity_evictions_taught() -> None:
    """After a gap the index starts again empty, so it holds few blocks when the engine
    next evicts one it saw stored: that is no measure of the cache, which evictions at a
    fuller index taught already (before, the capacity, and so the prediction's bound,
    fell to a few blocks and the router forgot what the engine held)."""
    view = KvView(cache_tokens=1_000_000)
    streams = EventStreams(view)
    stream = streams.watch(0, "tcp://p0:5557")
    streams.apply(0, batch(0, stored(40)))
    streams.apply(0, batch(1, ["BlockRemoved", [b"h0", b"h1"], None], stored(2)))
    assert stream.capacity == 40 * 16
    fresh = ["BlockStored", [b"n0", b"n1", b"n2"], None, list(range(48)), 16, None, None]
    streams.apply(0, batch(5, fresh))
    assert stream.faults == {"gap": 1} and stream.index.blocks == 3
    streams.apply(0, batch(6, ["BlockRemoved", [b"n2"], None]))
    assert stream.capacity == 40 * 16
    assert view.of(0).capacity == 40 * 16 // CHUNK_TOKENS


def test_an_engine_at_a_new_endpoint_is_followed_afresh_and_a_dropped_one_not_at_all() -> None:
    """The node's event endpoint changed (its pod was replaced, found through DNS): what
    the old publisher said is no word on the new engine, which is followed from its own
    first message. A node no longer watched is read from its prediction only."""
    view = KvView()
    streams = EventStreams(view)
    old = streams.watch(0, "tcp://p0:5557")
    streams.apply(0, batch(0, stored(3)))
    assert streams.live(0) and streams.watch(0, "tcp://p0:5557") is old
    new = streams.watch(0, "tcp://p0-new:5557")
    assert new is not old and new.endpoint == "tcp://p0-new:5557"
    assert not streams.live(0) and view.indexes[0] is new.index
    streams.apply(0, batch(7, stored(1)))
    assert streams.live(0) and view.live[0] is new.index and new.index.blocks == 1
    streams.drop(0)
    assert not streams.live(0) and 0 not in view.indexes


def test_a_restart_heard_after_its_first_messages_is_not_followed_whole() -> None:
    """The publisher's count went back, but not to 0: the engine restarted and the router
    missed its first messages, so the index cannot say the engine lacks what it never heard
    of (the prediction answers for it), as it can after hearing message 0."""
    view = KvView()
    streams = EventStreams(view)
    stream = streams.watch(0, "tcp://p0:5557")
    for seq in range(6):
        streams.apply(0, batch(seq, stored(1)))
    streams.apply(0, batch(3, stored(1)))
    assert stream.restarts == 1 and not stream.index.whole
    streams.apply(0, batch(0, stored(1)))
    assert stream.restarts == 2 and stream.index.whole


def test_an_engine_restarted_with_a_smaller_cache_has_its_capacity_learned_again() -> None:
    """A capacity once learned only grows with later evictions (one at a lower fill is the
    index missing blocks, not the cache shrinking), but a new process may have less memory
    for its cache: its first eviction sets the capacity again, and the prediction's bound
    with it. Before, the old capacity stood and the router predicted the engine held four
    times what it could."""
    view = KvView(cache_tokens=1_000_000)
    streams = EventStreams(view)
    stream = streams.watch(0, "tcp://p0:5557")
    streams.apply(0, batch(0, stored(40)))
    streams.apply(0, batch(1, ["BlockRemoved", [b"h0"], None]))
    assert stream.capacity == 40 * 16
    streams.apply(0, batch(0, stored(10)))
    assert stream.restarts == 1
    # Until the new process evicts, the bound learned before stands.
    assert view.of(0).capacity == 40 * 16 // CHUNK_TOKENS
    again = ["BlockStored", [b"x0"], None, list(range(16)), 16, None, None]
    streams.apply(0, batch(1, ["BlockRemoved", [b"h0"], None], again))
    assert stream.capacity == 10 * 16
    assert view.of(0).capacity == 10 * 16 // CHUNK_TOKENS

"""Where the router subscribes to an engine's KV events (``engines/kvevents.py``)."""

from __future__ import annotations

import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from pd_router.engines.kvevents import Subscriber, _apply, endpoint_of
from pd_router.fleet.holdings import KvView
from pd_router.fleet.kvevents import DEGRADED, LIVE, EventError, EventStreams, decode
from pd_router.fleet.nodes import make_nodes


def test_the_event_endpoint_is_the_kv_events_port_on_the_host_of_the_engines_url() -> None:
    four, six, none = make_nodes(
        [
            "http://10.0.0.7:8100,kv_events=5557",
            "http://[fd00::7]:8100,kv_events=5558",
            "http://p:8100",
        ],
        1,
        role="prefill",
    )
    assert endpoint_of(four) == "tcp://10.0.0.7:5557"
    assert endpoint_of(six) == "tcp://[fd00::7]:5558"
    assert endpoint_of(none) is None
    # A label set by hand (the admin API) that is not a port is no endpoint.
    none.labels["kv_events"] = "soon"
    assert endpoint_of(none) is None


def test_a_message_nested_past_pythons_recursion_limit_is_one_engines_garbage() -> None:
    """msgpack reads 1,000 levels of nesting, past where Python's own ``str`` and ``repr``
    give up (a RecursionError): such a message, in an event's type or a block's extra keys,
    degrades its engine's stream only, and the follower goes on (before, the error ended
    every subscriber, and every engine's stream was degraded by the restart)."""
    view = KvView()
    streams = EventStreams(view)
    for node_id in (0, 1):
        streams.watch(node_id, f"tcp://p{node_id}:5557")
    deep: object = "x"
    for _ in range(1020):
        deep = [deep]
    block = {"block_hashes": [1], "parent_block_hash": None, "token_ids": [7], "block_size": 1}
    for seq, event in enumerate(
        [{"type": deep}, {"type": "BlockStored", **block, "extra_keys": [deep]}]
    ):
        frames = [b"kv-events", seq.to_bytes(8, "big"), msgpack.packb([0.0, [event]])]
        _apply(streams, 0, "tcp://p0:5557", frames)
        _apply(streams, 1, "tcp://p1:5557", message(seq, {"type": "BlockStored", **block}))
    first, second = streams.streams[0], streams.streams[1]
    assert first.faults == {"garbage": 1} and first.state == DEGRADED, first.view()
    # The block with the deep extra keys is read and left out, as any it cannot key.
    assert first.unkeyed == 1 and first.index.keyed == 0
    assert second.state == LIVE and second.faults == {} and len(second.index) == 1


def message(seq: int, *events: dict[str, Any]) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), msgpack.packb([0.0, list(events)])]


def test_a_message_of_more_frames_than_vllms_is_kept_as_three_and_is_garbage() -> None:
    """ZMQ's message size bound is per frame: 20 frames of 3 MiB were 60 MiB taken whole.
    A message of more than vLLM's three frames keeps its first three (and an empty fourth,
    which ``decode`` refuses), and what follows it is received as ever."""
    context: zmq.Context[Any] = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    subscriber = Subscriber(context, f"tcp://127.0.0.1:{port}")
    subscriber.start()
    try:
        frame = b"\0" * (1 << 20)
        item = None
        deadline = time.monotonic() + 30
        while item is None:  # ZMQ subscribers join late: sent until heard
            assert time.monotonic() < deadline, "nothing heard"
            publisher.send_multipart([frame] * 20)
            time.sleep(0.05)
            item = subscriber.take()
        assert isinstance(item, list) and [len(part) for part in item] == [1 << 20] * 3 + [0]
        with pytest.raises(EventError):
            decode(item, None)
        good = message(7, {"type": "AllBlocksCleared"})
        publisher.send_multipart(good)
        while (item := subscriber.take()) != good:
            assert time.monotonic() < deadline, "the next message not heard"
            time.sleep(0.01)
    finally:
        subscriber.stop()
        subscriber.join()
        publisher.close()
        context.term()

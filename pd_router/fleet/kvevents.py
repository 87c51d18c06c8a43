"""What an engine's KV cache events tell the router about what it holds. No I/O.

vLLM started with ``--kv-events-config`` publishes on a ZMQ PUB socket; a message is three
frames: the topic, an 8-byte big-endian sequence number, and a msgpack payload
``[ts, [event, ...]]`` (msgspec ``array_like`` structs, tagged: an event is
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium]``, ``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``; newer
versions add trailing fields, which are ignored). ``engines/kvevents.py`` receives them;
``decode`` checks one, and ``EventStream`` applies it to the engine's ``Holdings``.

Block hashes are over token ids, in blocks of the engine's block size, chained from a seed
the router cannot know; the router has no tokenizer and sees text, so it cannot tell which
of its prompt chunks a hash stands for (llm-d and Dynamo tokenize in the router for that).
What events do tell reliably, and what the router uses them for:

* ``AllBlocksCleared`` (``/reset_prefix_cache``, a weights reload): the engine holds nothing;
  the router forgets what it predicted there.
* a sequence number going back: the publisher started again, the engine restarted with an
  empty cache; the same.
* ``BlockRemoved`` after ``BlockStored``: the engine is evicting, so what it holds now
  (stored - removed blocks x block size) is its cache's real capacity; the router's
  prediction of that engine is bounded by it instead of by ``--engine-cache-tokens``.

A gap in the sequence numbers (the subscriber fell behind: ZMQ drops what a slow
subscriber does not take) or a message that does not parse makes the stream ``degraded``:
the router goes on predicting from its own placements, and counts the fault; the next
message in order makes it ``live`` again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_router.fleet.holdings import Holdings, KvView

WAITING = "waiting"
LIVE = "live"
DEGRADED = "degraded"


class EventError(ValueError):
    """A message that is not vLLM's KV event batch."""


@dataclass(frozen=True)
class Batch:
    seq: int
    # (kind, block hash count, block size or 0) per event: all the router reads.
    events: tuple[tuple[str, int, int], ...]


def decode(frames: Sequence[bytes], payload: Any) -> Batch:
    """Checks a message: its frames (topic, seq, payload bytes) and the payload as msgpack
    decoded it (``payload``)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise EventError(f"expected 3 frames with an 8-byte sequence number, got {len(frames)}")
    seq = int.from_bytes(frames[1], "big")
    if not isinstance(payload, list | tuple) or len(payload) < 2:
        raise EventError("the payload is not [ts, [events]]")
    events = payload[1]
    if not isinstance(events, list | tuple):
        raise EventError("the payload's events are not a list")
    parsed = []
    for event in events:
        if not isinstance(event, list | tuple) or not event or not isinstance(event[0], str):
            raise EventError("an event is not a tagged array")
        kind = event[0]
        if kind == "BlockStored":
            if len(event) < 5 or not isinstance(event[1], list | tuple):
                raise EventError("BlockStored without block hashes")
            size = event[4]
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise EventError("BlockStored without a block size")
            parsed.append((kind, len(event[1]), size))
        elif kind == "BlockRemoved":
            if len(event) < 2 or not isinstance(event[1], list | tuple):
                raise EventError("BlockRemoved without block hashes")
            parsed.append((kind, len(event[1]), 0))
        elif kind == "AllBlocksCleared":
            parsed.append((kind, 0, 0))
        else:
            raise EventError(f"unknown event {kind[:40]!r}")
    return Batch(seq, tuple(parsed))


@dataclass
class EventStream:
    """One engine's event stream, as the router sees it."""

    endpoint: str
    state: str = WAITING
    seq: int | None = None
    batches: int = 0
    # Blocks the engine holds now, by its events, and their size in tokens.
    blocks: int = 0
    block_size: int = 0
    # The engine's cache, in its tokens, once it has evicted (None before).
    capacity: int | None = None
    clears: int = 0
    restarts: int = 0
    # Faults by kind ("gap", "garbage", "disconnected"), for the metric.
    faults: dict[str, int] = field(default_factory=dict)
    last_fault: str | None = None

    def fault(self, kind: str, message: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        self.last_fault = message
        self.state = DEGRADED

    def apply(self, batch: Batch, holdings: Holdings) -> None:
        """A batch arrived: the engine's ``holdings`` follow what it says."""
        if self.seq is not None and batch.seq <= self.seq:
            # The publisher's count started again: a new engine process, an empty cache.
            self.restarts += 1
            self._cleared(holdings)
        elif self.seq is not None and batch.seq != self.seq + 1:
            self.fault("gap", f"missed batches {self.seq + 1}-{batch.seq - 1}")
            self.seq = batch.seq
            self.batches += 1
            self._events(batch, holdings)
            return
        self.seq = batch.seq
        self.batches += 1
        self.state = LIVE
        self._events(batch, holdings)

    def _events(self, batch: Batch, holdings: Holdings) -> None:
        for kind, count, size in batch.events:
            if kind == "BlockStored":
                self.blocks += count
                self.block_size = size
            elif kind == "BlockRemoved":
                if self.capacity is None or self.blocks > self.capacity // max(self.block_size, 1):
                    # Evicting at this fill: the cache is this big.
                    self.capacity = self.blocks * self.block_size
                self.blocks = max(self.blocks - count, 0)
            else:
                self.clears += 1
                self._cleared(holdings)

    def _cleared(self, holdings: Holdings) -> None:
        self.blocks = 0
        holdings.clear()

    def view(self) -> dict[str, Any]:
        """For ``/admin/nodes``."""
        return {
            "endpoint": self.endpoint,
            "state": self.state,
            "seq": self.seq,
            "batches": self.batches,
            "blocks": self.blocks,
            "block_size": self.block_size,
            "capacity_tokens": self.capacity,
            "clears": self.clears,
            "restarts": self.restarts,
            "faults": dict(self.faults),
            "last_fault": self.last_fault,
        }


class EventStreams:
    """The event streams of the engines that publish, by node id, applied to a ``KvView``."""

    def __init__(self, view: KvView) -> None:
        self.view = view
        self.streams: dict[int, EventStream] = {}

    def watch(self, node_id: int, endpoint: str) -> EventStream:
        stream = self.streams.get(node_id)
        if stream is None or stream.endpoint != endpoint:
            stream = self.streams[node_id] = EventStream(endpoint)
        return stream

    def drop(self, node_id: int) -> None:
        self.streams.pop(node_id, None)

    def apply(self, node_id: int, batch: Batch) -> None:
        stream = self.streams.get(node_id)
        if stream is None:
            return
        stream.apply(batch, self.view.of(node_id))
        if stream.capacity:
            self.view.set_capacity(node_id, stream.capacity)

    def live(self, node_id: int) -> bool:
        """Whether what the router knows of this engine follows its events now."""
        stream = self.streams.get(node_id)
        return stream is not None and stream.state == LIVE

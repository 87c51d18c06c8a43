"""What an engine's KV cache events tell the router about what it holds. No I/O.

vLLM started with ``--kv-events-config`` publishes on a ZMQ PUB socket; a message is three
frames: the topic, an 8-byte big-endian sequence number, and a msgpack payload
``[ts, [event, ...], dp_rank]`` (msgspec ``array_like``). vLLM 0.32 encodes each event as a
map tagged by ``type`` (``{"type": "BlockStored", "block_hashes": [...],
"parent_block_hash": ..., "token_ids": [...], "block_size": N, "medium": "GPU", ...}``,
``BlockRemoved`` with ``block_hashes``, ``AllBlocksCleared``); earlier publishers and other
tools send tagged arrays (``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, ...]``): both are read, extra fields ignored.
``engines/kvevents.py`` receives them; ``decode`` checks one, and ``EventStream`` applies
it to the engine's ``BlockIndex`` (``fleet/kvindex.py``: the blocks it holds, keyed by their
token ids, which is what makes them comparable with a prompt's) and its predicted
``Holdings``:

* ``BlockStored``/``BlockRemoved``: the index follows, exactly; blocks of another medium
  (an offloading tier) or another KV cache group (a hybrid model's sliding window) are not
  the prefix cache the router routes on, and are left out.
* ``AllBlocksCleared`` (``/reset_prefix_cache``, a weights reload), a sequence number
  going back (the engine restarted) and a disconnect (most often the engine's process
  ending): the engine holds nothing; index and prediction are emptied.
* ``BlockRemoved`` of a block stored since the router listened: the engine is evicting
  what the router saw it store (what it held before went first), so what it holds now
  (stored - removed blocks x block size) is its cache's real capacity; the prediction of
  that engine is bounded by it instead of by ``--engine-cache-tokens``. Removals of blocks
  stored before (a router started while the engine's cache was full) teach nothing.

A gap in the sequence numbers (the subscriber fell behind: ZMQ drops what a slow
subscriber does not take), a message that does not parse, a disconnect, or an index
grown past any engine's cache (``MAX_BLOCKS``: a publisher that stores and never evicts)
makes the stream ``degraded``: the router predicts from its own placements; after a gap
or an overflow the index, which missed stores and removals, starts again empty. The
stream is ``live`` again once messages have come in order for ``SETTLE`` seconds with no
fault: a flood that drops messages every few thousand keeps it degraded, where going live
at each message in order would have the router read an index emptied a moment ago as the
engine's whole cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from pd_router.fleet.holdings import Holdings, KvView
from pd_router.fleet.kvindex import BlockIndex

WAITING = "waiting"
LIVE = "live"
DEGRADED = "degraded"
# The subscriber lost its connection (the fault's kind).
DISCONNECTED = "disconnected"


class EventError(ValueError):
    """A message that is not vLLM's KV event batch."""


STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"
# A stream is live again this long after its last fault, once messages come in order.
SETTLE = 1.0
# Blocks an engine's index holds at most (~150 bytes each: ~150 MB). Far above any GPU's
# prefix cache (an 80 GB GPU holds ~30,000 blocks of 16 tokens of an 8B model's KV, ~600,000
# of a 0.5B model's): more is a publisher that stores and never evicts, which would grow
# the index without end.
MAX_BLOCKS = 1 << 20
# A larger block size is no engine's (vLLM's are 1-256, a hybrid model's up to a few
# thousand): it would make the capacity learned from evictions, and so the prediction's
# bound, as large as a lie wants.
MAX_BLOCK_SIZE = 1 << 16
# Bytes of one block hash: vLLM's are 32 (sha256), or 64-bit ints. A longer one is a lie
# that would make each block of the index cost what the publisher wants.
MAX_HASH_BYTES = 64
# The mediums of the engine's own prefix cache (vLLM's GPU pool; its CPU backend says GPU
# too): an offloading tier's blocks are not what the engine finds by prefix caching.
_PREFIX_CACHE = (None, "GPU")


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: list[Any]
    parent: Any
    ids: list[Any]
    block_size: int
    # Per block: what else went into its hash (a LoRA, a cache salt, media), or None.
    extra: list[Any] | None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: list[Any]


Event = Stored | Removed | None  # None: AllBlocksCleared


@dataclass(frozen=True)
class Batch:
    seq: int
    events: tuple[Event, ...]


# The fields of vLLM's events, in the order a tagged array carries them.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def decode(frames: Sequence[bytes], payload: Any) -> Batch:
    """Checks a message: its frames (topic, seq, payload bytes) and the payload as msgpack
    decoded it (``payload``). Events of another medium or KV cache group are dropped."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise EventError(f"expected 3 frames with an 8-byte sequence number, got {len(frames)}")
    seq = int.from_bytes(frames[1], "big")
    if not isinstance(payload, list | tuple) or len(payload) < 2:
        raise EventError("the payload is not [ts, [events]]")
    events = payload[1]
    if not isinstance(events, list | tuple):
        raise EventError("the payload's events are not a list")
    parsed: list[Event] = []
    for event in events:
        if isinstance(event, dict):
            kind, fields = event.get("type"), event
        elif isinstance(event, list | tuple) and event:
            kind = event[0]
            names = _STORED_FIELDS if kind == STORED else _REMOVED_FIELDS
            fields = dict(zip(names, event[1:]))
        else:
            raise EventError("an event is neither a tagged map nor a tagged array")
        if kind == STORED:
            stored = _stored(fields)
            if stored is not None:
                parsed.append(stored)
        elif kind == REMOVED:
            hashes = fields.get("block_hashes")
            if not _hashes(hashes):
                raise EventError("BlockRemoved without block hashes")
            if _ours(fields):
                parsed.append(Removed(hashes))
        elif kind == CLEARED:
            parsed.append(None)
        else:
            shown = kind[:40] if isinstance(kind, str) else type(kind).__name__
            raise EventError(f"unknown event {shown!r}")
    return Batch(seq, tuple(parsed))


def _stored(fields: dict[str, Any]) -> Stored | None:
    hashes, ids, parent = (
        fields.get("block_hashes"),
        fields.get("token_ids"),
        fields.get("parent_block_hash"),
    )
    if not _hashes(hashes) or not isinstance(ids, list) or not _hashes([parent]):
        raise EventError("BlockStored without block hashes (of 64 bytes at most) and token ids")
    size = fields.get("block_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE:
        raise EventError("BlockStored without a block size (1 to 65,536 tokens)")
    if not _ours(fields) or not hashes:
        return None
    extra = fields.get("extra_keys")
    extra = extra if isinstance(extra, list) and any(e is not None for e in extra) else None
    return Stored(hashes, parent, ids, size, extra)


def _hashes(value: object) -> TypeGuard[list[Any]]:
    """A list of block hashes (bytes, or ints with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return isinstance(value, list) and all(
        block_hash is None
        or isinstance(block_hash, int)
        or (isinstance(block_hash, bytes | str) and len(block_hash) <= MAX_HASH_BYTES)
        for block_hash in value
    )


def _ours(fields: dict[str, Any]) -> bool:
    """Whether an event is about the engine's prefix cache (its first KV cache group)."""
    return fields.get("medium") in _PREFIX_CACHE and fields.get("group_idx") in (None, 0)


@dataclass
class EventStream:
    """One engine's event stream, as the router sees it."""

    endpoint: str
    state: str = WAITING
    seq: int | None = None
    batches: int = 0
    # The size of the engine's blocks (how many it holds now: ``index.blocks``).
    block_size: int = 0
    # The engine's cache, in its tokens, once it has evicted (None before).
    capacity: int | None = None
    clears: int = 0
    restarts: int = 0
    # Stored blocks the index could not key: their parent was stored before the router
    # heard (it started later, or missed it).
    unkeyed: int = 0
    # Faults by kind ("gap", "garbage", "disconnected", "overflow"), for the metric.
    faults: dict[str, int] = field(default_factory=dict)
    last_fault: str | None = None
    index: BlockIndex = field(default_factory=BlockIndex)
    max_blocks: int = MAX_BLOCKS
    # When the last fault was (the follower's monotonic clock), and whether a message in
    # order has come since: the stream is live again ``SETTLE`` seconds after the fault.
    faulted_at: float = 0.0
    in_order: bool = False

    def fault(self, kind: str, message: str, now: float) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        self.last_fault = message
        self.state = DEGRADED
        self.faulted_at = now
        self.in_order = False

    def apply(self, batch: Batch, holdings: Holdings, now: float) -> None:
        """A batch arrived: the engine's index and ``holdings`` follow what it says."""
        if self.seq is None:
            # The first heard: the engine's first (its cache empty, followed whole), or
            # the router joined later and what it holds from before is unknown.
            self.index.whole = batch.seq == 0
            self.in_order = True
        elif batch.seq <= self.seq:
            # The publisher's count started again: a new engine process, an empty cache,
            # followed from its start (whole if from its first batch).
            self.restarts += 1
            self.forget(holdings, empty=batch.seq == 0, restarted=True)
            self.in_order = True
        elif batch.seq != self.seq + 1:
            self.fault("gap", f"missed batches {self.seq + 1}-{batch.seq - 1}", now)
            # The index missed stores and removals: it starts again from what comes now.
            self.index.clear()
        else:
            self.in_order = True
        self.seq = batch.seq
        self.batches += 1
        self._events(batch, holdings)
        if len(self.index) > self.max_blocks:
            self.fault("overflow", f"more than {self.max_blocks} blocks: no engine's cache", now)
            self.index.clear()
        self.settle(now)

    def settle(self, now: float) -> None:
        """Live if messages came in order since the last fault, ``SETTLE`` seconds ago."""
        if self.in_order and (self.state == WAITING or now - self.faulted_at >= SETTLE):
            self.state = LIVE

    def _events(self, batch: Batch, holdings: Holdings) -> None:
        index = self.index
        for event in batch.events:
            if isinstance(event, Stored):
                size = index.block_size
                if len(event.hashes) > 1 and size and event.block_size != size:
                    # One size per cache group in vLLM: blocks of another would make the
                    # capacity learned from evictions (blocks x size) what a lie wants.
                    raise EventError(f"{event.block_size}-token blocks after {size}-token ones")
                if not index.stored(
                    event.hashes, event.parent, event.ids, event.block_size, event.extra
                ):
                    self.unkeyed += len(event.hashes)
                self.block_size = index.block_size or event.block_size
            elif isinstance(event, Removed):
                blocks = index.blocks
                if index.removed(event.hashes) and (
                    self.capacity is None or blocks > self.capacity // max(self.block_size, 1)
                ):
                    # Evicting at this fill a block stored since the router listened: the
                    # cache holds this much (the blocks stored before went first; no more
                    # than an index may hold: a lie's count of blocks is no bound).
                    self.capacity = min(blocks, self.max_blocks) * self.block_size
            else:
                self.clears += 1
                self.forget(holdings, empty=True)

    def forget(self, holdings: Holdings, empty: bool = False, restarted: bool = False) -> None:
        """The engine holds nothing the router knows of: nothing at all if ``empty``; a new
        process if ``restarted``: its blocks may be of another size and its cache of another
        capacity (restarted with less memory for it), both learned again. The capacity
        learned before bounds the prediction until its first eviction says what it is now
        (evictions only ever raise a capacity once learned)."""
        self.index.clear(empty)
        if restarted:
            self.index.block_size = 0
            self.capacity = None
        holdings.clear()

    def view(self) -> dict[str, Any]:
        """For ``/admin/nodes``."""
        return {
            "endpoint": self.endpoint,
            "state": self.state,
            "seq": self.seq,
            "batches": self.batches,
            "blocks": self.index.blocks,
            "indexed_blocks": self.index.keyed,
            "unkeyed_blocks": self.unkeyed,
            "block_size": self.block_size,
            "capacity_tokens": self.capacity,
            "clears": self.clears,
            "restarts": self.restarts,
            "faults": dict(self.faults),
            "last_fault": self.last_fault,
        }


class EventStreams:
    """The event streams of the engines that publish, by node id, applied to a ``KvView``:
    the view reads the index of every stream that is live (``KvView.cached``)."""

    def __init__(
        self,
        view: KvView,
        clock: Callable[[], float] = time.monotonic,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        self.view = view
        self.clock = clock
        self.max_blocks = max_blocks
        self.streams: dict[int, EventStream] = {}

    def watch(self, node_id: int, endpoint: str) -> EventStream:
        stream = self.streams.get(node_id)
        if stream is None or stream.endpoint != endpoint:
            stream = self.streams[node_id] = EventStream(endpoint, max_blocks=self.max_blocks)
            self.view.indexes[node_id] = stream.index
            self.view.live.pop(node_id, None)
        return stream

    def drop(self, node_id: int) -> None:
        self.streams.pop(node_id, None)
        self.view.indexes.pop(node_id, None)
        self.view.live.pop(node_id, None)

    def apply(self, node_id: int, batch: Batch) -> None:
        stream = self.streams.get(node_id)
        if stream is None:
            return
        stream.apply(batch, self.view.of(node_id), self.clock())
        self._state(node_id, stream)
        if stream.capacity:
            self.view.set_capacity(node_id, stream.capacity)

    def fault(self, node_id: int, kind: str, message: str) -> None:
        stream = self.streams.get(node_id)
        if stream is not None:
            stream.fault(kind, message, self.clock())
            if kind == DISCONNECTED:
                # Most often the engine's process ended (a restart comes back with an empty
                # cache, and says so only with its first events, after the first requests
                # were picked); a connection back to the same process costs only what the
                # router then learns again.
                stream.forget(self.view.of(node_id), restarted=True)
            self._state(node_id, stream)

    def settle(self) -> None:
        """Streams in order since their last fault, long enough ago, are live again
        (called every tick: an engine may say nothing for a while after its fault)."""
        now = self.clock()
        for node_id, stream in self.streams.items():
            if stream.state == DEGRADED:
                stream.settle(now)
                self._state(node_id, stream)

    def _state(self, node_id: int, stream: EventStream) -> None:
        if stream.state == LIVE:
            self.view.live[node_id] = stream.index
        else:
            self.view.live.pop(node_id, None)

    def live(self, node_id: int) -> bool:
        """Whether what the router knows of this engine follows its events now."""
        return node_id in self.view.live

"""Subscribers to the prefill engines' KV cache events (vLLM's ZMQ publisher).

An engine publishes when its node has the ``kv_events=PORT`` option (static, admin or DNS,
like its HTTP port): the router connects a ZMQ SUB socket to ``tcp://HOST:PORT``, HOST the
host of the node's URL. Each subscriber is a thread that only receives messages, as bytes,
into an inbox bounded in messages and in bytes; every ``TICK`` seconds the event loop
checks and applies them (``fleet/kvevents.py`` says what they mean) for at most
``BUDGET`` seconds, and leaves the rest for the next tick. So a flood of events, a
stalled engine or a broken message never blocks a request: the loop gives events a
fifth of its time at most; an inbox that overflows drops its oldest messages, which shows
as a gap in the sequence numbers and degrades the stream to prediction, as a message that
does not parse and a disconnect do. A message larger than ``MAX_MESSAGE`` is refused by
ZMQ itself (it closes the connection: a disconnect), and ZMQ heartbeats find a publisher
that stopped answering (its host gone, its process stopped) within ``HEARTBEAT_TIMEOUT``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import msgpack  # type: ignore[import-untyped]
import zmq

from pd_router.fleet.kvevents import DEGRADED, DISCONNECTED, EventStreams, decode
from pd_router.fleet.nodes import KV_EVENTS, Node, whole
from pd_router.ops.ticks import sleep_to_tick

log = logging.getLogger("pd_router.kvevents")

TICK = 0.05
# With no node publishing, only the check for one that has started to: a router without
# KV events pays no 50 ms tick (2 ms of CPU a second, measured).
IDLE_TICK = 1.0
# Of each tick, at most this applying events (the loop is late by no more, and one
# message's worth: a flood takes a fifth of the loop at most; what is left waits).
BUDGET = 0.01
# Messages a subscriber holds for the loop, and their bytes; beyond, the oldest go (a gap,
# then degraded). Dropped here, not left in ZMQ's queues: those would fill up to the
# publisher's (vLLM's holds 100,000 messages), and the router, that far behind, would not
# see the gap before it had applied them all.
INBOX = 4096
INBOX_BYTES = 16 << 20
# A larger message is no engine's: a scheduling step's BlockStored for ~500,000 tokens
# (~7 bytes a token with its block hashes) fits. ZMQ drops the connection on one.
MAX_MESSAGE = 4 << 20
# Messages ZMQ itself queues for the thread, which takes them at once (so at most
# RECEIVE_QUEUE x MAX_MESSAGE in ZMQ's buffers, however fast a publisher sends).
RECEIVE_QUEUE = 64
HEARTBEAT = 1.0
HEARTBEAT_TIMEOUT = 3.0
# After a lost connection, a new socket this much later.
RECONNECT = 0.1
POLL_MS = 100
# Frames in vLLM's message: topic, sequence number, payload.
FRAMES = 3

# A message's frames, or why the connection was lost.
Item = list[bytes] | str


def endpoint_of(node: Node) -> str | None:
    label = node.labels.get(KV_EVENTS)
    port = None if label is None else whole(label)
    if port is None or not 0 < port < 65536:
        return None
    host = urlsplit(node.url).hostname or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Subscriber:
    """One engine's SUB socket, on a thread of its own."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        self.endpoint = endpoint
        self._inbox: deque[Item] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._context = context
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}")
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Asks the thread to end: within ``POLL_MS``, its socket closed. Not waited for
        here, as the event loop calls this (``join`` waits)."""
        self._stop.set()

    def join(self) -> None:
        self._thread.join(timeout=2)

    def take(self) -> Item | None:
        """The oldest message (or disconnect) waiting, None if none."""
        with self._lock:
            if not self._inbox:
                return None
            item = self._inbox.popleft()
            self._bytes -= _size(item)
            return item

    def _put(self, item: Item) -> None:
        with self._lock:
            inbox = self._inbox
            inbox.append(item)
            self._bytes += _size(item)
            while len(inbox) > INBOX or self._bytes > INBOX_BYTES:
                self._bytes -= _size(inbox.popleft())

    def _run(self) -> None:
        while not self._stop.is_set():
            self._follow()
            self._stop.wait(RECONNECT)

    def _follow(self) -> None:
        """Receive on a socket of its own until the connection is lost (or stop): ZMQ
        connects again by itself after most losses but never after a protocol error (a
        message over ``MAX_MESSAGE``), so every loss gets a new socket."""
        socket = self._context.socket(zmq.SUB)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
            socket.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT * 1000))
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT * 1000))
            socket.connect(self.endpoint)
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if socket in ready:
                    self._put(_frames(socket))
                if monitor in ready:
                    # What arrived before the loss first.
                    while socket.poll(0):
                        self._put(_frames(socket))
                    self._put(f"{self.endpoint}: disconnected")
                    return
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)


def _frames(socket: zmq.Socket[Any]) -> list[bytes]:
    """One message's frames, at most vLLM's three kept: ``MAX_MESSAGE`` bounds each frame,
    not their number (20 frames of 3 MiB were 60 MiB held at once). A message of more is
    kept as its first three and an empty fourth, which ``decode`` refuses (garbage)."""
    frames = [socket.recv()]
    while socket.getsockopt(zmq.RCVMORE):
        frame = socket.recv()
        if len(frames) < FRAMES:
            frames.append(frame)
        elif len(frames) == FRAMES:
            frames.append(b"")
    return frames


def _size(item: Item) -> int:
    return 0 if isinstance(item, str) else sum(len(frame) for frame in item)


async def follow(nodes: list[Node], streams: EventStreams) -> None:
    """Keep a subscriber for every node that publishes, and apply what they receive; runs
    until cancelled. ``nodes`` is the fleet's live list of prefill nodes."""
    context: zmq.Context[Any] = zmq.Context()
    subscribers: dict[int, Subscriber] = {}
    turn = 0
    try:
        while True:
            _reconcile(nodes, streams, subscribers, context)
            # Each tick another subscriber goes first: a flooding one leaves the others
            # their share of the budget.
            order = list(subscribers.items())
            turn = (turn + 1) % max(len(order), 1)
            deadline = time.perf_counter() + BUDGET
            for node_id, subscriber in order[turn:] + order[:turn]:
                while time.perf_counter() < deadline and (item := subscriber.take()) is not None:
                    _apply(streams, node_id, subscriber.endpoint, item)
            streams.settle()
            await sleep_to_tick(TICK if subscribers else IDLE_TICK)
    finally:
        for subscriber in subscribers.values():
            subscriber.stop()
        # The follower ends (the router stops): ZMQ's context ends once every socket is
        # closed, those of subscribers stopped earlier too.
        for subscriber in subscribers.values():
            subscriber.join()
        context.term()


def _apply(streams: EventStreams, node_id: int, endpoint: str, item: Item) -> None:
    if isinstance(item, list):
        try:
            payload = msgpack.unpackb(item[-1], raw=False, strict_map_key=False)
            streams.apply(node_id, decode(item, payload))
            return
        except Exception as exc:
            # Whatever a publisher's bytes make the decoding raise (nested 1,000 levels
            # deep, msgpack reads them and Python's own recursion gives up: a
            # RecursionError) is that engine's garbage: its stream alone is degraded, and
            # the follower goes on for the others.
            kind, message = "garbage", f"{endpoint}: {type(exc).__name__}: {str(exc)[:200]}"
    else:
        kind, message = DISCONNECTED, item
    stream = streams.streams.get(node_id)
    if stream is not None and stream.state != DEGRADED:
        log.warning("KV events of node %d: %s", node_id, message)
    streams.fault(node_id, kind, message)


def _reconcile(
    nodes: list[Node],
    streams: EventStreams,
    subscribers: dict[int, Subscriber],
    context: zmq.Context[Any],
) -> None:
    wanted = {node.id: endpoint for node in nodes if (endpoint := endpoint_of(node))}
    for node_id in [n for n, s in subscribers.items() if wanted.get(n) != s.endpoint]:
        subscribers.pop(node_id).stop()
        streams.drop(node_id)
    for node_id, endpoint in wanted.items():
        if node_id not in subscribers:
            streams.watch(node_id, endpoint)
            subscriber = subscribers[node_id] = Subscriber(context, endpoint)
            subscriber.start()

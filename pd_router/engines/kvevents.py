"""Subscribers to the prefill engines' KV cache events (vLLM's ZMQ publisher).

An engine publishes when its node has the ``kv_events=PORT`` option (static, admin or DNS,
like its HTTP port): the router connects a ZMQ SUB socket to ``tcp://HOST:PORT``, HOST the
host of the node's URL. Each subscriber is a thread that only receives and checks
messages (``fleet/kvevents.py`` says what they mean) into a bounded inbox; the event loop
takes them from there every ``TICK`` seconds and applies them to the fleet's view. So a
flood of events, a stalled engine or a broken message never blocks a request: an inbox
that overflows drops its oldest messages, which shows as a gap in the sequence numbers and
degrades the stream to prediction, as a message that does not parse and a disconnect do.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import anyio
import msgpack  # type: ignore[import-untyped]
import zmq

from pd_router.fleet.kvevents import Batch, EventError, EventStreams, decode
from pd_router.fleet.nodes import KV_EVENTS, Node

log = logging.getLogger("pd_router.kvevents")

TICK = 0.05
# With no node publishing, only the check for one that has started to: a router without
# KV events pays no 50 ms tick (2 ms of CPU a second, measured).
IDLE_TICK = 1.0
# Messages a subscriber holds for the loop; beyond, the oldest go (a gap, then degraded).
INBOX = 4096
POLL_MS = 100

Message = tuple[str, Batch | str]


def endpoint_of(node: Node) -> str | None:
    port = node.labels.get(KV_EVENTS)
    if port is None or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    host = urlsplit(node.url).hostname or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Subscriber:
    """One engine's SUB socket, on a thread of its own."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        self.endpoint = endpoint
        self.inbox: deque[Message] = deque(maxlen=INBOX)
        self._context = context
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}")
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def take(self) -> Iterator[Message]:
        inbox = self.inbox
        while inbox:
            yield inbox.popleft()

    def _run(self) -> None:
        socket = self._context.socket(zmq.SUB)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.endpoint)
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if monitor in ready:
                    monitor.recv_multipart()
                    self.inbox.append(("disconnected", f"{self.endpoint}: disconnected"))
                if socket in ready:
                    self.inbox.append(self._read(socket.recv_multipart()))
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)

    def _read(self, frames: list[bytes]) -> Message:
        try:
            payload = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
            return "batch", decode(frames, payload)
        except (EventError, ValueError, TypeError, msgpack.UnpackException) as exc:
            return "garbage", f"{self.endpoint}: {str(exc)[:200]}"


async def follow(nodes: list[Node], streams: EventStreams) -> None:
    """Keep a subscriber for every node that publishes, and apply what they receive; runs
    until cancelled. ``nodes`` is the fleet's live list of prefill nodes."""
    context: zmq.Context[Any] = zmq.Context()
    subscribers: dict[int, Subscriber] = {}
    try:
        while True:
            _reconcile(nodes, streams, subscribers, context)
            for node_id, subscriber in subscribers.items():
                for kind, item in subscriber.take():
                    if isinstance(item, Batch):
                        streams.apply(node_id, item)
                    else:
                        stream = streams.streams.get(node_id)
                        if stream is not None and stream.state != "degraded":
                            log.warning("KV events of node %d: %s", node_id, item)
                        streams.fault(node_id, kind, item)
            await anyio.sleep(TICK if subscribers else IDLE_TICK)
    finally:
        for subscriber in subscribers.values():
            subscriber.stop()
        context.term()


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

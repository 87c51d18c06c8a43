"""A KV event publisher for the tests that attack the router's event path: vLLM 0.32's wire
format (three frames: topic, 8-byte big-endian sequence number, msgpack ``[ts, [events],
dp_rank]`` with events as maps tagged by ``type``, as ``pd_router/sim/events.py`` sends
them) on a ZMQ PUB socket bound on 127.0.0.1, in a process of its own: a flood then spends
this process's CPU, not the test's (whose clients measure the router) nor the router's.

``python tests/kv_publisher.py PORT`` reads one command a line on stdin and answers each
with ``ok SEQ`` (the sequence number the next batch gets) once it is in effect:

* ``flood SECONDS [BLOCKS]``: as fast as ZMQ sends, for SECONDS, then quiet (ZMQ drops
  what the subscriber does not take: its sequence numbers jump). An engine with a bounded
  cache: each batch stores a new prompt's BLOCKS blocks (default 4, of 16 tokens) and
  removes the oldest beyond ``CACHE`` blocks; four such batches, built before, sent in
  turn.
* ``trickle SECONDS``: such batches of 4 blocks, in order, one every SECONDS, until the
  next command.
* ``quiet``: nothing (still bound and connected).
* ``send JSON``: one batch whose events are the JSON list (hashes as ints, as vLLM's
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` sends them), sent blocking (a subscriber that
  is connected gets it).
* ``huge COUNT``: one BlockStored batch of COUNT blocks (16 token ids each), blocking.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess  # nosec B404
import sys
import threading
import time
from collections import deque
from typing import IO, Any

import msgpack  # type: ignore[import-untyped]
import zmq

TOPIC = b"kv-events"
BLOCK = 16
# Blocks stored per batch of a flood or a trickle, and the cache they are evicted from.
PER_BATCH = 4
CACHE = 2_000


class Engine:
    """What the publisher says: a chain of blocks stored, the oldest evicted."""

    def __init__(self, port: int) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        # What ZMQ queues for a slow subscriber before it drops (vLLM's is larger): a flood
        # of megabyte batches must not take gigabytes here.
        self.socket.setsockopt(zmq.SNDHWM, 64)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.seq = 0
        self.next_hash = 1
        self.held: deque[int] = deque()

    def send(self, events: list[Any], block: bool = False) -> None:
        self.send_payload(msgpack.packb([time.time(), events, None]), block)

    def send_payload(self, payload: bytes, block: bool = False) -> None:
        frames = [TOPIC, self.seq.to_bytes(8, "big"), payload]
        self.seq += 1
        try:
            # Not copied: a flood sends the same few payloads over and over.
            self.socket.send_multipart(frames, flags=0 if block else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # vLLM's publisher drops too

    def step(self, blocks: int = PER_BATCH) -> list[Any]:
        """A scheduling step's events: a new prompt's ``blocks`` blocks stored, the oldest
        evicted beyond CACHE."""
        parent = None
        hashes = list(range(self.next_hash, self.next_hash + blocks))
        self.next_hash += blocks
        self.held.extend(hashes)
        events: list[Any] = [stored(hashes, parent, hashes[0])]
        if len(self.held) > CACHE:
            gone = [self.held.popleft() for _ in range(len(self.held) - CACHE)]
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
        return events


def stored(hashes: list[int], parent: int | None, seed: int, block: int = BLOCK) -> Any:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": [seed + index for index in range(len(hashes) * block)],
        "block_size": block,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def serve(port: int, commands: IO[str]) -> None:
    engine = Engine(port)
    mode, until, every = "quiet", 0.0, 0.0
    ring: list[bytes] = []
    lines: deque[str] = deque()
    arrived = threading.Event()

    def read() -> None:
        for line in commands:
            lines.append(line.strip())
            arrived.set()
        lines.append("exit")
        arrived.set()

    threading.Thread(target=read, daemon=True).start()
    while True:
        while lines:
            verb, _, rest = lines.popleft().partition(" ")
            if verb == "exit":
                return
            if verb == "flood":
                seconds, _, size = rest.partition(" ")
                blocks = int(size or PER_BATCH)
                # Built before: a flood is as fast as ZMQ sends, whatever the batch's size
                # (sent in turn: what each stores, the next ones remove).
                ring = [msgpack.packb([time.time(), engine.step(blocks), None]) for _ in range(4)]
                mode, until = "flood", time.monotonic() + float(seconds)
            elif verb == "trickle":
                mode, every = "trickle", float(rest)
            elif verb == "quiet":
                mode = "quiet"
            elif verb == "send":
                engine.send(json.loads(rest), block=True)
            elif verb == "huge":
                count = int(rest)
                engine.send([stored(list(range(count)), None, 0)], block=True)
            print(f"ok {engine.seq}", flush=True)
        if mode == "flood":
            for _ in range(100):
                engine.send_payload(ring[engine.seq % len(ring)])
            if time.monotonic() > until:
                mode = "quiet"
        elif mode == "trickle":
            engine.send(engine.step(), block=True)
            arrived.wait(every)
            arrived.clear()
        else:
            arrived.wait(1.0)
            arrived.clear()


class PublisherProcess:
    """``tests/kv_publisher.py`` on ``port``, driven from a test; stopped (or killed) by its
    own PID."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.process = subprocess.Popen(  # nosec B603
            [sys.executable, __file__, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def command(self, line: str) -> int:
        """Send one command; the sequence number its effect left next."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer.startswith("ok "), f"the publisher answered {answer!r} to {line[:80]!r}"
        return int(answer.split()[1])

    def send(self, events: list[Any]) -> int:
        return self.command("send " + json.dumps(events))

    def pause(self) -> None:
        """SIGSTOP: alive, bound, and silent, its ZMQ threads too (a hung host)."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crash would: the socket goes with the process."""
        self.process.kill()
        self.process.wait(5)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait(5)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> PublisherProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.stdin)

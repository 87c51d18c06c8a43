"""KV cache events in vLLM's wire format, published on a ZMQ PUB socket.

As vLLM 0.32's ``ZmqEventPublisher`` sends them: three frames, the topic, an 8-byte
big-endian sequence number from 0, and a msgpack payload ``[ts, [event, ...], dp_rank]``
whose events are maps tagged by ``type`` (msgspec ``tag=True``): ``{"type":
"BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
"medium", "lora_name"}``, ``{"type": "BlockRemoved", "block_hashes", "medium"}``,
``{"type": "AllBlocksCleared"}``. The sim's tokens are words: a word's token id is the word
if it is a number, else its CRC-32 (``token_id``, also what ``return_token_ids`` answers).
"""

from __future__ import annotations

import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

from pd_router.sim.tokens import token_id

TOPIC = b"kv-events"
MEDIUM = "GPU"


class Publisher:
    def __init__(self, host: str, port: int, block_size: int) -> None:
        self.block_size = block_size
        self._context: zmq.Context[Any] = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:{port}")
        self._seq = 0

    @property
    def published(self) -> int:
        """Batches sent so far (the next one's sequence number)."""
        return self._seq

    def stored(self, hashes: list[int], all_hashes: list[int], tokens: list[str]) -> list[Any]:
        """A BlockStored event for ``hashes``, the newly stored tail of ``all_hashes``."""
        if not hashes:
            return []
        first = all_hashes.index(hashes[0])
        parent = all_hashes[first - 1] if first else None
        size = self.block_size
        ids = [token_id(t) for t in tokens[first * size : (first + len(hashes)) * size]]
        return [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": ids,
                "block_size": size,
                "lora_id": None,
                "medium": MEDIUM,
                "lora_name": None,
            }
        ]

    @staticmethod
    def removed(hashes: list[int]) -> list[Any]:
        return (
            [{"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}] if hashes else []
        )

    @staticmethod
    def cleared() -> list[Any]:
        return [{"type": "AllBlocksCleared"}]

    def publish(self, events: list[Any]) -> None:
        if not events:
            return
        payload = msgpack.packb([time.time(), events, None])
        frames = [TOPIC, self._seq.to_bytes(8, "big"), payload]
        self._seq += 1
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a PUB socket drops what a slow subscriber does not take, as vLLM's does

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

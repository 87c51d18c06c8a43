"""What the sim tests share: request bodies and a strict reading of streamed answers."""

from __future__ import annotations

import json
from typing import Any

MODEL = "sim-model"


def body_for(prompt: str, chat: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def sse_events(raw: bytes) -> list[Any]:
    """Parsed events, checking vLLM's framing byte for byte; "[DONE]" stays a string."""
    assert raw.endswith(b"\n\n")
    events: list[Any] = []
    for frame in raw[:-2].split(b"\n\n"):
        assert frame.startswith(b"data: ")
        data = frame[len(b"data: ") :]
        if data == b"[DONE]":
            events.append("[DONE]")
            continue
        event = json.loads(data)
        assert json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() == data
        events.append(event)
    return events

"""Requests every workload sends: completion bodies, one stream read to its end, a manual
P/D exchange (what a router does, without one), the client session."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from pd_router.engines.handshake import PREFILL_KV_PARAMS

MODEL = "sim-model"
PATH = "/v1/completions"
DONE = b"data: [DONE]"
# Words after the unique first one, so every prompt is a few KV blocks long.
FILLER = " ".join(f"w{i}" for i in range(40))
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60)


@dataclass
class StreamResult:
    ok: bool
    chunks: int = 0
    error: str = ""
    ttft: float | None = None


def completion_body(prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def has_text(line: bytes) -> bool:
    try:
        event = orjson.loads(line[6:])
    except orjson.JSONDecodeError:
        return False
    choices = event.get("choices") if isinstance(event, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    return bool(choices[0].get("text"))


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    want_ttft: bool = False,
    started: float | None = None,
    timeout: aiohttp.ClientTimeout = REQUEST_TIMEOUT,
    on_event: Callable[[bytes], None] | None = None,
) -> StreamResult:
    """POST a streaming request and read it to the end.

    ``chunks`` counts ``data:`` events before ``[DONE]``; the result is ok only for a 200
    whose stream ended with ``data: [DONE]`` and had ``max_tokens`` chunks. ``ttft`` (with
    ``want_ttft``) runs from ``started`` (default: now) to the first event with text.
    ``on_event`` sees each of those events as it arrives.
    """
    start = time.perf_counter() if started is None else started
    expected = body["max_tokens"]
    ttft: float | None = None
    chunks = 0
    done = False
    try:
        async with session.post(url, json=body, timeout=timeout) as response:
            if response.status != 200:
                await response.read()
                return StreamResult(False, error=f"http_{response.status}")
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(DONE):
                    done = True
                    continue
                chunks += 1
                if on_event is not None:
                    on_event(line)
                if want_ttft and ttft is None and has_text(line):
                    ttft = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError) as exc:
        return StreamResult(False, chunks, error=type(exc).__name__)
    if not done:
        return StreamResult(False, chunks, error="no_done")
    if chunks != expected:
        return StreamResult(False, chunks, error="wrong_chunk_count")
    return StreamResult(True, chunks, ttft=ttft)


async def manual_pd(
    session: aiohttp.ClientSession, prefill_url: str, decode_url: str, body: dict[str, Any]
) -> tuple[StreamResult, float]:
    """Prefill, then decode with the prefill's kv_transfer_params: the router's job by hand.

    Returns the decode stream's result (TTFT measured from before the prefill request) and
    how long the prefill request took.
    """
    start = time.perf_counter()
    prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
    try:
        async with session.post(
            prefill_url + PATH, json=prefill, timeout=REQUEST_TIMEOUT
        ) as response:
            raw = await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return StreamResult(False, error=f"prefill_{type(exc).__name__}"), 0.0
    prefill_time = time.perf_counter() - start
    if status != 200:
        return StreamResult(False, error=f"prefill_http_{status}"), prefill_time
    params = orjson.loads(raw).get("kv_transfer_params")
    decode = {**body, "kv_transfer_params": params}
    result = await stream_completion(
        session, decode_url + PATH, decode, want_ttft=True, started=start
    )
    return result, prefill_time


def new_session() -> aiohttp.ClientSession:
    # limit=0: no client-side cap on connections; keep-alive is aiohttp's default.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

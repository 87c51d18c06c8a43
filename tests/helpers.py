"""Real servers for the end-to-end tests: the router as its CLI runs it, raw clients, polling."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anyio
import httpx
import openai
from openai.types.chat import ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from pd_router.shared.redis import Redis, parse_url
from pd_router.sim import fleet

# Probes that find a node down, and back, within about a second.
FAST_HEALTH = ("--health-interval", "0.2", "--unhealthy-after", "2", "--healthy-after", "2")


class RouterProcess(fleet.RouterProcess):
    """The router as its CLI runs it, with what the tests read from it."""

    def metrics(self) -> dict[str, float]:
        url = f"{self.url}/metrics"
        with urllib.request.urlopen(url, timeout=5, context=self.tls) as response:  # nosec B310
            text = response.read().decode()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values

    def in_use(self) -> float:
        return sum(
            v for k, v in self.metrics().items() if k.startswith("pd_router_node_slots_in_use")
        )

    def assert_idle(self) -> None:
        """No slot held, nobody queued, and every reservation released exactly once."""
        wait_for(lambda: self.in_use() == 0, what="all decode slots free")
        # A waiter that left is out of the queue once its router heard back (with --state,
        # a round trip to Redis after its client went).
        wait_for(lambda: self.metrics()["pd_router_queue_depth"] == 0, what="nobody queued")
        metrics = self.metrics()
        assert (
            metrics["pd_router_slot_acquisitions_total"] == metrics["pd_router_slot_releases_total"]
        )


# What a wait allows by default: it returns as soon as the state is there, and this machine
# (two cores, shared) has stood still for tens of seconds.
WAIT = 60.0


def admin_router(sims: fleet.SimFleet, token: str, *args: str) -> RouterProcess:
    """A router over every engine of ``sims``, /admin/* behind ``token``, probing fast."""
    return RouterProcess(
        [e.url for e in sims.prefill],
        [e.url for e in sims.decode],
        "--admin-token",
        token,
        *FAST_HEALTH,
        *args,
    )


def wait_for(check: Callable[[], bool], *, timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def complete(router: RouterProcess, prompt: str, tokens: int = 2) -> httpx.Response:
    """A plain (not streamed) completion through the router, answered or not."""
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": tokens}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)


def streamed_text(stream: Iterable[ChatCompletionChunk]) -> str:
    """The text an openai SDK chat stream brought, its chunks joined."""
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def assert_sdk_served(client: openai.OpenAI, prompt: str, message: str) -> None:
    """The openai SDK gets a completion (the sims echo the prompt) and a chat stream."""
    answer = client.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
    assert answer.choices[0].text == f" {prompt}"
    stream = client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": message}],
        max_tokens=2,
        stream=True,
    )
    assert streamed_text(stream)


class RawClient:
    """An HTTP/1.1 client that can hang up at any byte: what a vanishing user looks like."""

    def __init__(
        self, url: str, path: str, body: dict[str, Any], headers: Sequence[str] = ()
    ) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        payload = json.dumps(body).encode()
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {host}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            *headers,
        ]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        self.received = b""

    def read_until(self, marker: bytes, timeout: float = 60.0, count: int = 1) -> bytes:
        """What arrived by the time ``marker`` was seen ``count`` times (or the end)."""
        self.sock.settimeout(timeout)
        while self.received.count(marker) < count:
            data = self.sock.recv(65536)
            if not data:
                break
            self.received += data
        return self.received

    def read_all(self, timeout: float = 10.0) -> bytes:
        """Up to the end of a chunked response (or the connection's end)."""
        return self.read_until(b"\r\n0\r\n\r\n", timeout)

    def hang_up(self) -> None:
        self.sock.close()


def _redis(state_url: str, *command: str) -> Any:
    async def call() -> Any:
        async with Redis(parse_url(state_url), timeout=2.0) as redis:
            return await redis.call(*command)

    return anyio.run(call)


def flush_state(state_url: str) -> None:
    """Empty the store: the routers started next are a new deployment. (The fleet kept
    there outlives every router, slots included, so a test's flags would not count.)"""
    _redis(state_url, "FLUSHALL")


def slots_in_use(state_url: str) -> int:
    """Decode slots the routers sharing ``state_url`` (``--state``) hold, by Redis's count."""
    return sum(int(value) for value in _redis(state_url, "HVALS", "{pdr}:used"))


def queued(state_url: str) -> int:
    """Requests waiting for a slot on any router sharing ``state_url``, by Redis's queues
    (one per model)."""
    models = _redis(state_url, "SMEMBERS", "{pdr}:queues")
    return sum(int(_redis(state_url, "ZCARD", f"{{pdr}}:queue:{m.decode()}")) for m in models)


class Forwarder:
    """A TCP port on 127.0.0.1 that forwards every connection to ``port``: another address of
    the same server, as a Service or a load balancer in front of it would be."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=30)
            except OSError:
                return  # closed
            self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        source.close()

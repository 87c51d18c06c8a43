"""What two engine-side edges cost the router and the engines (issue 18, items 3 and 5).

    python benchmarks/engine_edges.py [--callers 300] [--models-delay 4] [--head-mib 64]

1. ``GET /v1/models`` from ``--callers`` clients at once, against a decode engine whose
   ``/v1/models`` answers after ``--models-delay`` seconds: how many times the engine was
   asked, the most connections the router held to it at once, and what the callers got.
2. A decode engine that sends a ``--head-mib`` MiB header line (then a correct answer):
   what the client got and when, and the slowest ``GET /health`` another client saw
   meanwhile (how long the router's event loop was held).

It starts, on 127.0.0.1, a simulated prefill engine, the scripted decode engine (in a
thread of its own, counting connections) and ``python -m pd_router`` in front of them;
run it with ``PYTHONPATH`` pointing at another checkout to measure that one. It prints
numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from pd_router.sim.fleet import RouterProcess, SimFleet

HOST = "127.0.0.1"
MODELS = json.dumps(
    {"object": "list", "data": [{"id": "sim-model", "object": "model", "owned_by": "bench"}]}
).encode()
ANSWER = json.dumps(
    {
        "object": "text_completion",
        "model": "sim-model",
        "choices": [{"index": 0, "text": " fine", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }
).encode()


class ScriptedEngine:
    """A decode engine: a slow ``/v1/models``, and a huge head on request; counts what the
    router costs it."""

    def __init__(self, models_delay: float, head_bytes: int) -> None:
        self.models_delay = models_delay
        self.head_bytes = head_bytes
        self.huge_head = False
        self.models_hits = 0
        self.connections = 0
        self.open = 0
        self.peak_open = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10), "the scripted engine did not start"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def reset_peak(self) -> None:
        self.peak_open = self.open

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, HOST, 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = next(
                    (int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length")),
                    0,
                )
                await reader.readexactly(length)
                await self._answer(lines[0], writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def _answer(self, line: str, writer: asyncio.StreamWriter) -> None:
        if line.startswith("GET /v1/models"):
            self.models_hits += 1
            await asyncio.sleep(self.models_delay)
            body = MODELS
        elif line.startswith("GET "):
            body = b"{}"
        else:
            body = ANSWER
            if self.huge_head:
                writer.write(b"HTTP/1.1 200 OK\r\nx-huge: ")
                piece = b"x" * (1 << 20)
                for _ in range(self.head_bytes >> 20):
                    writer.write(piece)
                    await writer.drain()
                writer.write(b"\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
        writer.write(b"content-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()


def models_burst(router: RouterProcess, engine: ScriptedEngine, callers: int) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(f"{router.url}/v1/models", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the router never listed a model"
        time.sleep(0.2)
    hits, connections = engine.models_hits, engine.connections
    engine.reset_peak()
    limits = httpx.Limits(max_connections=callers)
    with httpx.Client(timeout=120, limits=limits) as client:

        def call(_: int) -> tuple[int, float]:
            started = time.perf_counter()
            status = client.get(f"{router.url}/v1/models").status_code
            return status, time.perf_counter() - started

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=callers) as pool:
            answers = list(pool.map(call, range(callers)))
        elapsed = time.perf_counter() - started
    statuses: dict[int, int] = {}
    for status, _ in answers:
        statuses[status] = statuses.get(status, 0) + 1
    slowest = max(seconds for _, seconds in answers)
    print(
        f"/v1/models x {callers} callers at once (engine answers it in "
        f"{engine.models_delay:g} s): statuses {statuses}, slowest {slowest:.2f} s, "
        f"all in {elapsed:.2f} s; the engine was asked {engine.models_hits - hits} times, "
        f"{engine.connections - connections} new router connections, "
        f"at most {engine.peak_open} open at once",
        flush=True,
    )


def huge_head(router: RouterProcess, engine: ScriptedEngine) -> None:
    slowest = 0.0
    polls = 0
    stop = threading.Event()

    def poll() -> None:
        nonlocal slowest, polls
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.get(f"{router.url}/health")
                slowest = max(slowest, time.perf_counter() - started)
                polls += 1
                time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.5)
    engine.huge_head = True
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 1}
    started = time.perf_counter()
    response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
    elapsed = time.perf_counter() - started
    engine.huge_head = False
    time.sleep(0.5)
    stop.set()
    poller.join(30)
    print(
        f"decode engine head of {engine.head_bytes >> 20} MiB: answered {response.status_code} "
        f"after {elapsed:.2f} s ({response.text[:160]}); slowest /health meanwhile "
        f"{slowest * 1000:.0f} ms over {polls} polls",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", type=int, default=300)
    parser.add_argument("--models-delay", type=float, default=4.0)
    parser.add_argument("--head-mib", type=int, default=64)
    args = parser.parse_args()
    engine = ScriptedEngine(args.models_delay, args.head_mib << 20)
    engine.start()
    try:
        with SimFleet(prefill=1, decode=0) as fleet:
            argv = ["--decode-slots", "8", "--read-timeout", "60"]
            with RouterProcess([fleet.prefill[0].url], [engine.url], *argv) as router:
                models_burst(router, engine, args.callers)
                huge_head(router, engine)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()

"""Redis client benchmark: the CPU one ``Redis.call`` round trip costs this process.

Starts a redis-server on 127.0.0.1 (``tests/redis_server.py``), then times ``GET`` of a
small key, one call at a time (the latency path) and from 16 tasks at once (the pool
under load), on asyncio, asyncio with uvloop (what uvicorn runs the router on) and trio.
Two baselines: the least any asyncio client can do (one ``asyncio.Protocol`` writing the
same bytes and waiting for the reply's length, with no parsing, pool, timeout or checks),
and what ``Redis.call`` is built on, alone (an anyio stream and ``resp.Parser``).

CPU is this process's (user + system) per call; the server's own is shown apart. Wall is
the elapsed time per call (with 16 tasks, the inverse of the throughput). Client and
server share the machine's cores, so compare numbers within one run. It asserts nothing.

    python benchmarks/redis_client_bench.py [--calls N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from pd_router.shared import resp
from pd_router.shared.redis import Redis, Settings

CONCURRENCY = 16

Run = Callable[[int, int], Awaitable[None]]  # (port, calls)


def server_cpu(pid: int) -> float:
    """Seconds of CPU the process used so far (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime: clock ticks (100/s)


async def set_key(port: int) -> None:
    async with Redis(Settings("127.0.0.1", port), timeout=5) as redis:
        await redis.call("SET", "bench:key", "value")


async def client_sequential(port: int, calls: int) -> None:
    async with Redis(Settings("127.0.0.1", port), timeout=5) as redis:
        for _ in range(calls):
            await redis.call("GET", "bench:key")


async def client_concurrent(port: int, calls: int) -> None:
    async with Redis(Settings("127.0.0.1", port), timeout=5) as redis:

        async def worker() -> None:
            for _ in range(calls // CONCURRENCY):
                await redis.call("GET", "bench:key")

        async with anyio.create_task_group() as group:
            for _ in range(CONCURRENCY):
                group.start_soon(worker)


async def bare_stream(port: int, calls: int) -> None:
    """What ``Redis.call`` is built on, alone: an anyio stream and the parser."""
    command = resp.encode("GET", "bench:key")
    parser = resp.Parser()
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        for _ in range(calls):
            await stream.send(command)
            while parser.next_reply() is resp.NEED_DATA:
                parser.feed(await stream.receive())


class RawProtocol(asyncio.Protocol):
    """Knows the reply's length in advance: the floor, not a client."""

    def __init__(self, reply_size: int) -> None:
        self.reply_size = reply_size
        self.received = 0
        self.waiter: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.received >= self.reply_size and self.waiter is not None:
            self.received = 0
            self.waiter.set_result(None)


async def raw_asyncio(port: int, calls: int) -> None:
    loop = asyncio.get_running_loop()
    command = resp.encode("GET", "bench:key")
    reply_size = len(b"$5\r\nvalue\r\n")
    transport, protocol = await loop.create_connection(
        lambda: RawProtocol(reply_size), "127.0.0.1", port
    )
    for _ in range(calls):
        protocol.waiter = loop.create_future()
        transport.write(command)
        await protocol.waiter
    transport.close()


def measure(run: Run, backend: str, port: int, calls: int, pid: int) -> tuple[float, float, float]:
    """(wall, client CPU, server CPU) microseconds per call."""
    options = {"use_uvloop": True} if backend == "uvloop" else {}
    name = "asyncio" if backend == "uvloop" else backend
    cpu, wall, server = time.process_time(), time.perf_counter(), server_cpu(pid)
    anyio.run(run, port, calls, backend=name, backend_options=options)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    server = server_cpu(pid) - server
    return wall / calls * 1e6, cpu / calls * 1e6, server / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each; median")
    options = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.redis_server import RedisServer

    cases: list[tuple[str, Run, str]] = [
        ("raw asyncio Protocol, sequential", raw_asyncio, "asyncio"),
        ("anyio stream + parser, asyncio, sequential", bare_stream, "asyncio"),
        ("anyio stream + parser, uvloop, sequential", bare_stream, "uvloop"),
        ("anyio stream + parser, trio, sequential", bare_stream, "trio"),
        ("Redis.call, asyncio, sequential", client_sequential, "asyncio"),
        ("Redis.call, uvloop, sequential", client_sequential, "uvloop"),
        ("Redis.call, trio, sequential", client_sequential, "trio"),
        (f"Redis.call, asyncio, {CONCURRENCY} tasks", client_concurrent, "asyncio"),
        (f"Redis.call, uvloop, {CONCURRENCY} tasks", client_concurrent, "uvloop"),
        (f"Redis.call, trio, {CONCURRENCY} tasks", client_concurrent, "trio"),
    ]
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _, _ in cases}
    with RedisServer() as server:
        anyio.run(set_key, server.port)
        for _ in range(options.rounds):
            for name, run, backend in cases:
                results[name].append(measure(run, backend, server.port, options.calls, server.pid))
    print(f"{options.calls} GET calls per measurement, median of {options.rounds}; µs per call")
    print(f"{'':44} {'wall':>8} {'client CPU':>11} {'server CPU':>11}")
    for name, samples in results.items():
        wall, cpu, server_us = (statistics.median(column) for column in zip(*samples))
        print(f"{name:44} {wall:8.1f} {cpu:11.1f} {server_us:11.1f}")


if __name__ == "__main__":
    main()

"""Router CPU per request against the floor: how much of pd-router's cost is Python's and
uvicorn's, and how much its own work.

    python benchmarks/floor_bench.py              # ~2 min
    python benchmarks/floor_bench.py --rounds 6

One set of simulated engines (1 prefill, 2 instant decode engines, as in
``stream_bench.py``), and in front of them, side by side: pd-router (``--decode-slots 64``,
every default on), vllm-router 0.1.17 (if found; see ``stream_bench.py``), and the two
floors of ``floor_proxy.py``: a P/D proxy doing nothing but the two engine requests and the
answer's bytes, on asyncio protocols alone, and the same as an ASGI app under uvicorn. Two
loads, each alternating between the four round by round so that the machine's noise falls on
all alike: one client sending ``--requests-1`` sequential streams of 16 tokens, and 64
clients sending ``--requests-64`` streams of 64 tokens. Prints each server's CPU
milliseconds per request (utime + stime from /proc) and its ratio to vllm-router's, and what
issue 22's target (0.8x vllm-router's) leaves for pd-router's own work above the uvicorn
floor. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.compare_commits import load  # noqa: E402
from benchmarks.processes import VllmRouterProcess, cpu_ms, find_vllm_router  # noqa: E402
from pd_router.sim.fleet import RouterProcess, ServerProcess, SimFleet  # noqa: E402

TARGET = 0.8


class FloorProcess(ServerProcess):
    """``floor_proxy.py`` with one of its fronts."""

    def __init__(self, front: str, prefill: str, decode: Sequence[str]) -> None:
        super().__init__()
        self.name = f"{front} floor"
        self.front = front
        self.engines = [prefill, ",".join(decode)]

    def command(self) -> list[str]:
        script = str(Path(__file__).with_name("floor_proxy.py"))
        argv = [sys.executable, script, "--front", self.front, *self.engines]
        return [*argv, str(self.port)]


async def measure(
    servers: dict[str, ServerProcess], requests: int, clients: int, tokens: int, rounds: int
) -> dict[str, float]:
    """Each server's CPU ms per request, the load alternating between them round by round."""
    for server in servers.values():
        await load(server.url, 2 * clients, clients, tokens, "warm")
    used = dict.fromkeys(servers, 0.0)
    for round_ in range(rounds):
        order = list(servers.items())
        for name, server in order if round_ % 2 == 0 else order[::-1]:
            assert server.pid is not None  # nosec B101
            before = cpu_ms(server.pid)
            failed = await load(server.url, requests, clients, tokens, f"{name}-{round_}")
            used[name] += cpu_ms(server.pid) - before
            if failed:
                print(f"  {name}: {failed} of {requests} streams failed in round {round_}")
    return {name: ms / (requests * rounds) for name, ms in used.items()}


def report(title: str, per_request: dict[str, float]) -> None:
    print(title)
    rust = per_request.get("vllm-router")
    for name, ms in per_request.items():
        ratio = f"  {ms / rust:.2f}x vllm-router's" if rust else ""
        print(f"  {name:<14} {ms:.3f} ms router CPU per request{ratio}")
    if rust:
        room = TARGET * rust - per_request["uvicorn floor"]
        used = per_request["pd-router"] - per_request["uvicorn floor"]
        print(
            f"  {TARGET}x vllm-router's ({TARGET * rust:.3f} ms) minus the uvicorn floor:"
            f" {1000 * room:+.0f} us per request; pd-router minus the uvicorn floor:"
            f" {1000 * used:+.0f} us"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests-1", type=int, default=1000, help="per server per round")
    parser.add_argument("--requests-64", type=int, default=2000, help="per server per round")
    parser.add_argument("--vllm-router", help="its executable (default: found as stream_bench)")
    args = parser.parse_args(argv)
    executable = args.vllm_router or find_vllm_router()
    decode_args = ["--standalone", "--slots", "256", "--ttft", "0", "--itl", "0"]
    with SimFleet(prefill=1, decode=2, decode_args=decode_args) as fleet:
        prefill = fleet.prefill[0].url
        decode = [engine.url for engine in fleet.decode]
        servers: dict[str, ServerProcess] = {
            "pd-router": RouterProcess([prefill], decode, "--decode-slots", "64"),
            "asyncio floor": FloorProcess("asyncio", prefill, decode),
            "uvicorn floor": FloorProcess("uvicorn", prefill, decode),
        }
        if executable:
            servers["vllm-router"] = VllmRouterProcess(executable, [prefill], decode)
        else:
            print("vllm-router not found: its column is left out")
        started: list[ServerProcess] = []
        try:
            for server in servers.values():
                started.append(server.start())
            for server in started:
                server.wait_healthy()
            print(f"load average at start: {os.getloadavg()[0]:.1f}")
            one = asyncio.run(measure(servers, args.requests_1, 1, 16, args.rounds))
            report(f"1 client, {args.requests_1} x {args.rounds} streams of 16 tokens:", one)
            many = asyncio.run(measure(servers, args.requests_64, 64, 64, args.rounds))
            report(f"64 clients, {args.requests_64} x {args.rounds} streams of 64 tokens:", many)
        finally:
            for server in started:
                server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``--workers 2`` against ``--workers 1``: requests per second and router CPU per request.

    python benchmarks/workers_bench.py              # 6 rounds of 3000 streams per router
    python benchmarks/workers_bench.py --rounds 2 --requests 1000

One set of instant simulated engines (1 prefill, 2 decode) and one redis-server serve two
routers, both with ``--state``: one with a single worker, one with two. Load (streaming
/v1/completions, 64 clients, 64 tokens) alternates between them round by round, so
machine noise falls on both alike. Router CPU counts the parent and its workers
(utime+stime from /proc). On a 2-core machine the engines and this load generator share
the cores with the routers: read the ratio, not the absolute numbers. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.compare_commits import load  # noqa: E402
from benchmarks.processes import cpu_ms  # noqa: E402
from benchmarks.state_cost import DECODE_ARGS  # noqa: E402
from pd_router.sim.fleet import RouterProcess, SimFleet  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


def tree_cpu_ms(pid: int) -> float:
    """utime + stime of ``pid`` and of its children (the workers), in milliseconds."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return cpu_ms(pid) + sum(cpu_ms(int(child)) for child in children)


async def measure(routers: dict[str, RouterProcess], args: argparse.Namespace) -> None:
    for router in routers.values():
        await load(router.url, 2 * args.concurrency, args.concurrency, args.tokens, "warm")
    seconds = dict.fromkeys(routers, 0.0)
    cpu = dict.fromkeys(routers, 0.0)
    errors = dict.fromkeys(routers, 0)
    for round_ in range(args.rounds):
        order = list(routers.items()) if round_ % 2 == 0 else list(routers.items())[::-1]
        for label, router in order:
            assert router.pid is not None  # nosec B101
            before, started = tree_cpu_ms(router.pid), time.perf_counter()
            errors[label] += await load(
                router.url, args.requests, args.concurrency, args.tokens, f"{label}-{round_}"
            )
            seconds[label] += time.perf_counter() - started
            cpu[label] += tree_cpu_ms(router.pid) - before
            rate = args.requests / (time.perf_counter() - started)
            print(f"  round {round_ + 1} {label}: {rate:7.1f} requests/s", flush=True)
    total = args.rounds * args.requests
    print(f"\n{'':12}{'requests/s':>12}{'router CPU ms/request':>24}{'errors':>8}")
    for label in routers:
        row = f"{label:12}{total / seconds[label]:12.1f}{cpu[label] / total:24.3f}"
        print(f"{row}{errors[label]:8d}")
    one, two = (total / seconds[label] for label in routers)
    print(f"\n--workers 2 / --workers 1 throughput: {two / one:.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=3000, help="streams per router a round")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(SimFleet(prefill=1, decode=2, decode_args=DECODE_ARGS))
        redis = stack.enter_context(RedisServer())
        engines = ([fleet.prefill[0].url], [engine.url for engine in fleet.decode])
        common = ("--decode-slots", "1024", "--state", redis.url)
        routers = {
            f"--workers {n}": stack.enter_context(
                RouterProcess(*engines, *common, "--workers", str(n))
            )
            for n in (1, 2)
        }
        asyncio.run(measure(routers, args))


if __name__ == "__main__":
    main()

"""What client keys (``--api-keys-file``) cost per request.

    python benchmarks/keys_cost.py                # about 2 min
    python benchmarks/keys_cost.py --quick        # about 40 s

1. The check alone (``edge/auth.py``: one SHA-256 and one dictionary lookup), timed with
   ``timeit`` against files of 1, 100 and 10,000 keys, and a per-key limit's count
   (``fleet/keys.py``, in-process).
2. The same load through four routers in one run, on the same simulated engines (1
   prefill, 2 instant decode): two without a key file (their difference is the run's
   noise), one with a key file, and one with a file whose key has a ``max_in_flight``.
   Every client sends the same ``Authorization`` header to each. Load (streaming
   /v1/completions, 64 clients) alternates between the routers round by round, so the
   machine's noise falls on all alike. Prints router CPU ms per request; asserts
   nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import timeit
from collections.abc import Sequence
from pathlib import Path

import aiohttp

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.processes import cpu_ms, running  # noqa: E402
from benchmarks.workloads.requests import FILLER, completion_body, stream_completion  # noqa: E402
from pd_router.edge.auth import parse  # noqa: E402
from pd_router.fleet.keys import KeyLimits  # noqa: E402
from pd_router.sim.fleet import RouterProcess, SimFleet  # noqa: E402

KEY = "sk-bench-0123456789abcdef0123456789abcdef"
HEADER = f"Bearer {KEY}"


def key_file(count: int, limit: str = "") -> str:
    """``count`` keys, the one the clients send last of them."""
    lines = [
        f"k{i} sha256:{hashlib.sha256(f'other-{i}'.encode()).hexdigest()}" for i in range(count - 1)
    ]
    lines.append(f"bench {KEY} {limit}".strip())
    return "\n".join(lines) + "\n"


def check_costs(number: int) -> None:
    header = HEADER.encode()
    for count in (1, 100, 10_000):
        keys = parse(key_file(count))
        best = min(timeit.repeat(lambda: keys.check(header), number=number, repeat=5))
        print(f"check, {count:>6} keys in the file: {best / number * 1e6:.3f} us per request")
    limits = KeyLimits()

    async def enter_leave() -> None:
        for _ in range(number):
            await limits.enter("bench", 1000)
            limits.leave("bench")

    loop = asyncio.new_event_loop()
    try:
        best = min(
            timeit.repeat(lambda: loop.run_until_complete(enter_leave()), number=1, repeat=5)
        )
    finally:
        loop.close()
    print(f"max_in_flight count (enter + leave), in-process: {best / number * 1e6:.3f} us")


async def load(url: str, requests: int, concurrency: int, tokens: int, tag: str) -> int:
    """Send ``requests`` streams through ``url``; returns how many failed."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": HEADER}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def one(index: int) -> bool:
            async with gate:
                body = completion_body(f"{tag}-{index} {FILLER}", tokens)
                return (await stream_completion(session, url + "/v1/completions", body)).ok

        results = await asyncio.gather(*(one(index) for index in range(requests)))
    return results.count(False)


async def compare(routers: dict[str, RouterProcess], args: argparse.Namespace) -> None:
    for router in routers.values():
        await load(router.url, 2 * args.concurrency, args.concurrency, args.tokens, "warm")
    used = dict.fromkeys(routers, 0.0)
    errors = dict.fromkeys(routers, 0)
    for round_ in range(args.rounds):
        order = list(routers.items())
        if round_ % 2:
            order.reverse()
        for label, router in order:
            assert router.pid is not None  # nosec B101
            before = cpu_ms(router.pid)
            tag = f"{label}-{round_}"
            failed = await load(router.url, args.requests, args.concurrency, args.tokens, tag)
            errors[label] += failed
            used[label] += cpu_ms(router.pid) - before
    sent = args.requests * args.rounds
    base = used["no key file"] / sent
    for label in routers:
        per_request = used[label] / sent
        print(f"{label:>28}: {per_request:.3f} ms router CPU per request "
              f"({per_request - base:+.3f}), errors={errors[label]}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 500")
    parser.add_argument("--requests", type=int, default=2000, help="per router per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens per stream")
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 500, 2
    check_costs(20_000)
    with tempfile.TemporaryDirectory(prefix="pd-router-keys-") as tmp:
        plain = Path(tmp) / "keys"
        plain.write_text(key_file(100))
        limited = Path(tmp) / "limited"
        limited.write_text(key_file(100, "max_in_flight=1000"))
        decode_args = ["--standalone", "--slots", "256", "--ttft", "0", "--itl", "0"]
        with SimFleet(prefill=1, decode=2, decode_args=decode_args) as fleet:
            prefill = [engine.url for engine in fleet.prefill]
            decode = [engine.url for engine in fleet.decode]
            flags = {
                "no key file": [],
                # The same router twice: the difference between the two is the run's noise.
                "no key file, again": [],
                "--api-keys-file (100 keys)": ["--api-keys-file", str(plain)],
                "... and max_in_flight": ["--api-keys-file", str(limited)],
            }
            routers = {
                label: RouterProcess(prefill, decode, "--decode-slots", "64", *extra)
                for label, extra in flags.items()
            }
            with running(routers.values()):
                asyncio.run(compare(routers, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Router CPU per request of two (or more) commits, side by side on the same engines.

    python benchmarks/compare_commits.py c5cc867 .      # a past commit against the work tree
    python benchmarks/compare_commits.py A B --tokens 1 --rounds 6
    python benchmarks/compare_commits.py main . --kv-events --words 400   # cost + KV events

Each revision (``.`` is the working tree) is checked out into a temporary git worktree and
its router started from there; one set of simulated engines (1 prefill, 2 instant decode)
serves them all. Load (streaming /v1/completions, 64 clients) alternates between the
routers round by round, so machine noise falls on all of them alike. Prints router CPU
milliseconds per request (utime+stime from /proc) and errors; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.processes import checkouts, cpu_ms, running  # noqa: E402
from benchmarks.workloads.requests import completion_body, stream_completion  # noqa: E402
from pd_router.sim.fleet import RouterProcess, SimFleet, free_port  # noqa: E402

FILLER = " ".join(f"w{i}" for i in range(40))


class RevisionRouter(RouterProcess):
    """The router of one checkout, started from its own source tree."""

    def __init__(
        self, label: str, source: Path, *args: Any, env: dict[str, str] | None = None
    ) -> None:
        super().__init__(*args, env=env)
        self.label = label
        self.source = source

    def command(self) -> list[str]:
        code = (
            "import sys; sys.path.insert(0, sys.argv.pop(1)); "
            "from pd_router.cli import main; main()"
        )
        argv = [sys.executable, "-c", code, str(self.source)]
        return [*argv, "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]


async def load(
    url: str, requests: int, concurrency: int, tokens: int, tag: str, filler: str = FILLER
) -> int:
    """Send ``requests`` streams through ``url``; returns how many failed."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(index: int) -> bool:
            async with gate:
                body = completion_body(f"{tag}-{index} {filler}", tokens)
                return (await stream_completion(session, url + "/v1/completions", body)).ok

        results = await asyncio.gather(*(one(index) for index in range(requests)))
    return results.count(False)


async def compare(routers: list[RevisionRouter], args: argparse.Namespace) -> None:
    filler = " ".join(f"w{i}" for i in range(args.words))
    for router in routers:
        await load(router.url, 2 * args.concurrency, args.concurrency, args.tokens, "warm", filler)
    used = {router.label: 0.0 for router in routers}
    errors = {router.label: 0 for router in routers}
    for round_ in range(args.rounds):
        order = routers if round_ % 2 == 0 else routers[::-1]
        for router in order:
            assert router.pid is not None  # nosec B101
            before = cpu_ms(router.pid)
            tag = f"{router.label}-{round_}"
            errors[router.label] += await load(
                router.url, args.requests, args.concurrency, args.tokens, tag, filler
            )
            used[router.label] += cpu_ms(router.pid) - before
    sent = args.requests * args.rounds
    for router in routers:
        per_request = used[router.label] / sent
        print(f"{router.label:>14}: {per_request:.3f} ms router CPU per request, "
              f"errors={errors[router.label]}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revisions", nargs="+", help="git revisions; . is the working tree")
    parser.add_argument("--requests", type=int, default=2000, help="per router per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per stream")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--words", type=int, default=40, help="words (tokens) per prompt")
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="the prefill engine publishes KV events, the routers follow them (--prefill-policy"
        " cost)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pd-router-compare-") as tmp:
        with checkouts(args.revisions, Path(tmp)) as sources:
            decode_args = ["--standalone", "--slots", "256", "--ttft", "0", "--itl", "0"]
            port = free_port()
            prefill_args = ["--kv-events-port", str(port)] if args.kv_events else []
            policy = ["--prefill-policy", "cost"] if args.kv_events else []
            with SimFleet(
                prefill=1, decode=2, prefill_args=prefill_args, decode_args=decode_args
            ) as fleet:
                events = f",kv_events={port}" if args.kv_events else ""
                prefill = [engine.url + events for engine in fleet.prefill]
                decode = [engine.url for engine in fleet.decode]
                routers = [
                    RevisionRouter(f"{index}:{revision}", source, prefill, decode,
                                   "--decode-slots", "64", *policy)  # fmt: skip
                    for index, (revision, source) in enumerate(zip(args.revisions, sources))
                ]
                with running(routers):
                    asyncio.run(compare(routers, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

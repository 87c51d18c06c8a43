"""The relay's own CPU per request, in-process: no sockets, no server, scripted engines.

    python benchmarks/relay_micro.py main .          # a commit against the work tree
    python benchmarks/relay_micro.py main . --rounds 10 --requests 20000

What a change to the request path costs, without the kernel, uvicorn and the engines that
make the whole-router numbers (``compare_commits.py``) move by a few percent from run to
run. Each revision (``.``: the working tree) is checked out into a temporary git worktree;
each round runs every revision's relay in a fresh process, in alternating order: the same
requests (one streamed, 16 events, and one not, in turn) through ``Relay`` against
engines that answer from memory, timed with ``process_time``. Prints microseconds per
request: the median over rounds, and the least (other load only ever adds). Asserts
nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess  # nosec B404
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.processes import checkouts  # noqa: E402

# Run in a fresh interpreter with the revision's tree first on sys.path: argv[1] the tree,
# argv[2] the requests. Only the relay's public entry points, which every revision has;
# ``post`` takes whatever a revision passes after the request id (``via``, headers).
WORKER = r"""
import asyncio, sys, time
sys.path.insert(0, sys.argv[1])
import orjson
from pd_router.fleet.nodes import Node
from pd_router.fleet.registry import Fleet
from pd_router.relay import Relay, Router

PREFILL = orjson.dumps({"kv_transfer_params": {"remote_engine_id": "p"},
                        "usage": {"prompt_tokens_details": {"cached_tokens": 0}}})
EVENT = b'data: {"id":"c","choices":[{"index":0,"text":" w"}]}\n\n'
STREAM = EVENT * 16 + b"data: [DONE]\n\n"
ANSWER = orjson.dumps({"choices": [{"text": " w" * 16}], "usage": {"prompt_tokens": 2}})

class Answer:
    status = 200
    def __init__(self, url, body):
        self.url, self._body = url, body
    def close(self):
        pass
    async def read(self):
        body, self._body = self._body, b""
        return body
    async def next_chunk(self):
        chunk, self._body = self._body[:len(EVENT) * 4], self._body[len(EVENT) * 4:]
        return chunk

class Engines:
    async def post(self, url, body, request_id, *args, **kwargs):
        if url.startswith("http://prefill"):
            return Answer(url, PREFILL)
        return Answer(url, STREAM if body.get("stream") else ANSWER)

class Client:
    def __init__(self):
        self.done = asyncio.Event()
        self.status = 0
    async def receive(self):
        await self.done.wait()
        return {"type": "http.disconnect"}
    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.done.set()

async def main(requests):
    fleet = Fleet([Node(id=0, url="http://prefill", slots=1, role="prefill")],
                  [Node(id=1, url="http://decode", slots=64)])
    router = Router(fleet=fleet, upstream=Engines())
    body = {"model": "m", "prompt": "hello there", "max_tokens": 16}
    async def one(index):
        client = Client()
        await Relay(router, "completions", {**body, "stream": index % 2 == 0}, f"r{index}")(
            {}, client.receive, client.send)
        if client.status != 200:  # an error's path is not what is measured
            raise SystemExit(f"request {index} answered {client.status}")
    for index in range(2000):
        await one(index)
    start = time.process_time()
    for index in range(requests):
        await one(index)
    print((time.process_time() - start) / requests * 1e6)

import logging
logging.getLogger("pd_router").setLevel(logging.WARNING)
asyncio.run(main(int(sys.argv[2])))
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revisions", nargs="+", help="git revisions; . is the working tree")
    parser.add_argument("--requests", type=int, default=20000, help="per revision per round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pd-router-relay-micro-") as tmp:
        with checkouts(args.revisions, Path(tmp)) as trees:
            times: dict[int, list[float]] = {i: [] for i in range(len(trees))}
            for round_ in range(args.rounds):
                order = list(range(len(trees)))
                for index in order if round_ % 2 == 0 else order[::-1]:
                    done = subprocess.run(  # nosec B603
                        [sys.executable, "-c", WORKER, str(trees[index]), str(args.requests)],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    times[index].append(float(done.stdout.split()[-1]))
            for index, revision in enumerate(args.revisions):
                rounds = " ".join(f"{t:.1f}" for t in times[index])
                print(
                    f"{revision:>12}: {statistics.median(times[index]):.1f} us relay CPU per "
                    f"request, median ({min(times[index]):.1f} the least; rounds: {rounds})"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

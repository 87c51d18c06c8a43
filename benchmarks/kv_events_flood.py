"""How late a flood of KV events makes the router's event loop, and what it costs in memory.

    python benchmarks/kv_events_flood.py [--blocks 4 1024 16384] [--seconds 5]

For each ``--blocks`` (blocks of 16 tokens per batch, a new prompt's each time), a
publisher process (``tests/kv_publisher.py``: vLLM 0.32's wire format on 127.0.0.1) first
trickles (a batch every 50 ms: the baseline) and then floods for ``--seconds`` as fast as it
can, while this process runs the router's subscribers (``engines/kvevents.py``'s
``follow``, as the router runs it) in its event loop next to a ticker that sleeps 10 ms
over and over: how late it woke is how late the loop ran. Printed: the ticker's lateness
(p50, p99, max) in the baseline and in the flood, the batches applied and the gaps seen,
and this process's RSS before and at the flood's peak. Run it with ``PYTHONPATH`` pointing
at another checkout to measure that one (the publisher is this checkout's). It prints
numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import anyio

from pd_router.engines.kvevents import follow
from pd_router.fleet.holdings import KvView
from pd_router.fleet.kvevents import EventStreams
from pd_router.fleet.nodes import make_nodes
from pd_router.sim.fleet import free_port

_PUBLISHER = Path(__file__).resolve().parent.parent / "tests" / "kv_publisher.py"
_spec = importlib.util.spec_from_file_location("kv_publisher", _PUBLISHER)
assert _spec is not None and _spec.loader is not None
kv_publisher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv_publisher)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def spread(late: list[float]) -> str:
    ordered = sorted(late)
    at = [ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.99)], ordered[-1]]
    return "p50 %6.1f  p99 %6.1f  max %7.1f ms" % tuple(1e3 * value for value in at)


async def lateness(seconds: float) -> list[float]:
    late = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        await anyio.sleep(0.01)
        late.append(time.monotonic() - start - 0.01)
    return late


async def run(blocks: int, seconds: float) -> None:
    port = free_port()
    with kv_publisher.PublisherProcess(port) as publisher:
        nodes = make_nodes([f"http://127.0.0.1:1,kv_events={port}"], 1, role="prefill")
        streams = EventStreams(KvView())
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow, nodes, streams)
            publisher.command("trickle 0.05")
            with anyio.fail_after(30):
                while not streams.live(0):
                    await anyio.sleep(0.05)
            quiet = await lateness(2)
            before = rss_mb()
            applied = streams.streams[0].batches
            publisher.command(f"flood {seconds} {blocks}")
            flood = await lateness(seconds)
            peak = rss_mb()
            tg.cancel_scope.cancel()
    stream = streams.streams[0]
    print(f"{blocks:6d} blocks a batch, baseline: {spread(quiet)}", flush=True)
    print(
        f"{'':6s}               flood:    {spread(flood)}; {stream.batches - applied} batches"
        f" applied, {stream.faults.get('gap', 0)} gaps; RSS {before:.0f} -> {peak:.0f} MB",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 1024, 16384])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    import pd_router

    print(f"pd_router from {Path(pd_router.__file__).parent}", file=sys.stderr)
    for blocks in args.blocks:
        anyio.run(run, blocks, args.seconds)


if __name__ == "__main__":
    main()

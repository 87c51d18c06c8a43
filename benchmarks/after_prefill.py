"""What a request waited for after its prefill, from ``routing_bench.py --logs DIR``: the
time from its prefill's end to its first token (the hand-over, the KV pull, the first
token, the way back), by how many other requests' prefills ended within ``--window`` of
it, and each run's slowest requests.

    python benchmarks/routing_bench.py --shapes completions --configs cost round_robin \\
        --rounds 5 --logs /tmp/logs
    python benchmarks/after_prefill.py /tmp/logs/cost.log /tmp/logs/round_robin.log

The routers serve one configuration's run at a time, so a log's requests fall in runs
apart by ``--gap`` or more. On the benchmark's 2-core machine the simulated engines, the
routers and the load generator share the cores: prefills that end together have their
hand-overs and first tokens served together, each a little later; two policies whose
slowest requests are alike but for that differ by it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass
class Request:
    started: float
    prefill_end: float
    after: float  # s from the prefill's end to the first token
    ttft: float
    node: int | None


def read(path: Path) -> list[Request]:
    requests = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("logger") != "pd_router.access" or entry.get("ttft_s") is None:
            continue
        ended = datetime.fromisoformat(entry["time"].replace("Z", "+00:00")).timestamp()
        started = ended - entry["duration_s"]
        before = (entry["queued_s"] or 0.0) + (entry["prefill_s"] or 0.0)
        ttft = entry["ttft_s"]
        requests.append(
            Request(started, started + before, ttft - before, ttft, entry["prefill_node"])
        )
    return sorted(requests, key=lambda request: request.started)


def runs(requests: list[Request], gap: float) -> list[list[Request]]:
    out: list[list[Request]] = []
    for request in requests:
        if not out or request.started - out[-1][-1].started > gap:
            out.append([])
        out[-1].append(request)
    return out


def together(request: Request, run: list[Request], window: float) -> int:
    """Other prefills of the run that ended within ``window`` of this one's."""
    return sum(
        1
        for other in run
        if other is not request and abs(other.prefill_end - request.prefill_end) < window
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--window", type=float, default=0.003, help="s (0.003)")
    parser.add_argument("--gap", type=float, default=0.5, help="s between runs (0.5)")
    args = parser.parse_args(argv)
    for path in args.logs:
        by_count: dict[int, list[float]] = defaultdict(list)
        slowest = []
        for run in runs(read(path), args.gap):
            for request in run:
                by_count[min(together(request, run, args.window), 3)].append(request.after)
            for request in sorted(run, key=lambda request: -request.ttft)[:2]:
                slowest.append(
                    f"{request.ttft * 1e3:.1f} ({request.after * 1e3:.1f} after, "
                    f"{together(request, run, args.window)} with it)"
                )
        print(f"{path.name}: ms from the prefill's end to the first token")
        for count, afters in sorted(by_count.items()):
            label = f"{count}+" if count == 3 else str(count)
            ordered = sorted(afters)
            print(
                f"  {label:>2} other prefills ending with it: {len(afters):5d} requests, "
                f"median {statistics.median(afters) * 1e3:5.2f}, "
                f"p90 {ordered[int(len(ordered) * 0.9)] * 1e3:5.2f}"
            )
        print("  each run's two slowest, TTFT ms: " + "; ".join(slowest))


if __name__ == "__main__":
    sys.exit(main())

"""The conversations benchmark's quick form (``benchmarks/conversations_bench.py``): it
runs, and the default prefix policy gets from the caches what the issue asks of it."""

from __future__ import annotations

import json
import subprocess  # nosec B404
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "conversations_bench.py"


def test_the_quick_benchmark_shows_the_prefix_policy_near_the_best_cache_share(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(  # nosec B603
        [sys.executable, str(BENCH), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = {run["name"]: run for run in json.loads(out.read_text())["runs"]}
    assert all(run["errors"] == 0 for run in runs.values()), done.stdout
    best = runs["1 node, unbounded cache"]["cached_share"]
    prefix, two = runs["prefix"], runs["prefix, 2 routers"]
    assert prefix["cached_share"] >= 0.9 * best, done.stdout
    assert two["cached_share"] >= prefix["cached_share"] - 0.05, done.stdout
    assert prefix["cached_share"] > runs["round_robin"]["cached_share"] + 0.1, done.stdout
    assert max(prefix["prefills"]) <= 1.5 * min(prefix["prefills"]), done.stdout

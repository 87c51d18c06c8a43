"""The conversations benchmark (``benchmarks/conversations_bench.py``), small: it runs, and
every turn of every configuration is answered and counted where it went. How much each
policy gets from the caches, and how evenly it spreads, depends on the machine's timing
(a busy node makes the prefix policy spill): the benchmark prints those against their
targets (``met``/``MISSED``), and this test only checks that they are there."""

from __future__ import annotations

import json
import subprocess  # nosec B404
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "conversations_bench.py"
CONVERSATIONS, TURNS = 16, 3


def test_the_benchmark_answers_every_turn_and_reports_the_policies_targets(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(  # nosec B603
        [
            sys.executable, str(BENCH), "--conversations", str(CONVERSATIONS),
            "--turns", str(TURNS), "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(out.read_text())
    runs = {run["name"]: run for run in document["runs"]}
    assert set(runs) == {
        "round_robin", "least_loaded", "prefix", "prefix, 2 routers", "1 node, unbounded cache"
    }  # fmt: skip
    turns = CONVERSATIONS * TURNS
    for name, run in runs.items():
        assert run["errors"] == 0, (name, run["failures"])
        # Every turn was one prefill on one of the engines measured.
        assert sum(run["prefills"]) == turns, (name, run["prefills"])
        # Every conversation repeats the shared system prompt: every configuration finds
        # some of its prompt tokens cached, never all (each turn brings new ones).
        assert 0 < run["cached_share"] < 1, (name, run)
    assert len(runs["prefix"]["prefills"]) == 4
    assert runs["1 node, unbounded cache"]["prefills"] == [turns]
    targets = document["targets"]
    assert len(targets) == 4 and all(isinstance(t["met"], bool) for t in targets)
    for target in targets:
        assert f"{'met' if target['met'] else 'MISSED'}: {target['target']}" in done.stdout

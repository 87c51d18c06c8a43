"""What ``/metrics`` says of the engines' failures (``ops/metrics.py``), with no server:
the exposition the registry writes, as Prometheus scrapes it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_router.fleet.nodes import Node
from pd_router.fleet.registry import Fleet
from pd_router.ops.gathered import STALE_AFTER, GatheredMetrics
from pd_router.ops.metrics import Telemetry

URL = "http://10.0.0.9:8200"


def errors(telemetry: Telemetry) -> list[str]:
    text = generate_latest(telemetry.registry).decode()
    return [
        line for line in text.splitlines() if line.startswith("pd_router_upstream_errors_total")
    ]


def test_a_node_removed_and_added_again_under_its_id_is_one_series_and_a_gone_one_none() -> None:
    """With ``--state`` a node removed and added again keeps its id and URL: its failures
    are one series that goes on counting (before, each came as a series of its own with
    the same labels, which Prometheus refuses). A node removed for good takes its series
    with it (before, every removed node's stayed, and its object, however many DNS
    brought and took away)."""
    fleet = Fleet([Node(id=0, url="http://p0:8100", slots=1, role="prefill")], [])
    telemetry = Telemetry(fleet)
    for _ in range(3):
        node = fleet.add(URL, "decode", 4, node_id=7)
        telemetry.upstream_error(node, "unreachable")
        fleet.drain(node)
        fleet.remove(node)
    assert errors(telemetry) == []
    node = fleet.add(URL, "decode", 4, node_id=7)
    telemetry.upstream_error(node, "unreachable")
    telemetry.upstream_error(node, "unreachable")
    labels = f'kind="unreachable",node="7",role="decode",url="{URL}"'
    assert errors(telemetry) == [f"pd_router_upstream_errors_total{{{labels}}} 2.0"]


def test_workers_series_are_gathered_and_a_dead_workers_are_left_out(tmp_path: Path) -> None:
    """With ``--workers`` each worker answers with every worker's last snapshot, labelled
    by worker; one not rewritten for ``STALE_AFTER`` (its worker died and was not started
    again) is left out, or its last counts would stand for good."""

    def worker(number: int, ok: int) -> GatheredMetrics:
        telemetry = Telemetry(Fleet([Node(id=0, url=URL, slots=1, role="decode")], []))
        for _ in range(ok):
            telemetry.count("completions", "ok")
        return GatheredMetrics(telemetry.registry, number, tmp_path)

    def ok_by_worker(answer: bytes) -> dict[str, float]:
        return {
            sample.labels["worker"]: sample.value
            for family in text_string_to_metric_families(answer.decode())
            for sample in family.samples
            if sample.name == "pd_router_requests_total"
            and sample.labels == {**sample.labels, "endpoint": "completions", "outcome": "ok"}
        }

    first, second, third = worker(1, 3), worker(2, 5), worker(3, 7)
    second.write()
    third.write()
    assert ok_by_worker(first.exposition()) == {"1": 3.0, "2": 5.0, "3": 7.0}
    old = time.time() - STALE_AFTER - 5
    os.utime(tmp_path / "3.json", (old, old))
    assert ok_by_worker(first.exposition()) == {"1": 3.0, "2": 5.0}

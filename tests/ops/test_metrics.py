"""What ``/metrics`` says of the engines' failures (``ops/metrics.py``), with no server:
the exposition the registry writes, as Prometheus scrapes it."""

from __future__ import annotations

from prometheus_client import generate_latest

from pd_router.fleet.nodes import Node
from pd_router.fleet.registry import Fleet
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

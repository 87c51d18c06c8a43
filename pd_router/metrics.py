"""/metrics: Prometheus text exposition, read from the router's state at scrape time.

Nothing is counted twice: the pool and the router already keep the numbers, and a
collector reads them when Prometheus asks, so the request path pays nothing for metrics.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .nodes import State
from .relay import Router


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        pool = router.fleet.pool
        requests = CounterMetricFamily(
            "pd_router_requests",
            "Requests finished, by endpoint and outcome.",
            labels=["endpoint", "outcome"],
        )
        for (endpoint, outcome), count in sorted(router.outcomes.items()):
            requests.add_metric([endpoint, outcome], count)
        yield requests
        yield GaugeMetricFamily(
            "pd_router_queue_depth", "Requests waiting for a decode slot.", value=pool.queue_depth
        )
        yield CounterMetricFamily(
            "pd_router_slot_acquisitions",
            "Decode slots reserved since start.",
            value=pool.acquired,
        )
        yield CounterMetricFamily(
            "pd_router_slot_releases", "Decode slots released since start.", value=pool.released
        )
        labels = ["node", "url", "role"]
        slots = GaugeMetricFamily("pd_router_node_slots", "Slots per node.", labels=labels)
        in_use = GaugeMetricFamily(
            "pd_router_node_slots_in_use", "Reserved decode slots per node.", labels=labels
        )
        state = GaugeMetricFamily(
            "pd_router_node_state", "1 for the state each node is in.", labels=[*labels, "state"]
        )
        failures = GaugeMetricFamily(
            "pd_router_node_consecutive_failures", "Failures in a row per node.", labels=labels
        )
        for node in router.fleet.nodes:
            values = [str(node.id), node.url, node.role]
            slots.add_metric(values, node.slots)
            in_use.add_metric(values, node.in_use)
            failures.add_metric(values, node.failures)
            for each in State:
                state.add_metric([*values, each.value], float(node.state is each))
        yield slots
        yield in_use
        yield state
        yield failures
        yield GaugeMetricFamily(
            "pd_router_in_flight", "Requests bound to nodes now.", value=len(router.fleet.bindings)
        )


def registry_for(router: Router) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router))
    return registry

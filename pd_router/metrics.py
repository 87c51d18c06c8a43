"""/metrics: Prometheus text exposition, read from the router's state at scrape time.

Nothing is counted twice: the pool and the router already keep the numbers, and a
collector reads them when Prometheus asks, so the request path pays nothing for metrics.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .relay import Router


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        pool = router.pool
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
        slots = GaugeMetricFamily(
            "pd_router_decode_slots", "Slots per decode node.", labels=["node", "url"]
        )
        in_use = GaugeMetricFamily(
            "pd_router_decode_slots_in_use",
            "Reserved slots per decode node.",
            labels=["node", "url"],
        )
        for node in pool.nodes:
            labels = [str(node.id), node.url]
            slots.add_metric(labels, node.slots)
            in_use.add_metric(labels, node.in_use)
        yield slots
        yield in_use


def registry_for(router: Router) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router))
    return registry

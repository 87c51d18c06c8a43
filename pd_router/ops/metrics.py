"""/metrics: Prometheus exposition through ``prometheus-client``.

Everything is plain integers and floats kept by the request path (outcomes, upstream
errors, slots, node states, the four latency histograms' buckets) and turned into metric
families by one collector at scrape time: a request pays a ``bisect`` and an increment per
histogram, not prometheus-client's locks and per-bucket loop. Nothing is done per chunk.
Labels are bounded: endpoint, outcome, node id/url/role, error kind, the names of the
client keys the file has held; never a request id, never a key.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from pd_router.discovery.rules import Discovery
from pd_router.edge.validation import PATHS
from pd_router.fleet.nodes import Node, State
from pd_router.fleet.registry import Fleet

OUTCOMES = (
    "ok",
    "client_aborted",
    "rejected_busy",
    "rejected_timeout",
    "no_live_node",
    "prefill_error",
    "decode_error",
    "node_dead",
    "aborted",
    "shutting_down",
    "bad_request",
    "model_not_found",
    "loop_detected",
    "timeout",
    "stalled",
    "state_unavailable",
    "internal_error",
    "unauthorized",
    "rate_limited",
)

# The endpoint label of a request refused at another /v1/ path (a 401 without a valid key:
# /v1/models, or a path that does not exist).
OTHER = "other"

# Seconds: from sub-millisecond router overhead to multi-minute generations.
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


@dataclass
class Timings:
    """One finished request, as the histograms see it (None: that phase never ran)."""

    queued: float | None
    prefill: float | None
    ttft: float | None
    duration: float


class Histogram:
    """Bucket counts for one latency; exposed in Prometheus' cumulative form at scrape."""

    __slots__ = ("name", "help", "counts", "sum")

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.help = text
        self.counts = [0] * (len(_BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        # Prometheus buckets are "less than or equal": bisect_left puts an exact bound in it.
        self.counts[bisect_left(_BUCKETS, seconds)] += 1
        self.sum += seconds

    def family(self) -> HistogramMetricFamily:
        cumulative = []
        total = 0
        for bound, count in zip((*map(_bound, _BUCKETS), "+Inf"), self.counts, strict=True):
            total += count
            cumulative.append((bound, total))
        return HistogramMetricFamily(self.name, self.help, buckets=cumulative, sum_value=self.sum)


def _bound(seconds: float) -> str:
    return repr(float(seconds))


class Telemetry:
    def __init__(
        self, fleet: Fleet, discovery: Discovery | None = None, *, keys: bool = False
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        # (endpoint, outcome, key name): the key is "" without --api-keys-file (and for a
        # request with no valid key), and a label of its own only with it.
        self.outcomes: dict[tuple[str, str, str], int] = {
            (e, o, ""): 0 for e in PATHS for o in OUTCOMES
        }
        self.keys = keys
        # By (node id, url, role, kind): the node's labels, not the node, so that a node
        # removed and added again under its id (``--state``) is one series, and a removed
        # one's series go (``_StateCollector``) instead of its object staying for good.
        self.upstream_errors: dict[tuple[str, str, str, str], int] = {}
        # (policy, "hit" or "miss"): prefill picks, by whether the prefix went where it
        # went last time.
        self.prefill_picks: dict[tuple[str, str], int] = {}
        # (where, source): prompts computed on a prefill engine ("remote") or on their decode
        # engine ("local"), by what the prediction of cached tokens came from; and the
        # cached tokens predicted.
        self.placements: dict[tuple[str, str], int] = {}
        self.predicted_cached: dict[tuple[str, str], int] = {}
        self.queue_wait = Histogram(
            "pd_router_queue_wait_seconds", "Time from arrival to a reserved decode slot."
        )
        self.prefill = Histogram(
            "pd_router_prefill_duration_seconds", "Prefill request duration, retries included."
        )
        self.ttft = Histogram(
            "pd_router_time_to_first_token_seconds",
            "Time from arrival to the first byte of the answer sent to the client.",
        )
        self.duration = Histogram(
            "pd_router_request_duration_seconds", "Time from arrival to the request's end."
        )
        self.registry.register(_StateCollector(fleet, self))
        if discovery is not None:
            self.registry.register(_DiscoveryCollector(discovery))

    @property
    def histograms(self) -> tuple[Histogram, ...]:
        return (self.queue_wait, self.prefill, self.ttft, self.duration)

    def count(self, endpoint: str, outcome: str, key_name: str = "") -> None:
        key = (endpoint, outcome, key_name)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def upstream_error(self, node: Node, kind: str) -> None:
        key = (str(node.id), node.url, node.role, kind)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def prefill_picked(self, policy: str, hit: bool) -> None:
        key = (policy, "hit" if hit else "miss")
        self.prefill_picks[key] = self.prefill_picks.get(key, 0) + 1

    def placed(self, local: bool, source: str, cached: int) -> None:
        key = ("local" if local else "remote", source)
        self.placements[key] = self.placements.get(key, 0) + 1
        self.predicted_cached[key] = self.predicted_cached.get(key, 0) + cached

    def observe(self, timings: Timings) -> None:
        if timings.queued is not None:
            self.queue_wait.observe(timings.queued)
        if timings.prefill is not None:
            self.prefill.observe(timings.prefill)
        if timings.ttft is not None:
            self.ttft.observe(timings.ttft)
        self.duration.observe(timings.duration)


class _StateCollector(Collector):
    def __init__(self, fleet: Fleet, telemetry: Telemetry) -> None:
        self._fleet = fleet
        self._telemetry = telemetry

    def collect(self) -> Iterator[Metric]:
        fleet = self._fleet
        pool = fleet.pool
        keys = self._telemetry.keys
        requests = CounterMetricFamily(
            "pd_router_requests",
            "Requests finished, by endpoint and outcome"
            + (" and client key name (--api-keys-file)." if keys else "."),
            labels=["endpoint", "outcome", "key"] if keys else ["endpoint", "outcome"],
        )
        for (endpoint, outcome, key), count in sorted(self._telemetry.outcomes.items()):
            requests.add_metric([endpoint, outcome, key] if keys else [endpoint, outcome], count)
        yield requests
        errors = CounterMetricFamily(
            "pd_router_upstream_errors",
            "Engine failures seen by requests, by node and kind.",
            labels=["node", "url", "role", "kind"],
        )
        counted = self._telemetry.upstream_errors
        nodes = {(str(node.id), node.url, node.role) for node in fleet.nodes}
        for gone in [series for series in counted if series[:3] not in nodes]:
            del counted[gone]  # a node removed: its series end (DNS churn is unbounded)
        for series, count in counted.items():
            errors.add_metric(list(series), count)
        yield errors
        picks = CounterMetricFamily(
            "pd_router_prefill_picks",
            "Prefill nodes picked, by policy and prefix: hit when this router last sent the "
            "request's prefix key (its conversation's opening) to the same node.",
            labels=["policy", "prefix"],
        )
        for (policy, prefix), count in sorted(self._telemetry.prefill_picks.items()):
            picks.add_metric([policy, prefix], count)
        yield picks
        placements = CounterMetricFamily(
            "pd_router_prompt_placements",
            "Prompts computed on a prefill engine (where=remote) or by their decode engine "
            "(where=local, --max-local-prefill), by where the prediction of their cached "
            "tokens came from (source=prediction: this router's own placements; events: the "
            "engines' KV events).",
            labels=["where", "source"],
        )
        predicted = CounterMetricFamily(
            "pd_router_predicted_cached_tokens",
            "Prompt tokens predicted cached where the prompts were computed.",
            labels=["where", "source"],
        )
        for (where, origin), count in sorted(self._telemetry.placements.items()):
            placements.add_metric([where, origin], count)
            predicted.add_metric([where, origin], self._telemetry.predicted_cached[where, origin])
        yield placements
        yield predicted
        faults = CounterMetricFamily(
            "pd_router_kv_event_faults",
            "KV event stream faults per engine, by kind (gap: events missed, the subscriber "
            "fell behind; garbage: a message that is not vLLM's; disconnected; overflow: more "
            "blocks than any engine's cache): each makes the stream degraded, the router "
            "predicting from its own placements.",
            labels=["node", "url", "kind"],
        )
        streams = GaugeMetricFamily(
            "pd_router_kv_event_stream",
            "1 for each engine's KV event stream state (waiting, live, degraded).",
            labels=["node", "url", "state"],
        )
        for node in fleet.prefill.nodes:
            stream = fleet.events.streams.get(node.id)
            if stream is None:
                continue
            for kind, count in sorted(stream.faults.items()):
                faults.add_metric([str(node.id), node.url, kind], count)
            streams.add_metric([str(node.id), node.url, stream.state], 1.0)
        yield faults
        yield streams
        yield GaugeMetricFamily(
            "pd_router_queue_depth", "Requests waiting for a decode slot.", value=pool.queue_depth
        )
        yield GaugeMetricFamily(
            "pd_router_in_flight", "Requests bound to nodes now.", value=len(fleet.bindings)
        )
        yield CounterMetricFamily(
            "pd_router_slot_acquisitions", "Decode slots reserved since start.", value=pool.acquired
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
        reason = GaugeMetricFamily(
            "pd_router_node_reason",
            "1 for why a node is not serving: the evidence (probe timeout, stalled, ...).",
            labels=[*labels, "reason"],
        )
        failures = GaugeMetricFamily(
            "pd_router_node_consecutive_failures", "Failures in a row per node.", labels=labels
        )
        source = GaugeMetricFamily(
            "pd_router_node_source",
            "1 for where each node came from: static, admin, or the DNS name that lists it.",
            labels=[*labels, "source"],
        )
        for node in fleet.nodes:
            values = [str(node.id), node.url, node.role]
            slots.add_metric(values, node.slots)
            in_use.add_metric(values, node.in_use)
            failures.add_metric(values, node.failures)
            source.add_metric([*values, node.source], 1.0)
            for each in State:
                state.add_metric([*values, each.value], float(node.state is each))
            if node.reason is not None:
                reason.add_metric([*values, node.reason], 1.0)
        yield slots
        yield in_use
        yield state
        yield reason
        yield failures
        yield source
        for histogram in self._telemetry.histograms:
            yield histogram.family()


class _DiscoveryCollector(Collector):
    """What the DNS lookups of each name did (``discovery/rules.py``)."""

    def __init__(self, discovery: Discovery) -> None:
        self._discovery = discovery

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "name"]
        lookups = CounterMetricFamily(
            "pd_router_discovery_lookups",
            "DNS lookups per name, by outcome: ok, empty (no address: fleet kept), failed.",
            labels=[*labels, "outcome"],
        )
        changes = CounterMetricFamily(
            "pd_router_discovery_changes",
            "Fleet changes made by DNS discovery per name: added, drained, rejoined, removed.",
            labels=[*labels, "change"],
        )
        listed = GaugeMetricFamily(
            "pd_router_discovery_addresses",
            "Addresses in the last answer that listed any, per name.",
            labels=labels,
        )
        for group in self._discovery.groups:
            names = [group.spec.role, group.spec.source.removeprefix("dns:")]
            for outcome, count in group.lookups.items():
                lookups.add_metric([*names, outcome], count)
            for change, count in group.changes.items():
                changes.add_metric([*names, change], count)
            listed.add_metric(names, group.listed)
        yield lookups
        yield changes
        yield listed

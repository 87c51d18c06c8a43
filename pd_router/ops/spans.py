"""A request's spans, on OpenTelemetry's SDK: loaded only when tracing is on (``tracing.py``).

One SERVER span per request, parented on the client's W3C ``traceparent`` when it sent one,
with a child for each phase: ``queue`` (the wait for a decode slot), ``prefill`` (one per
attempt), ``decode`` (one per decode engine tried; its child ``kv_handoff`` lasts until
that engine has taken the KV). The engine requests carry their phase span's context
(``traceparent``, and the client's ``tracestate``), so an engine's own spans join the trace.

Spans are handed to a ``BatchSpanProcessor``: ending one only appends it to a queue; a
background thread encodes and posts them. Parents are passed explicitly, never through
the ambient context (no ``contextvars`` work per request). Nothing from a request's body
but its model name is recorded, and no header but the trace context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pd_router.errors import RouterError, UpstreamError
from pd_router.fleet.nodes import Node

SERVICE = "pd-router"
_HEADERS = (b"traceparent", b"tracestate")


class Tracer:
    """The process's tracer: one per router process, made where it serves (after a fork)."""

    def __init__(self, endpoint: str) -> None:
        resource = Resource.create()
        # OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) names the
        # service; the SDK's stand-in for none is "unknown_service...".
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: SERVICE}))
        self.endpoint = endpoint
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self.provider.get_tracer("pd_router")
        self._propagator = TraceContextTextMapPropagator()

    def request(self, headers: list[tuple[bytes, bytes]], path: str) -> RequestTrace:
        """The trace of one request to ``path``, continuing the client's trace context."""
        carrier: dict[str, list[str]] | None = None
        for name, value in headers:
            if name in _HEADERS:
                if carrier is None:
                    carrier = {}
                carrier.setdefault(name.decode(), []).append(value.decode("latin-1"))
        parent = None if carrier is None else self._propagator.extract(carrier)
        return RequestTrace(self._tracer, parent, path)

    def close(self) -> None:
        """Export what is still queued, then stop the exporter's thread. Blocking: each
        post gives up after ``OTEL_EXPORTER_OTLP_TIMEOUT`` (10 s), and the SDK after 30 s in
        all, which only a collector that does not answer takes."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans. The relay calls it at each phase; ``finish`` ends them all."""

    __slots__ = (
        "root",
        "trace_id",
        "_tracer",
        "_recording",
        "_context",
        "_phase",
        "_handoff",
        "_decode",
        "_beside",
        "_beside_node",
        "_prefills",
        "_decodes",
        "events",
        "usage",
    )

    def __init__(self, tracer: trace.Tracer, parent: Context | None, path: str) -> None:
        self._tracer = tracer
        self.root = tracer.start_span(
            f"POST {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": path},
        )
        self.trace_id = format(self.root.get_span_context().trace_id, "032x")
        # A request the sampler left out (OTEL_TRACES_SAMPLER) gets no child spans: the
        # engines continue its root's unsampled context, and it costs this one span.
        self._recording = self.root.is_recording()
        self._context = trace.set_span_in_context(self.root) if self._recording else None
        # The phase under way (queue, prefill or decode) and the hand-off inside a decode.
        self._phase: Span | None = None
        self._handoff: Span | None = None
        self._decode: Span | None = None
        # SGLang's prefill, sent beside the decode request (``beside``): not a phase.
        self._beside: Span | None = None
        self._beside_node: Node | None = None
        self._prefills = 0
        self._decodes = 0
        # SSE events relayed to the client, and the answer's usage if it had one.
        self.events = 0
        self.usage: dict[str, Any] | None = None

    def queue(self) -> None:
        self._start("queue", SpanKind.INTERNAL, {})

    def reserved(self, node: Node) -> None:
        if self._phase is not None:
            self._phase.set_attribute("pd_router.decode_node", node.id)
        self._end_phase()

    def prefill(self, node: Node, url: str, prefix_hit: bool | None) -> bytes:
        """Start a prefill attempt on ``node``; the headers its request carries."""
        attributes = self._prefill_attempt(node, url, prefix_hit)
        return _headers(self._start("prefill", SpanKind.CLIENT, attributes))

    def beside(self, node: Node, url: str, prefix_hit: bool | None) -> bytes:
        """Start SGLang's prefill request, which runs beside the decode request's phase
        (``prefill`` would end at the decode's start); ``beside_ended`` ends it."""
        attributes = self._prefill_attempt(node, url, prefix_hit)
        if not self._recording:
            return _headers(self.root)
        self._beside_node = node
        self._beside = self._tracer.start_span(
            "prefill", context=self._context, kind=SpanKind.CLIENT, attributes=attributes
        )
        return _headers(self._beside)

    def _prefill_attempt(self, node: Node, url: str, prefix_hit: bool | None) -> dict[str, Any]:
        self._prefills += 1
        attributes: dict[str, Any] = {
            "pd_router.node": node.id,
            "pd_router.attempt": self._prefills,
            "url.full": url,
        }
        if prefix_hit is not None:
            attributes["pd_router.prefix_hit"] = prefix_hit
        return attributes

    def beside_ended(self) -> None:
        """SGLang's prefill answered, failed (``failed`` marked it) or was let go."""
        if self._beside is not None:
            self._beside.end()
            self._beside = None

    def prefilled(self, details: dict[str, Any] | None) -> None:
        span = self._phase
        if span is not None:
            span.set_attribute("http.response.status_code", 200)
            cached = None if details is None else details.get("cached_tokens")
            if isinstance(cached, int):
                span.set_attribute("pd_router.cached_tokens", cached)
        self._end_phase()

    def decode(self, node: Node, url: str, drain: bool) -> bytes:
        """Start a decode request to ``node`` (and its hand-off); the headers it carries."""
        self._decodes += 1
        attributes: dict[str, Any] = {
            "pd_router.node": node.id,
            "pd_router.attempt": self._decodes,
            "url.full": url,
        }
        if drain:
            # The client left: a one-token request only to make the engine take the KV.
            attributes["pd_router.drain"] = True
        span = self._start("decode", SpanKind.CLIENT, attributes)
        if self._recording:
            self._decode = span
            self._handoff = self._tracer.start_span(
                "kv_handoff", context=trace.set_span_in_context(span)
            )
        return _headers(span)

    def handed(self) -> None:
        """The decode engine has the KV."""
        if self._handoff is not None:
            self._handoff.end()
            self._handoff = None

    def failed(self, error: UpstreamError, node: Node) -> None:
        """``node``'s engine failed: the phase under way, or SGLang's prefill beside it."""
        status = Status(StatusCode.ERROR, error.kind)
        attributes: dict[str, Any] = {"error.type": error.kind}
        if error.kind.startswith("http_"):
            attributes["http.response.status_code"] = error.status
        spans = (self._handoff, self._phase)
        if self._beside is not None and node is self._beside_node:
            spans = (self._beside, None)
        for span in spans:
            if span is not None:
                span.set_status(status)
                span.set_attributes(attributes)

    def watching(self, fix: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """``fix`` (the relay's usage fix), also keeping the usage for the decode span."""

        def fixed(usage: dict[str, Any]) -> None:
            self.usage = usage
            fix(usage)

        return fixed

    def finish(
        self,
        request_id: str,
        outcome: str,
        status: int,
        error: RouterError | None,
        ttft: float | None = None,
        model: str | None = None,
        stream: bool | None = None,
    ) -> None:
        """End every span: the request ended with ``outcome`` (and ``error``, if any)."""
        root = self.root
        failed = outcome != "ok"
        kind = _error_type(error, outcome) if failed else ""
        if failed:
            # What was under way when the request ended (a client that left, a shutdown).
            for span in (self._handoff, self._phase):
                if span is not None:
                    span.set_status(Status(StatusCode.ERROR, kind))
        decode = self._decode
        if decode is not None:
            attributes: dict[str, Any] = {"pd_router.outcome": outcome}
            if ttft is not None:
                attributes["pd_router.time_to_first_token_s"] = ttft
            if self.events:
                attributes["pd_router.events"] = self.events
            usage = self.usage
            if usage is not None:
                for key, name in _USAGE:
                    value = usage.get(key)
                    if isinstance(value, int):
                        attributes[name] = value
            decode.set_attributes(attributes)
        self._end_phase()
        self.beside_ended()
        if self._recording:
            attributes = {
                "pd_router.request_id": request_id,
                "pd_router.outcome": outcome,
                "http.response.status_code": status,
            }
            if model is not None:
                attributes["gen_ai.request.model"] = model
            if stream is not None:
                attributes["pd_router.stream"] = stream
            if failed:
                attributes["error.type"] = kind
                root.set_status(Status(StatusCode.ERROR, kind))
            root.set_attributes(attributes)
        root.end()

    def _start(self, name: str, kind: SpanKind, attributes: dict[str, Any]) -> Span:
        self._end_phase()
        if not self._recording:
            return self.root
        span = self._phase = self._tracer.start_span(
            name, context=self._context, kind=kind, attributes=attributes
        )
        return span

    def _end_phase(self) -> None:
        self.handed()
        if self._phase is not None:
            self._phase.end()
            self._phase = None


# The answer's usage, as the OpenTelemetry GenAI conventions name it.
_USAGE = (
    ("prompt_tokens", "gen_ai.usage.input_tokens"),
    ("completion_tokens", "gen_ai.usage.output_tokens"),
)


def _headers(span: Span) -> bytes:
    """``span``'s W3C trace context as header lines for an engine request."""
    context = span.get_span_context()
    head = b"traceparent: 00-%032x-%016x-%02x\r\n" % (
        context.trace_id,
        context.span_id,
        context.trace_flags,
    )
    state = context.trace_state
    if state:
        head += b"tracestate: " + state.to_header().encode("ascii") + b"\r\n"
    return head


def _error_type(error: RouterError | None, outcome: str) -> str:
    """What failed, in one word: the error's code, an engine failure's kind, else the
    outcome (``client_aborted``)."""
    if error is None:
        return outcome
    if error.code is not None:
        return error.code
    if isinstance(error, UpstreamError):
        return error.kind
    return error.type

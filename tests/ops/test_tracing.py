"""When tracing is on and where its spans go: the flag, the standard ``OTEL_*`` variables
and their precedence, decided without a server (``ops/tracing.py``)."""

from __future__ import annotations

import re

import pytest

from pd_router.ops.tracing import Exporting, TracingError, traces_url, wanted

BASE = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
FLAG = "--otlp-traces-endpoint"


@pytest.mark.parametrize(
    ("flag", "environ", "expected"),
    [
        # Off by default: nothing asks for it.
        (None, {}, None),
        (None, {"OTEL_SERVICE_NAME": "router"}, None),
        (None, {BASE: "  "}, None),
        # A base URL gets the traces path; the traces URL is used as it is, and wins.
        (None, {BASE: "http://c:4318"}, Exporting("http://c:4318/v1/traces", BASE)),
        (None, {BASE: "https://c:4318/otlp/"}, Exporting("https://c:4318/otlp/v1/traces", BASE)),
        (None, {TRACES: "http://t:4318/custom"}, Exporting("http://t:4318/custom", TRACES)),
        (
            None,
            {TRACES: "http://t:4318/custom", BASE: "http://c:4318"},
            Exporting("http://t:4318/custom", TRACES),
        ),
        # The specification's off switches.
        (None, {BASE: "http://c:4318", "OTEL_SDK_DISABLED": "true"}, None),
        (None, {BASE: "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, None),
        (None, {BASE: "http://c:4318", "OTEL_TRACES_EXPORTER": "otlp"}, Exporting(
            "http://c:4318/v1/traces", BASE
        )),
        # The flag wins over every variable, the off switches included.
        ("http://f:4318/v1/traces", {TRACES: "http://t:4318/x"}, Exporting(
            "http://f:4318/v1/traces", FLAG
        )),
        ("http://f:4318/v1/traces", {"OTEL_SDK_DISABLED": "true"}, Exporting(
            "http://f:4318/v1/traces", FLAG
        )),
        # The traces protocol variable counts before the general one.
        (
            None,
            {
                BASE: "http://c:4318",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            },
            Exporting("http://c:4318/v1/traces", BASE),
        ),
    ],
)  # fmt: skip
def test_when_tracing_is_on_and_where_to(
    flag: str | None, environ: dict[str, str], expected: Exporting | None
) -> None:
    assert wanted(flag, environ) == expected


@pytest.mark.parametrize(
    ("flag", "environ", "message"),
    [
        (None, {BASE: "c:4318"}, f"{BASE}: expected an http:// or https:// URL"),
        (None, {BASE: "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "4317"),
        (
            "http://f:4318/v1/traces",
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json: pd-router exports traces over "
            "OTLP/HTTP with protobuf (http/protobuf) only",
        ),
        (
            None,
            {BASE: "http://c:4318", "OTEL_TRACES_EXPORTER": "zipkin"},
            "OTEL_TRACES_EXPORTER=zipkin: pd-router exports traces over OTLP only",
        ),
    ],
)
def test_settings_it_cannot_follow_are_refused(
    flag: str | None, environ: dict[str, str], message: str
) -> None:
    with pytest.raises(TracingError, match=re.escape(message)):
        wanted(flag, environ)


def test_the_flag_takes_a_collector_or_its_traces_url() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    for bad in ("collector:4318", "grpc://c:4317", "http://"):
        with pytest.raises(TracingError, match="expected an http:// or https:// URL"):
            traces_url(bad)

"""Whether the router traces, and where to: ``--otlp-traces-endpoint`` or the standard
``OTEL_*`` environment. Off unless one of them asks for it.

This module imports no OpenTelemetry, so a router without the ``[tracing]`` extra runs as
before; ``load`` imports the spans (``ops/spans.py``) once tracing is asked for, and says
what to install when that fails. With tracing off, nothing of it runs on a request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from pd_router.ops.spans import Tracer

INSTALL = "pip install 'pd-router[tracing]'"
TRACES_PATH = "/v1/traces"
PROTOCOL = "http/protobuf"
_TRUE = ("true", "1", "yes", "on")


class TracingError(ValueError):
    """Tracing was asked for in a way the router cannot do; the message says how to fix it."""


@dataclass(frozen=True)
class Exporting:
    """Where spans go (OTLP over HTTP, protobuf), and which setting said so."""

    endpoint: str
    source: str


def wanted(flag: str | None, environ: Mapping[str, str]) -> Exporting | None:
    """The export settings, or None when tracing is off. Raises ``TracingError``.

    The flag (a URL ``traces_url`` checked) wins; else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    (the traces URL, used as is) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL,
    ``/v1/traces`` appended) turn it on, unless ``OTEL_SDK_DISABLED=true`` or
    ``OTEL_TRACES_EXPORTER=none`` say otherwise, as the OpenTelemetry specification has them.
    """
    if flag:
        exporting = Exporting(flag, "--otlp-traces-endpoint")
    else:
        disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE
        exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        if disabled or exporters == "none":
            return None
        traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        if traces:
            name = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
            exporting = Exporting(_from_env(name, traces), name)
        elif base:
            name = "OTEL_EXPORTER_OTLP_ENDPOINT"
            exporting = Exporting(_from_env(name, base).rstrip("/") + TRACES_PATH, name)
        else:
            return None
        if exporters not in ("", "otlp"):
            raise TracingError(
                f"OTEL_TRACES_EXPORTER={exporters}: pd-router exports traces over OTLP only "
                "(otlp, or none to turn tracing off)"
            )
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        # The traces-specific variable, when set, is the one that counts.
        protocol = environ.get(name, "").strip()
        if protocol:
            if protocol != PROTOCOL:
                raise TracingError(
                    f"{name}={protocol}: pd-router exports traces over OTLP/HTTP with "
                    f"protobuf ({PROTOCOL}) only; point it at the collector's HTTP port "
                    "(4318, not gRPC's 4317)"
                )
            break
    return exporting


def load(exporting: Exporting) -> type[Tracer]:
    """The tracer class, checked to be importable now (at start-up, before any fork)."""
    try:
        from pd_router.ops.spans import Tracer
    except ImportError as exc:
        raise TracingError(
            f"tracing is on ({exporting.source}) but OpenTelemetry is not installed "
            f"({exc.name or exc}): {INSTALL}; or unset {exporting.source} to run without "
            "tracing"
        ) from None
    return Tracer


def traces_url(text: str) -> str:
    """The flag's URL: one without a path gets ``/v1/traces``, as a base URL in
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` would. Raises ``TracingError``."""
    url = _checked(text.strip())
    return url.rstrip("/") + TRACES_PATH if urlsplit(url).path in ("", "/") else url


def _checked(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingError(
            "expected an http:// or https:// URL of an OTLP/HTTP collector "
            f"(http://collector:4318/v1/traces), got {shown(url)!r}"
        )
    return url


def shown(url: str) -> str:
    """The URL as a message or the log shows it: a user and password in it (the
    collector's Basic credentials, which the exporter sends) as ``***``; in a URL that
    is not one too (``user:password@host`` without its scheme), so not parsed as one."""
    at = url.rfind("@")
    if at < 0:
        return url
    scheme = url.find("://")
    start = scheme + 3 if 0 <= scheme < at else 0
    return url[:start] + "***" + url[at:]


def _from_env(name: str, url: str) -> str:
    try:
        return _checked(url)
    except TracingError as exc:
        raise TracingError(f"{name}: {exc}") from None

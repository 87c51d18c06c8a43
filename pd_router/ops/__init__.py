"""What operators see: Prometheus metrics (``metrics``), the request log line and log
formats (``logs``), how late the event loop runs (``lag``), the sleeps of periodic work
(``ticks``), and OpenTelemetry traces (``tracing``: whether, and where to; ``spans``: a
request's, imported only when on).

May import: ``pd_router.errors``, ``pd_router.fleet``, ``pd_router.discovery`` and
``pd_router.edge``.
"""

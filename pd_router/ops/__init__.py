"""What operators see: Prometheus metrics (``metrics``), the request log line and log
formats (``logs``), and how late the event loop runs (``lag``).

May import: ``pd_router.errors``, ``pd_router.fleet``, ``pd_router.discovery`` and
``pd_router.edge``.
"""

"""What engines are sent and what they answer: one HTTP/1.1 connection (``connection``),
keep-alive pools and error kinds (``client``), the P/D handshake dialects (vLLM's
``handshake``, SGLang's ``bootstrap``),
server-sent events (``sse``), and the router's own reads of each engine: health probes,
model lists, the stall watch's clock (``watch``).

May import: ``pd_router.errors``, ``pd_router.fleet`` (nodes and their evidence), and
``pd_router.ops.lag``. Knows nothing of clients (``edge``).
"""

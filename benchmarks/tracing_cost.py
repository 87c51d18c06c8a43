"""What tracing costs the router: CPU per request with it off and on, in one run.

    python benchmarks/tracing_cost.py                    # ~2 min on 2 cores
    python benchmarks/tracing_cost.py --requests 1000 --rounds 2

Part 1, in this process: one request's span work (``ops/spans.py``: the request's trace,
its queue, prefill, decode and hand-off spans, the engine headers, ``finish``) timed
alone, with the batch exporter posting to a receiver here; the request path's share (the
calls themselves) and all of it (the export thread's encoding and posting included).

Part 2, whole routers: one set of simulated engines (1 prefill, 2 instant decode, as
``compare_commits.py``) and three routers of this working tree in front of them: ``off``
(no flag, no ``OTEL_*``), ``on`` (``--otlp-traces-endpoint`` to an OTLP/HTTP receiver in
this process that decodes and counts what it gets) and ``on-unsampled`` (the same with
``OTEL_TRACES_SAMPLER=traceidratio``, ratio 0: spans made but not recorded nor exported;
the trace context still goes to the engines). The same streaming load alternates between
them round by round; prints router CPU milliseconds per request (utime+stime from /proc,
the exporter's thread included) and the spans received per request. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)

from benchmarks.compare_commits import RevisionRouter, compare  # noqa: E402
from benchmarks.processes import running  # noqa: E402
from pd_router.fleet.nodes import Node  # noqa: E402
from pd_router.ops.spans import Tracer  # noqa: E402
from pd_router.sim.fleet import SimFleet  # noqa: E402

HEADERS = [(b"content-type", b"application/json"), (b"host", b"router")]


class Receiver:
    """OTLP/HTTP on 127.0.0.1: decodes each export and counts its spans."""

    def __init__(self) -> None:
        self.spans = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers["content-length"])))
                receiver.spans += sum(
                    len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans
                )
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def span_work(receiver: Receiver, requests: int) -> None:
    # Room for every span of the run: a full queue would drop spans, and their export cost.
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(10 * (requests + 1000))
    tracer = Tracer(receiver.url)
    del os.environ["OTEL_BSP_MAX_QUEUE_SIZE"]
    prefill = Node(id=0, url="http://127.0.0.1:1", slots=1, role="prefill")
    decode = Node(id=1, url="http://127.0.0.1:2", slots=64)
    headers = [
        *HEADERS,
        (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ]

    def one(index: int) -> None:
        trace = tracer.request(headers, "/v1/completions")
        trace.queue()
        trace.reserved(decode)
        trace.prefill(prefill, "http://127.0.0.1:1/v1/completions", False)
        trace.prefilled({"cached_tokens": 0})
        trace.decode(decode, "http://127.0.0.1:2/v1/completions", False)
        trace.handed()
        trace.events = 66
        trace.finish(f"r{index}", "ok", 200, None, 0.001, "sim-model", True)

    for index in range(1000):  # warm-up
        one(index)
    tracer.provider.force_flush()
    # This thread's CPU is the request path's; the process's adds the export thread's.
    path, cpu = time.thread_time(), time.process_time()
    for index in range(requests):
        one(index)
    on_path = (time.thread_time() - path) / requests * 1e6
    tracer.provider.force_flush()
    total = (time.process_time() - cpu) / requests * 1e6
    tracer.close()
    print(
        f"span work per request (5 spans): {on_path:.0f} us CPU on the request path, "
        f"{total:.0f} us with the export thread's encoding and posting"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per router per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per stream")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--span-requests", type=int, default=20000, help="part 1's requests")
    args = parser.parse_args(argv)
    receiver = Receiver()
    span_work(receiver, args.span_requests)
    receiver.spans = 0
    decode_args = ["--standalone", "--slots", "256", "--ttft", "0", "--itl", "0"]
    with SimFleet(prefill=1, decode=2, decode_args=decode_args) as fleet:
        engines = [[e.url for e in fleet.prefill], [e.url for e in fleet.decode]]
        flags = ["--decode-slots", "64"]
        traced = [*flags, "--otlp-traces-endpoint", receiver.url]
        unsampled = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
        routers = [
            RevisionRouter("off", REPO_ROOT, *engines, *flags),
            RevisionRouter("on", REPO_ROOT, *engines, *traced),
            RevisionRouter("on-unsampled", REPO_ROOT, *engines, *traced, env=unsampled),
        ]
        with running(routers):
            asyncio.run(compare(routers, args))
    warm = 2 * args.concurrency
    sent = args.requests * args.rounds + warm
    # Stopped routers have flushed: every span they made is in.
    print(f"spans received per traced request: {receiver.spans / sent:.2f}")
    receiver.server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``pd-router demo``: the router in front of simulated engines on loopback, no GPU needed.

One prefill and ``--decode-nodes`` decode engines (``pd_router.sim``) start as their own
processes on free 127.0.0.1 ports; the router serves in this process and the engines are
stopped, by PID, when it exits.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .cli import _positive, _seconds, add_router_flags, address, build_router, listen, serve
from .sim.fleet import SimFleet


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="pd-router demo",
        description="Run pd-router in front of simulated prefill and decode engines.",
    )
    add_router_flags(parser, engines=False)
    for flag, kind, default, metavar, text in [
        ("--decode-nodes", _positive, 2, "N", "simulated decode engines"),
        ("--ttft", _seconds, 0.05, "SECONDS", "simulated time to first token"),
        ("--itl", _seconds, 0.02, "SECONDS", "simulated time between tokens"),
    ]:
        parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
    parser.set_defaults(decode_slots=4, queue_timeout=10.0)
    args = parser.parse_args(argv)
    sock = listen(parser, args)
    decode_args = ["--ttft", str(args.ttft), "--itl", str(args.itl)]
    with SimFleet(prefill=1, decode=args.decode_nodes, decode_args=decode_args) as fleet:
        args.prefill = [engine.url for engine in fleet.prefill]
        args.decode = [engine.url for engine in fleet.decode]
        print(
            f"pd-router demo: prefill {' '.join(args.prefill)}, decode {' '.join(args.decode)}; "
            f"try: curl http://{address(args.host, args.port)}/v1/completions "
            '-H "Content-Type: application/json" '
            """-d '{"model": "sim-model", "prompt": "hello pd router", "max_tokens": 8}'""",
            flush=True,
        )
        serve(args, build_router(args), sock)

"""``pd-router``: flags, logging, uvicorn.

``pd-router demo`` runs the same router in front of simulated engines (see ``demo.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import uvicorn

from .app import MAX_BODY_BYTES, create_app
from .nodes import RoundRobin, make_nodes
from .pool import DecodePool
from .relay import Router, Settings
from .upstream import Upstream


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def add_router_flags(parser: argparse.ArgumentParser, *, engines: bool = True) -> None:
    if engines:
        parser.add_argument(
            "--prefill",
            action="extend",
            nargs="+",
            required=True,
            metavar="URL",
            help="prefill engine base URL (repeat or list several)",
        )
        parser.add_argument(
            "--decode",
            action="extend",
            nargs="+",
            required=True,
            metavar="URL[,slots=N]",
            help="decode engine base URL, optionally with its own slot count",
        )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--decode-slots",
        type=_positive,
        default=1,
        metavar="N",
        help="sequences each decode node serves at once, unless the node says otherwise",
    )
    parser.add_argument(
        "--queue-timeout",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for a free decode slot; 0 fails fast with 429",
    )
    parser.add_argument(
        "--connect-timeout",
        type=_seconds,
        default=5.0,
        metavar="SECONDS",
        help="give up connecting to an engine after this long",
    )
    parser.add_argument(
        "--read-timeout",
        type=_seconds,
        default=600.0,
        metavar="SECONDS",
        help="give up on an engine that sends nothing for this long",
    )
    parser.add_argument(
        "--handoff-grace",
        type=_seconds,
        default=5.0,
        metavar="SECONDS",
        help="after a client left between prefill and decode, how long the decode engine "
        "gets to take the KV before the router drops the request",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=_positive,
        default=MAX_BODY_BYTES,
        metavar="BYTES",
        help="largest request body accepted (413 above)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--access-log", action="store_true", help="log every HTTP request (uvicorn)"
    )


def build_router(args: argparse.Namespace) -> Router:
    return Router(
        pool=DecodePool(make_nodes(args.decode, args.decode_slots)),
        prefill=RoundRobin(make_nodes(args.prefill, 1)),
        upstream=Upstream(connect_timeout=args.connect_timeout, read_timeout=args.read_timeout),
        settings=Settings(queue_timeout=args.queue_timeout, handoff_grace=args.handoff_grace),
    )


def serve(args: argparse.Namespace, router: Router) -> None:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(router, max_body_bytes=args.max_body_bytes)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        loop="auto",
        http="auto",
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        demo_main(argv[1:])
        return
    parser = argparse.ArgumentParser(
        prog="pd-router",
        description="One OpenAI-compatible endpoint in front of prefill and decode engines. "
        "`pd-router demo` runs it in front of simulated engines on loopback.",
    )
    add_router_flags(parser)
    args = parser.parse_args(argv)
    try:
        router = build_router(args)
    except ValueError as exc:
        parser.error(str(exc))
    serve(args, router)

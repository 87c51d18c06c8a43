"""``pd-router``: the command line. ``pd-router [flags]`` serves (``serve.py``), ``pd-router
demo`` serves in front of simulated engines (``demo.py``), ``pd-router status`` shows a
running router's fleet (``status.py``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from pd_router import demo, status
from pd_router.parser import suggest
from pd_router.serve import (
    build_router,
    listen,
    parse_router_args,
    refuse_own_address,
    router_parser,
    serve,
)

COMMANDS = ("demo", "status")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        demo.main(argv[1:], os.environ)
        return
    if argv[:1] == ["status"]:
        raise SystemExit(status.main(argv[1:], os.environ))
    parser, actions = router_parser()
    if argv and not argv[0].startswith("-"):
        # The router itself takes flags only: a first word is a command, misspelt.
        hint = suggest(argv[0], COMMANDS) or f" (commands: {', '.join(COMMANDS)})"
        parser.mistake(f"unknown command {argv[0]!r}{hint}")
    args = parse_router_args(parser, actions, argv, os.environ)
    try:
        router = build_router(args)
    except ValueError as exc:
        parser.error(str(exc))
    sock = listen(parser, args)
    refuse_own_address(parser, args, router)
    serve(args, router, sock)

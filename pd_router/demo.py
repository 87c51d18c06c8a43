"""``pd-router demo``: the router in front of simulated engines on loopback, no GPU needed.

``--prefill-nodes`` prefill and ``--decode-nodes`` decode engines (``pd_router.sim``) for
each of ``--models`` start as their own processes on free 127.0.0.1 ports; the router
serves in this process and the engines are stopped, by PID, when it exits. Settings come
from the same sources as ``pd-router``'s (``serve.parse_router_args``), over the demo's own
defaults.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from functools import partial

from pd_router.parser import Parser
from pd_router.serve import (
    _positive,
    _seconds,
    add_router_flags,
    address,
    build_router,
    listen,
    parse_router_args,
    serve,
)
from pd_router.sim.fleet import SimFleet
from pd_router.workers import die_with_parent

# Unlike the router's: enough slots and patience that a few curls at once queue, not 429.
DEFAULTS = {"decode_slots": 4, "queue_timeout": 10.0}
# Prefill compute per prompt token not in the engine's prefix cache: a chat's later turns,
# which the prefix policy sends where the earlier ones are cached, come back sooner
# (a 1,000-word prompt takes 0.5 s cold) and report their ``cached_tokens``.
PREFILL_PER_TOKEN = 0.0005
MODEL = "sim-model"


def _model(text: str) -> str:
    name = text.strip()
    if not name or any(char.isspace() or char == "," for char in name):
        raise argparse.ArgumentTypeError(
            f"expected a model name, without spaces or commas (several: --models alpha beta), "
            f"got {text!r}"
        )
    return name


def demo_parser() -> tuple[Parser, list[argparse.Action]]:
    parser = Parser(
        prog="pd-router demo",
        description="Run pd-router in front of simulated prefill and decode engines on "
        "127.0.0.1. It takes pd-router's flags (but starts its own engines), "
        "PD_ROUTER_<FLAG> variables and --config FILE as pd-router does; the defaults shown "
        "are the demo's.",
    )
    actions = add_router_flags(parser, engines=False)
    # On the actions, not parser.set_defaults: argparse would put a parser-level default in
    # the namespace as if given on the command line, above the environment and the file.
    for action in actions:
        action.default = DEFAULTS.get(action.dest, action.default)
    actions.append(
        parser.add_argument(
            "--models",
            action="extend",
            nargs="+",
            type=_model,
            default=[MODEL],
            metavar="NAME",
            help="models to serve, each on its own --prefill-nodes and --decode-nodes engines",
        )
    )
    for flag, kind, default, metavar, text in [
        ("--prefill-nodes", _positive, 2, "N", "simulated prefill engines per model"),
        ("--decode-nodes", _positive, 2, "N", "simulated decode engines per model"),
        ("--ttft", _seconds, 0.05, "SECONDS", "simulated time to first token"),
        ("--itl", _seconds, 0.02, "SECONDS", "simulated time between tokens"),
    ]:
        actions.append(
            parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
        )
    return parser, actions


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[Parser, argparse.Namespace]:
    parser, actions = demo_parser()
    args = parse_router_args(parser, actions, argv, environ)
    if args.prefill or args.decode or args.prefill_dns or args.decode_dns:
        parser.error(
            "the demo starts its own engines: --prefill and --decode (PD_ROUTER_PREFILL, "
            "PD_ROUTER_DECODE, prefill and decode in the config file) do not apply, nor do "
            "--prefill-dns and --decode-dns"
        )
    twice = [model for index, model in enumerate(args.models) if model in args.models[:index]]
    if twice:
        parser.error(f"--models: {twice[0]!r} is named twice")
    return parser, args


def main(argv: Sequence[str], environ: Mapping[str, str]) -> None:
    parser, args = parse(argv, environ)
    sock = listen(parser, args)
    # --name-prefill: each answer starts with the prefill engine whose KV it pulled.
    decode_args = ["--ttft", str(args.ttft), "--itl", str(args.itl), "--name-prefill"]
    prefill_args = ["--prefill-per-token", str(PREFILL_PER_TOKEN)]
    # The engines speak the router's dialect (--dialect sglang: SGLang's bootstrap rooms).
    decode_args += ["--dialect", args.dialect]
    prefill_args += ["--dialect", args.dialect]
    with SimFleet(
        prefill=args.prefill_nodes,
        decode=args.decode_nodes,
        prefill_args=prefill_args,
        decode_args=decode_args,
        models=args.models,
        # Not left running by a demo killed with SIGKILL (its `with` never ends then).
        preexec=partial(die_with_parent, os.getpid()),
    ) as fleet:
        prefill = [engine.url for engine in fleet.prefill]
        args.decode = [engine.url for engine in fleet.decode]
        args.prefill = prefill
        if args.dialect == "sglang":
            # A sim serves SGLang's bootstrap on its HTTP port.
            args.prefill = [f"{e.url},bootstrap_port={e.port}" for e in fleet.prefill]
        try:
            router = build_router(args)
        except ValueError as exc:
            parser.error(str(exc))  # as the router's own command: one line, exit code 2
        print(
            f"pd-router demo: {_engines(args.models, prefill, args.decode)}; "
            f"try: curl http://{address(args.host, args.port)}/v1/completions "
            '-H "Content-Type: application/json" '
            f"""-d '{{"model": "{args.models[0]}", "prompt": "hello pd router", """
            """"max_tokens": 8}'""",
            flush=True,
        )
        serve(args, router, sock)


def _engines(models: list[str], prefill: list[str], decode: list[str]) -> str:
    """Each model's engines, as the fleet lists them: grouped by model, in order."""
    p, d = len(prefill) // len(models), len(decode) // len(models)
    return "; ".join(
        f"{model}: prefill {' '.join(prefill[i * p : (i + 1) * p])}, "
        f"decode {' '.join(decode[i * d : (i + 1) * d])}"
        for i, model in enumerate(models)
    )

"""Command line: ``python -m pd_router.sim {prefill,decode} --host H --port P [options]``."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from collections.abc import Sequence

import uvicorn

from pd_router.sim.asgi import CrashLogFilter
from pd_router.sim.config import EngineSettings, Role, SimConfig
from pd_router.sim.engine import Engine


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="port to listen on (required)")
    parser.add_argument(
        "--dialect",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the P/D protocol: vllm (kv_transfer_params, the KV pulled from the prefill's "
        "POST /kv/pull) or sglang (bootstrap_host, bootstrap_port and bootstrap_room, the KV "
        "taken from the prefill's POST /sglang/bootstrap on its HTTP port)",
    )
    parser.add_argument(
        "--engine-id",
        metavar="ID",
        help="the engine's id in kv_transfer_params (default: sim-ROLE-PORT)",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        default="sim-model",
        help="the one model it serves: GET /v1/models lists it, a request for another gets 404",
    )
    parser.add_argument(
        "--max-model-len",
        metavar="TOKENS",
        type=_positive,
        default=4096,
        help="the context, in tokens (words): a longer prompt, or max_tokens above it, gets 400; "
        "an answer ends (finish_reason length) where the context does",
    )
    parser.add_argument(
        "--prefill-delay",
        metavar="SECONDS",
        type=_non_negative,
        default=0.0,
        help="computing a prompt takes this long (a prefill engine: plus --prefill-per-token "
        "per token not cached; a --standalone decode engine: plus that, instead of the KV pull)",
    )
    parser.add_argument(
        "--block-size",
        metavar="TOKENS",
        type=_positive,
        default=16,
        help="tokens per KV block, the prefix cache's unit",
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        metavar="N",
        type=_positive,
        default=1 << 20,
        help="blocks the prefix cache holds (least recently used evicted first)",
    )
    parser.add_argument(
        "--prefill-per-token",
        metavar="SECONDS",
        type=_non_negative,
        default=0.0,
        help="seconds of compute per prompt token not in the prefix cache (decode: for a "
        "local prefill, with --standalone)",
    )
    # As vLLM's: /v1/* need 'Authorization: Bearer KEY'; /health and the KV pull do not.
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="every /v1/ request needs 'Authorization: Bearer KEY', as vLLM's --api-key "
        "(default: none needed)",
    )
    parser.add_argument(
        "--ssl-certfile",
        metavar="FILE",
        help="serve HTTPS with this certificate (default: plain HTTP)",
    )
    parser.add_argument(
        "--ssl-keyfile", metavar="FILE", help="the key of --ssl-certfile (default: in that file)"
    )
    parser.add_argument(
        "--ssl-ca-certs",
        metavar="FILE",
        help="CA of the client certificates to accept (default: the system's)",
    )
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        metavar="N",
        help="client certificates: 0 not asked, 1 optional, 2 required (ssl.CERT_*; default: 0)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pd_router.sim",
        description="A simulated vLLM engine speaking the NixlConnector P/D protocol, or "
        "SGLang's bootstrap protocol with --dialect sglang: one "
        "engine, one model, one port. A token is a word of the prompt; a decode engine "
        "answers with the words of the prompt whose KV it pulled, repeated. "
        "`python -m pd_router.sim prefill --help` and `... decode --help` list each "
        "role's options.",
    )
    roles = parser.add_subparsers(dest="role", required=True, metavar="{prefill,decode}")

    prefill = roles.add_parser(
        "prefill", help="kv_producer: computes prompts, pins their KV for a decode engine"
    )
    _common(prefill)
    prefill.add_argument(
        "--kv-lease",
        metavar="SECONDS",
        type=_non_negative,
        default=30.0,
        help="a prompt's KV stays pinned this long for a decode engine to pull it",
    )
    prefill.add_argument(
        "--kv-events-port",
        metavar="PORT",
        type=int,
        help="publish KV cache events on this port (ZMQ PUB, vLLM's wire format) (default: off)",
    )
    prefill.add_argument(
        "--prefill-concurrency",
        metavar="N",
        type=_positive,
        default=1024,
        help="prefills computed at once; more wait their turn",
    )
    prefill.add_argument(
        "--bootstrap-timeout",
        metavar="SECONDS",
        type=_non_negative,
        default=30.0,
        help="--dialect sglang: a computed prompt waits this long for a decode engine to take "
        "its room (then the request is a 500), and a take waits this long for its room's "
        "prompt (then it is a 404)",
    )

    decode = roles.add_parser("decode", help="kv_consumer: pulls KV, generates tokens")
    _common(decode)
    decode.add_argument(
        "--accept-delay",
        metavar="SECONDS",
        type=_non_negative,
        default=0.0,
        help="a request in a slot waits this long before it pulls the KV",
    )
    decode.add_argument(
        "--ttft",
        metavar="SECONDS",
        type=_non_negative,
        default=0.0,
        help="time to the first token, after the pull",
    )
    decode.add_argument(
        "--itl", metavar="SECONDS", type=_non_negative, default=0.0, help="time between tokens"
    )
    decode.add_argument(
        "--default-max-tokens",
        metavar="N",
        type=_positive,
        default=16,
        help="tokens generated for a request that gives no max_tokens",
    )
    decode.add_argument(
        "--slots",
        metavar="N",
        type=_positive,
        default=64,
        help="requests generated at once; more wait their turn",
    )
    decode.add_argument(
        "--standalone",
        action="store_true",
        help="also serve requests without kv_transfer_params (--dialect sglang: without any "
        "bootstrap field), computing their prompt (a local prefill), as a vLLM kv_consumer does",
    )
    decode.add_argument(
        "--name-prefill",
        action="store_true",
        help="start each answer with [prefill HOST:PORT], the prefill engine whose KV it "
        "pulled (pd-router demo turns it on)",
    )
    for role in (prefill, decode):
        _show_defaults(role)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        default = action.default
        # None: no default (required, or said in the help); SUPPRESS: --help's own.
        if action.help and default not in (None, argparse.SUPPRESS):
            shown = f"{default:g}" if isinstance(default, float) else str(default)
            action.help += f" (default: {'off' if default is False else shown})"


def build_engine(args: argparse.Namespace) -> Engine:
    # Each role imports only its own module: aiohttp, which only decode needs, is the
    # slowest import here and start-up time is what a test fleet waits for.
    role: Role = args.role
    config = SimConfig(prefill_delay=args.prefill_delay, prefill_per_token=args.prefill_per_token)
    if role == "prefill":
        from pd_router.sim.prefill import PrefillEngine

        settings = EngineSettings(
            role=role,
            host=args.host,
            port=args.port,
            engine_id=args.engine_id or f"sim-prefill-{args.port}",
            model=args.model,
            block_size=args.block_size,
            prefix_cache_blocks=args.prefix_cache_blocks,
            prefill_concurrency=args.prefill_concurrency,
            max_model_len=args.max_model_len,
            kv_lease=args.kv_lease,
            kv_events_port=args.kv_events_port,
            api_key=args.api_key,
            dialect=args.dialect,
            bootstrap_timeout=args.bootstrap_timeout,
        )
        return PrefillEngine(settings, config)
    from pd_router.sim.decode import DecodeEngine

    config.accept_delay = args.accept_delay
    config.ttft = args.ttft
    config.itl = args.itl
    config.default_max_tokens = args.default_max_tokens
    settings = EngineSettings(
        role=role,
        host=args.host,
        port=args.port,
        engine_id=args.engine_id or f"sim-decode-{args.port}",
        model=args.model,
        block_size=args.block_size,
        prefix_cache_blocks=args.prefix_cache_blocks,
        max_model_len=args.max_model_len,
        slots=args.slots,
        standalone=args.standalone,
        name_prefill=args.name_prefill,
        api_key=args.api_key,
        dialect=args.dialect,
    )
    return DecodeEngine(settings, config)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    config = uvicorn.Config(
        build_engine(args),
        host=args.host,
        port=args.port,
        loop=loop,
        http=http,
        lifespan="on",
        log_level="warning",
        access_log=False,
        # The router and the load tests hold many idle keep-alive connections.
        backlog=4096,
        timeout_keep_alive=30,
        # Stop promptly on SIGTERM even with streams still open.
        timeout_graceful_shutdown=1,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )
    # uvicorn.Config has just configured logging; filters added now stay in place.
    logging.getLogger("uvicorn.error").addFilter(CrashLogFilter())
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()

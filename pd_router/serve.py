"""The router process: its flags, its parts put together, uvicorn on one socket.

Flags can also come from the environment and a TOML file (``config.py``). ``cli.py``
dispatches to this, to ``demo.py`` (the same router in front of simulated engines) and to
``status.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import ipaddress
import logging
import os
import shutil
import socket
import ssl
import tempfile
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from pd_router import config, workers
from pd_router.app import MAX_BODY_BYTES, AppOptions, create_app
from pd_router.discovery.resolver import Resolver
from pd_router.discovery.rules import Discovery, Group
from pd_router.edge import hops
from pd_router.edge.keyfile import KeyFile
from pd_router.edge.protocol import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    IDLE_TIMEOUT,
    LINGER,
    MAX_HEAD_BYTES,
    MIN_BODY_RATE,
    SEND_TIMEOUT,
    ClientLimits,
    ClientStats,
    default_max_connections,
    protocol,
)
from pd_router.engines import bootstrap
from pd_router.engines.client import MAX_RESPONSE_BYTES, Upstream, engine_tls, no_pass_phrase
from pd_router.fleet.holdings import DEFAULT_CACHE_TOKENS, KvView
from pd_router.fleet.keys import KeyLimits
from pd_router.fleet.nodes import (
    BOOTSTRAP_PORT,
    MAX_DIGITS,
    MAX_SLOTS,
    HealthPolicy,
    Node,
    make_nodes,
    whole,
)
from pd_router.fleet.pool import DecodePool
from pd_router.fleet.prefill import DEFAULT_POLICY, POLICIES
from pd_router.fleet.registry import Fleet
from pd_router.ops import logs, tracing
from pd_router.ops.ticks import next_tick
from pd_router.parser import Parser, parse
from pd_router.relay import Router, Settings
from pd_router.shared.keys import SharedKeyLimits
from pd_router.shared.pool import SharedPool
from pd_router.shared.redis import Redis, parse_url

log = logging.getLogger("pd_router")


@config.reads_number
def _seconds(text: str) -> float:
    value = config.number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


@config.reads_number
def _timeout(text: str) -> float:
    """Seconds for a timeout that 0 would not turn off but make fire at once, every time."""
    value = config.number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _whole(low: int, high: int | None, rule: str) -> Callable[[str], int]:
    """A flag's type function for a whole number from ``low`` to ``high`` (None: any)."""

    @config.reads_number
    def convert(text: str) -> int:
        value = whole(text)
        if value is None and text.isascii() and text.isdigit():
            # Digits all, but more than any count needs: the rule alone would not say why.
            raise argparse.ArgumentTypeError(
                f"must be {rule} of at most {MAX_DIGITS} digits, got {text!r}"
            )
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    return convert


_positive = _whole(1, None, "a whole number >= 1")
_slots = _whole(1, MAX_SLOTS, f"a whole number >= 1 and <= {MAX_SLOTS}")
_count = _whole(0, None, "a whole number >= 0")
_workers = _whole(1, workers.MAX_WORKERS, f"a whole number >= 1 and <= {workers.MAX_WORKERS}")
# Nothing further down refuses 70000: uvicorn would quietly listen on 70000 % 65536.
_port = _whole(0, 65535, "a whole number from 0 to 65535 (0: any free port)")
_engine_port = _whole(1, 65535, "a whole number from 1 to 65535")


def _host(text: str) -> str:
    """The address to listen on: an empty one would be every interface's (0.0.0.0), which
    a template rendering ``--host "$HOST"`` with HOST unset would give without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"must be an address or name to listen on (0.0.0.0: every interface), got {text!r}"
        )
    return text


def _token(text: str) -> str:
    """The admin token, as a client sends it after ``Bearer `` (``edge/auth.bearer`` strips
    its ends): a token with a space or a control character at either end, or a byte that
    is not UTF-8, could never be sent, and the admin API would refuse every call."""
    if not text or text != text.strip() or not text.isprintable():
        raise argparse.ArgumentTypeError(
            "must be printable, with no space at either end (the value is not repeated)"
        )
    try:
        text.encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("must be UTF-8 (the value is not repeated)") from None
    return text


def _dns_server(text: str) -> tuple[str, int]:
    """``IP[:PORT]`` (``[IPv6]:PORT``), port 53 by default: the resolver asks an address."""
    host, port = text.strip(), "53"
    if host.startswith("["):
        host, _, rest = host[1:].partition("]")
        if rest:
            port = rest.removeprefix(":")
    elif host.count(":") == 1:
        host, port = host.split(":")
    try:
        ipaddress.ip_address(host)
        number = whole(port) or 0
    except ValueError:
        number = 0
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected an IP address and port of a DNS server (10.96.0.10:53, [::1]:53), "
            f"got {text!r}"
        )
    return host, number


def _traces_url(text: str) -> str:
    try:
        return tracing.traces_url(text)
    except tracing.TracingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# (flag, type, default, metavar, help): one table, so every option reads the same way.
OPTIONS: list[tuple[str, Callable[[str], Any], Any, str | None, str]] = [
    ("--host", _host, "127.0.0.1", "HOST", "address to listen on, IPv4 or IPv6"),
    ("--port", _port, 8000, "PORT", "port to listen on; 0 picks a free one, which is logged"),
    ("--decode-slots", _slots, 1, "N",
     "sequences each decode node serves at once, unless the node says otherwise"),
    ("--queue-timeout", _seconds, 0.0, "SECONDS",
     "wait up to this long for a free decode slot; 0 fails fast with 429"),
    ("--connect-timeout", _timeout, 5.0, "SECONDS", "give up connecting to an engine"),
    ("--read-timeout", _timeout, 600.0, "SECONDS",
     "give up on an engine that sends nothing for this long"),
    ("--engine-cache-tokens", _positive, DEFAULT_CACHE_TOKENS, "N",
     "tokens of KV each engine's prefix cache is taken to hold (--prefill-policy cost, "
     "--max-local-prefill): "
     "the router forgets, least recently used first, what an engine would have evicted"),
    ("--max-local-prefill", _count, 0, "N",
     "send a request whose prompt has at most N tokens not predicted cached on its decode "
     "node straight to that node, which computes it (no prefill engine); 0: always "
     "disaggregate"),
    ("--bootstrap-port", _engine_port, bootstrap.DEFAULT_PORT, "PORT",
     "--dialect sglang: the port of each prefill engine's bootstrap server (its "
     "--disaggregation-bootstrap-port), unless its node says bootstrap_port=PORT"),
    ("--handoff-grace", _seconds, 5.0, "SECONDS",
     "after a client left between prefill and decode, how long the decode engine gets to "
     "take the KV before the router drops the request"),
    ("--max-body-bytes", _positive, MAX_BODY_BYTES, "BYTES",
     "largest request body accepted (413 above)"),
    ("--max-header-bytes", _positive, MAX_HEAD_BYTES, "BYTES",
     "largest request line and headers accepted (431 above, and the connection closed)"),
    ("--max-response-bytes", _positive, MAX_RESPONSE_BYTES, "BYTES",
     "largest non-streamed engine answer the router holds (502 above); streams are relayed "
     "as they come and not limited"),
    ("--header-timeout", _seconds, HEADER_TIMEOUT, "SECONDS",
     "a request line and headers must be complete this long after their first byte (a new "
     "connection's: after it opened), or get 408 and the connection closed; 0: no limit"),
    ("--body-timeout", _seconds, BODY_TIMEOUT, "SECONDS",
     f"a request body must bring at least {MIN_BODY_RATE} bytes a second (or its end) in "
     "each window this long, or get 408 and the connection closed; 0: no limit"),
    ("--send-timeout", _seconds, SEND_TIMEOUT, "SECONDS",
     "a client whose connection takes none of its answer for this long (its buffer stays "
     "full) is closed, its request ended and its decode slot freed; 0: no limit"),
    ("--idle-timeout", _seconds, IDLE_TIMEOUT, "SECONDS",
     "close a keep-alive connection idle this long; keep it above clients' own pool "
     "timeouts (5 s for httpx and the openai SDK); 0 closes after each response"),
    ("--max-connections", _positive, None, "N",
     "client connections open at once; a new one beyond gets 503 too_many_connections "
     "(default: the open-file limit less 64, halved)"),
    ("--health-interval", _seconds, 1.0, "SECONDS",
     "probe every node's /health this often; 0 turns probing off"),
    ("--health-timeout", _timeout, 1.0, "SECONDS",
     "a slower probe counts as a (soft) failure, unless the router itself lagged"),
    ("--unhealthy-after", _positive, 3, "N",
     "failures in a row that make a node unhealthy (no new requests; soft: slow, 5xx) "
     "or dead (its requests failed; hard: reset, broken streams, refused probes)"),
    ("--healthy-after", _positive, 2, "N",
     "good probes in a row that readmit an unhealthy or dead node"),
    ("--stall-timeout", _seconds, 30.0, "SECONDS",
     "a decode node whose started streams all sent nothing for this long is hung: those "
     "streams end with an error and it gets no new requests for as long; 0 turns it off"),
    ("--state", str, None, "URL",
     "redis://[user:pass@]host:port/db (or rediss://): share the decode slots and their "
     "queue with every router on that Redis; unset, this process keeps its own"),
    ("--workers", _workers, 1, "N",
     "router processes serving the port, each a whole router; more than 1 needs --state"),
    ("--discovery-interval", _timeout, 5.0, "SECONDS",
     "resolve every --prefill-dns and --decode-dns name this often"),
    ("--discovery-drain-timeout", _seconds, 300.0, "SECONDS",
     "a node whose address left DNS is removed once it holds no request, or after this "
     "long, failing what it still holds"),
    ("--dns-server", _dns_server, None, "HOST:PORT",
     "the DNS server to ask for discovery; unset, the system's resolver configuration"),
    ("--admin-token", _token, None, "TOKEN",
     "enable /admin/* behind this bearer token; unset, /admin/* is off"),
    ("--api-keys-file", str, None, "FILE",
     "client keys, one a line: NAME KEY [max_in_flight=N] (KEY may be sha256:<hex>); every "
     "/v1/ request then needs 'Authorization: Bearer <key>'; read again when it changes"),
    ("--engine-api-key", str, None, "KEY",
     "sent to every engine as 'Authorization: Bearer KEY' (vLLM's --api-key); better set "
     "as PD_ROUTER_ENGINE_API_KEY, out of the process list"),
    ("--ssl-certfile", str, None, "FILE", "serve HTTPS with this certificate (PEM)"),
    ("--ssl-keyfile", str, None, "FILE", "the private key of --ssl-certfile (PEM)"),
    ("--engine-ca", str, None, "FILE",
     "trust https:// engines whose certificates this CA (PEM) signed, instead of the "
     "system's CAs"),
    ("--engine-cert", str, None, "FILE",
     "client certificate (PEM) the router shows https:// engines that require one (mTLS)"),
    ("--engine-key", str, None, "FILE", "the private key of --engine-cert (PEM)"),
    ("--shutdown-timeout", _seconds, 30.0, "SECONDS",
     "on SIGTERM, how long in-flight requests get to finish before they are failed"),
    ("--otlp-traces-endpoint", _traces_url, None, "URL",
     "export OpenTelemetry traces over OTLP/HTTP to this URL (a collector's "
     "http://HOST:4318/v1/traces; /v1/traces is added to a URL without a path); unset, "
     "the OTEL_EXPORTER_OTLP_*ENDPOINT variables turn tracing on, else it is off; needs "
     f"{tracing.INSTALL}"),
]  # fmt: skip


def add_router_flags(
    parser: argparse.ArgumentParser, *, engines: bool = True
) -> list[argparse.Action]:
    """Add the router's flags; returns them, for the other sources of settings.

    Without ``engines`` (the demo starts its own) ``--prefill`` and ``--decode`` are hidden
    and optional, yet known in every source: the caller refuses them in its own words.
    """
    actions: list[argparse.Action] = []

    def add(flag: str, **kwargs: Any) -> None:
        actions.append(parser.add_argument(flag, **kwargs))

    def engine_help(text: str) -> str:
        return text if engines else argparse.SUPPRESS

    add(
        "--prefill",
        action="extend",
        nargs="+",
        required=engines,
        metavar="URL[,kv_events=PORT]",
        help=engine_help(
            "prefill engine base URL (repeat or list several); kv_events=PORT: it publishes "
            "vLLM's KV events on that port of its host"
        ),
    )
    add(
        "--decode",
        action="extend",
        nargs="+",
        required=engines,
        metavar="URL[,slots=N]",
        help=engine_help("decode engine base URL, optionally with its own slot count"),
    )
    add(
        "--prefill-dns",
        action="extend",
        nargs="+",
        metavar="NAME:PORT[,kv_events=PORT]",
        help=engine_help(
            "discover prefill engines as the addresses NAME resolves to (A, AAAA; SRV records "
            "when NAME starts with _, without :PORT), beside or instead of --prefill; "
            "kv_events=PORT as for --prefill"
        ),
    )
    add(
        "--decode-dns",
        action="extend",
        nargs="+",
        metavar="NAME:PORT[,slots=N][,KEY=VALUE]",
        help=engine_help(
            "discover decode engines by DNS as --prefill-dns does; slots=N for their slots, "
            "other KEY=VALUE options are labels"
        ),
    )
    for flag, kind, default, metavar, text in OPTIONS:
        add(flag, type=kind, default=default, metavar=metavar, help=text)
    add(
        "--prefill-policy",
        default=DEFAULT_POLICY,
        choices=list(POLICIES),
        help="how a prefill node is picked: prefix sends a conversation's turns to the node "
        "that holds its prefix (the same from every router), unless that node is clearly "
        "busier than the rest; cost, the node predicted to finish the prefill first (the "
        "prompt tokens it does not hold plus the prefill work waiting there); least_loaded, "
        "the fewest prefills in flight; round_robin, in turn",
    )
    add(
        "--dialect",
        default="vllm",
        choices=["vllm", "sglang"],
        help="the engines' P/D protocol: vllm, the prefill engine answers kv_transfer_params "
        "and the decode engine pulls the KV (NixlConnector); sglang, both get the request at "
        "once with the prefill engine's bootstrap host, port and a room",
    )
    add(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the least severe log lines shown",
    )
    add("--log-format", default="text", choices=["text", "json"], help="log lines as text or JSON")
    add(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log every HTTP request (uvicorn)",
    )
    add(
        "--config",
        metavar="FILE",
        help="TOML file of settings, keys named as the flags with _ for - (queue_timeout) "
        "(default: $PD_ROUTER_CONFIG)",
    )
    return actions  # fmt: skip


def parse_router_args(
    parser: Parser,
    actions: Sequence[argparse.Action],
    argv: Sequence[str],
    environ: Mapping[str, str],
) -> argparse.Namespace:
    """The command line over ``PD_ROUTER_*`` over the config file over the defaults."""
    options = config.options_of(actions)
    # Only now may argparse forget defaults and requirements: a flag it leaves out of the
    # namespace is one the command line did not give, which a lower source may fill in.
    # --help is shown after that, so the defaults go into the help text first (the demo's
    # own ones, where it changed them).
    for action in actions:
        if action.default is not None and action.help is not argparse.SUPPRESS:
            action.help = f"{action.help} (default: {_shown(action.default)})"
        action.default = argparse.SUPPRESS
        action.required = False
    given = vars(parse(parser, argv))
    try:
        args = argparse.Namespace(**config.resolve(options, given, environ))
    except config.MissingSettings as exc:
        parser.mistake(str(exc))
    except config.ConfigError as exc:
        parser.error(str(exc))
    if args.workers > 1 and args.state is None:
        parser.exit(
            2,
            f"{parser.prog}: error: --workers {args.workers} needs --state: without a shared "
            "pool each worker would count the slots on its own\n",
        )
    if args.dialect == "sglang" and args.max_local_prefill:
        parser.exit(
            2,
            f"{parser.prog}: error: --max-local-prefill needs --dialect vllm: an SGLang "
            "decode engine takes its KV from a prefill engine's bootstrap room, always\n",
        )
    # Decided and its packages imported here, before any fork; the exporter (a thread) is
    # started where the router serves (``_serve``).
    try:
        args.tracing = tracing.wanted(args.otlp_traces_endpoint, environ)
        if args.tracing is not None:
            tracing.load(args.tracing)
    except tracing.TracingError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return args


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, list):
        return " ".join(map(str, default))
    return str(default)


def build_router(args: argparse.Namespace, mark: str | None = None) -> Router:
    """``mark``: the loop mark (``edge/hops.py``) of the router this one is a worker of;
    None: a new router, a new mark."""
    prefill = make_nodes(args.prefill or [], 1, role="prefill")
    decode = make_nodes(args.decode or [], args.decode_slots, first_id=len(prefill))
    names = [*(args.prefill_dns or []), *(args.decode_dns or [])]
    discovery = None
    if names:
        if args.dns_server is None:
            Resolver()  # the system's configuration must be there: refused now, not later
        discovery = Discovery(
            [Group(spec) for spec in names],
            decode_slots=args.decode_slots,
            interval=args.discovery_interval,
            drain_timeout=args.discovery_drain_timeout,
            server=args.dns_server,
        )
    policy = HealthPolicy(unhealthy_after=args.unhealthy_after, healthy_after=args.healthy_after)
    pool: Callable[[list[Node]], DecodePool] = DecodePool
    key_limits = KeyLimits()
    if args.state is not None:
        # A Redis that does not answer within a second is away: fail new requests fast.
        redis = Redis(parse_url(args.state), timeout=1.0)
        pool = partial(SharedPool, redis=redis)
        key_limits = SharedKeyLimits(redis)
    _check_serving_tls(args.ssl_certfile, args.ssl_keyfile)
    tls = None
    if args.engine_ca or args.engine_cert or args.engine_key:
        tls = engine_tls(args.engine_ca, args.engine_cert, args.engine_key)
    return Router(
        fleet=Fleet(
            prefill,
            decode,
            policy,
            pool=pool,
            prefill_policy=args.prefill_policy,
            kv=KvView(args.engine_cache_tokens),
        ),
        upstream=Upstream(
            connect_timeout=args.connect_timeout,
            read_timeout=args.read_timeout,
            max_response_bytes=args.max_response_bytes,
            api_key=args.engine_api_key,
            tls=tls,
        ),
        settings=Settings(
            queue_timeout=args.queue_timeout,
            handoff_grace=args.handoff_grace,
            max_local_prefill=args.max_local_prefill,
            dialect=args.dialect,
            bootstrap_port=args.bootstrap_port,
        ),
        discovery=discovery,
        keys=None if args.api_keys_file is None else KeyFile(args.api_keys_file),
        key_limits=key_limits,
        mark=mark or hops.new_mark(),
    )


def _check_serving_tls(certfile: str | None, keyfile: str | None) -> None:
    """Refused at start, in one line, rather than by uvicorn in each worker."""
    if certfile is None:
        if keyfile is not None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        return
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile, password=no_pass_phrase)
    except (OSError, ssl.SSLError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"--ssl-certfile {certfile}: {reason}") from None


def refuse_own_address(
    parser: argparse.ArgumentParser, args: argparse.Namespace, router: Router
) -> None:
    """Exit 2 if a configured node is the address the router listens on: every request
    sent there would come back to it."""
    for node in router.fleet.nodes:
        if hops.own_address(node.url, args.host, args.port, socket.gethostname()):
            parser.exit(
                2,
                f"{parser.prog}: error: {node.role} node {node.url} is this router's own "
                f"address ({address(args.host, args.port)}): a router is no engine of its own\n",
            )


class _Server(uvicorn.Server):
    """uvicorn, telling the router about SIGTERM/SIGINT as it stops accepting."""

    def __init__(
        self, config: uvicorn.Config, router: Router, handshake_timeout: float | None = None
    ) -> None:
        """``handshake_timeout``: seconds a client's TLS handshake may take (None: the
        loop's default, 60 s)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None  # the main loop's, between ticks
        super().__init__(config)
        self._router = router
        self._handshake_timeout = handshake_timeout

    # uvicorn's main loop wakes every 0.1 s to see whether it should exit, and renews the
    # Date header every tenth wake. This one wakes once a second for the header (with the
    # router's other work of the second: ``ops/ticks.py``), and at once when told to exit:
    # ten times fewer wake-ups of an idle router.
    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value and self._loop is not None:
            # From a signal handler or another thread as well as from the loop.
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def main_loop(self) -> None:
        loop = asyncio.get_running_loop()
        # uvicorn's on_tick renews the header when the count is a multiple of 10 (its
        # once a second); nothing else of it depends on the count.
        while not await self.on_tick(0):
            self._waiter = loop.create_future()
            timer = loop.call_at(next_tick(loop.time(), 1.0), self._wake)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.config.is_ssl and self._handshake_timeout is not None:
            # A client connection exists for the router (its --header-timeout, the connection
            # limits: edge/protocol.py) once its TLS handshake is done; until then only the
            # loop's handshake timeout bounds it, 60 s by default, which uvicorn passes no
            # other of: connections that never finish a handshake held the file
            # descriptors every other client needed. The loop's create_server, which
            # uvicorn calls, is given --header-timeout for it.
            loop = asyncio.get_running_loop()
            create_server = loop.create_server
            loop.create_server = partial(  # type: ignore[method-assign]
                create_server, ssl_handshake_timeout=self._handshake_timeout
            )
            try:
                await super().startup(sockets)
            finally:
                del loop.create_server
        else:
            await super().startup(sockets)
        # uvicorn names the address only of sockets it bound itself; this line is also the
        # one that tells which port --port 0 got.
        scheme = "https" if self.config.is_ssl else "http"
        for sock in sockets or ():
            host, port = sock.getsockname()[:2]
            log.info("listening on %s://%s", scheme, address(host, port))

    async def _serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super()._serve(sockets)
        # uvicorn re-raises the signal it stopped on, so the exit status would say "killed";
        # a shutdown that drained gracefully is a success (exit 0) for the orchestrator.
        self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between any two bytecodes: hand the work to the loop.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._router.begin_shutdown)
        super().handle_exit(sig, frame)


def listen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> socket.socket:
    """The router's socket, bound and listening before anything else starts, so that a taken
    address is one line and exit 2 rather than a banner, uvicorn's start-up, then its error
    (and, for the demo, engines started for nothing). Port 0 becomes the port the system
    chose, so that the messages after this one name the real port."""
    # As uvicorn decides it: a colon makes an IPv6 address; names resolve as IPv4.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A restart need not wait for the last run's connections to leave TIME_WAIT; a port
        # another process listens on is still refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen()
    except (TypeError, UnicodeError):  # a host name the socket cannot encode
        sock.close()
        parser.exit(2, f"{parser.prog}: error: --host {args.host!r}: not an address\n")
    except OSError as exc:
        sock.close()
        reason = (exc.strerror or str(exc)).lower()
        if exc.errno == errno.EADDRINUSE:
            reason += "; pass --port to choose another (or --port 0 for any free port)"
        where = address(args.host, args.port)
        parser.exit(2, f"{parser.prog}: error: cannot listen on {where}: {reason}\n")
    args.port = sock.getsockname()[1]
    return sock


def address(host: str, port: int) -> str:
    """``host:port`` as it goes in a URL."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve(args: argparse.Namespace, router: Router, sock: socket.socket) -> None:
    """Serve on ``sock`` until SIGTERM or SIGINT, here or in ``--workers`` processes."""
    if args.workers == 1:
        _serve(args, router, sock)
        return
    logs.configure(args.log_level, args.log_format)
    # Where the workers' series meet for /metrics (``ops/gathered.py``): the parent's, made
    # before the first fork and gone with it.
    metrics = Path(tempfile.mkdtemp(prefix=f"pd-router-metrics-{os.getpid()}-"))
    try:
        # ``router`` was the check that the flags make one; it is not a worker's: each must
        # be a router of its own to the shared pool (its own id and lease), so each builds
        # its own.
        work = partial(_work, args, sock, router.mark, metrics)
        code = workers.supervise(args.workers, work, sock)
    finally:
        shutil.rmtree(metrics, ignore_errors=True)
    if code:
        raise SystemExit(code)


def _work(
    args: argparse.Namespace, sock: socket.socket, mark: str, metrics: Path, worker: int
) -> None:
    # One mark for every worker: a request that comes back through another worker of this
    # router came back all the same.
    parent = os.getppid()
    try:
        _serve(args, build_router(args, mark), sock, (worker, metrics))
    finally:
        if os.getppid() != parent:
            # The parent was killed (its own removal never runs): the last worker out
            # leaves no directory behind.
            shutil.rmtree(metrics, ignore_errors=True)


def _say_dialect(args: argparse.Namespace, router: Router) -> None:
    """The engines' P/D protocol, said once at start; SGLang's bootstrap ports given to a
    router that speaks vLLM's are a fleet speaking another protocol than the router's."""
    if args.dialect == "sglang":
        log.info(
            "engines' dialect: sglang, bootstrap port %d unless a node says", args.bootstrap_port
        )
        return
    labelled = [n.url for n in router.fleet.prefill.nodes if BOOTSTRAP_PORT in n.labels]
    if labelled or args.bootstrap_port != bootstrap.DEFAULT_PORT:
        log.warning(
            "--bootstrap-port and bootstrap_port labels (%s) are SGLang's: this router speaks "
            "vLLM's dialect (--dialect sglang for SGLang's engines)",
            ", ".join(labelled) or "none",
        )


def _serve(
    args: argparse.Namespace,
    router: Router,
    sock: socket.socket,
    worker: tuple[int, Path] | None = None,
) -> None:
    logs.configure(args.log_level, args.log_format)
    if worker is not None:
        workers.tag_logs(worker[0], args.log_format)
    if args.tracing is not None:
        router.tracer = tracing.load(args.tracing)(args.tracing.endpoint)
        endpoint = tracing.shown(args.tracing.endpoint)
        log.info("tracing: OTLP/HTTP to %s (%s)", endpoint, args.tracing.source)
    _say_dialect(args, router)
    options = AppOptions(
        max_body_bytes=args.max_body_bytes,
        admin_token=args.admin_token,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        stall_timeout=args.stall_timeout,
        shutdown_timeout=args.shutdown_timeout,
        listen=(args.host, args.port),
        worker=worker,
        decode_slots=args.decode_slots,
    )
    limits = ClientLimits(
        max_head=args.max_header_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections or default_max_connections(),
        send_timeout=args.send_timeout,
    )
    stats = ClientStats()
    router.telemetry.registry.register(stats)
    config = uvicorn.Config(
        create_app(router, options),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        http=protocol(limits, stats),
        # The router serves no WebSocket: an upgrade would hand the connection to a
        # protocol without the client limits.
        ws="none",
        # uvicorn's loggers go through ours, so --log-format applies to them too.
        log_config=None,
        timeout_keep_alive=args.idle_timeout,
        # The app fails what still runs at --shutdown-timeout; a client that does not read
        # its stream would still hold uvicorn, which waits for every connection to close.
        timeout_graceful_shutdown=args.shutdown_timeout + LINGER,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )
    _settle_heap()
    # --header-timeout 0 is no limit: the loop's own handshake timeout then (it takes no 0).
    handshake = args.header_timeout or None
    _Server(config, router, handshake).run(sockets=[sock])


def _settle_heap() -> None:
    """Keep the garbage collector to per-request garbage, in larger batches.

    Measured under streaming load (1 prefill + 2 decode sims, 64 clients): with the default
    thresholds a young-generation collection ran every ~20 requests and the collector took
    ~7% of the router's CPU; with the start-up heap frozen (it lives as long as the process)
    and a 10,000-object young generation, ~1%. The price is a few MB of garbage at most.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


# The commands, not argparse's list of every flag (21 lines): --help lists those.
USAGE = """%(prog)s --prefill URL ... --decode URL ... [options]
       %(prog)s demo [options]
       %(prog)s status [options]"""


def router_parser() -> tuple[Parser, list[argparse.Action]]:
    """``pd-router``'s own parser, and the actions that other sources can set."""
    parser = Parser(
        prog="pd-router",
        usage=USAGE,
        description="One OpenAI-compatible endpoint in front of prefill and decode engines. "
        "Every flag can also be set as PD_ROUTER_<FLAG> (e.g. PD_ROUTER_QUEUE_TIMEOUT) or in "
        "a TOML file (queue_timeout = 30); the command line wins, then the environment, "
        "then the file. "
        "`pd-router demo` runs the router in front of simulated engines on loopback; "
        "`pd-router status` shows a running router's nodes.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    return parser, add_router_flags(parser)


def _version() -> str:
    try:
        return metadata.version("pd-router")
    except metadata.PackageNotFoundError:
        return "(not installed)"

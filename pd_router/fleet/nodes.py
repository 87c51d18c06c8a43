"""Engine nodes: identity, state and health bookkeeping, and how they are named on the CLI.

No I/O here: the prober, the relay and the stall watch report what they saw, and a node's
state follows from it by the rules below. Slow is not dead: two verdicts, two consequences.

* ``joining``: found through DNS (``discovery/rules.py``) and not yet answered a probe: picked
  by nothing until its first good probe makes it serving; failures leave it joining.
* ``serving``: picked for new requests. ``unhealthy``: no new requests (unless no node at
  all is serving, see ``fleet/pool.py``), and what runs on it continues. ``draining``: keeps its
  in-flight requests, gets no new ones. ``dead``: picked by nothing; its requests have been
  failed, except the one that found it dead, which handles its own error.
* Evidence decides which. *Soft* failures (a probe that timed out or answered non-200, a
  5xx answer, a connect timeout, a failed TLS handshake) make a node unhealthy after
  ``unhealthy_after`` in a row, never dead. *Hard* failures (the engine reset or broke a
  connection, sent invalid HTTP, or refused a probe) make it dead after
  ``unhealthy_after`` in a row; a real request
  refused (*fatal*) makes it dead at once. A request timeout is the request's own outcome
  and no failure of the node's (a long answer is not a failure), but a prefill's, one
  token, is a soft one, and holds the node out as a stall does; a 4xx answer, a client
  hang-up or a request the router cancelled is none.
* A stall (every started stream on the node silent for ``--stall-timeout`` while nothing
  else says it is dead) makes it unhealthy and holds it there for ``hold`` seconds: its
  ``/health`` still answers 200, so only time can show it serves again.
* An unhealthy or dead node is readmitted after ``healthy_after`` good probes in a row
  (and not before its hold ends), afresh. A real request that succeeds resets the failure
  streaks; a good probe only the probes' part of them: an engine whose ``/health`` answers
  while its requests fail still goes unhealthy (or dead) on what the requests saw.
* A draining node gets no verdict: it takes no new work anyway, and what it holds is let
  finish (an engine shutting down gracefully refuses probes while it completes them).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal
from urllib.parse import urlsplit

from pd_router.errors import Evidence

Role = Literal["prefill", "decode"]


class State(str, Enum):
    JOINING = "joining"
    SERVING = "serving"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    DEAD = "dead"


@dataclass(frozen=True)
class Failure:
    """What was seen: ``kind`` is a short name from a fixed set (a metric label: "probe
    timeout", "refused", "stalled"...), ``message`` the whole story."""

    kind: str
    message: str
    evidence: Evidence


@dataclass(frozen=True)
class HealthPolicy:
    unhealthy_after: int = 3
    healthy_after: int = 2


@dataclass(eq=False)
class Node:
    """One engine. ``id`` is stable for the life of the process: nothing renumbers it."""

    id: int
    url: str
    slots: int
    role: Role = "decode"
    # Owned by the pool: how many of ``slots`` are reserved right now.
    in_use: int = 0
    state: State = State.SERVING
    # Failures in a row (any), hard ones in a row, good probes in a row.
    failures: int = 0
    hard_failures: int = 0
    # Of those, what real requests saw: a good probe ends only the probes' part of the
    # streak (an engine whose /health answers while every generation fails is not well),
    # a real request that succeeds ends all of it.
    request_failures: int = 0
    request_hard_failures: int = 0
    successes: int = 0
    last_error: str | None = None
    # Why the node is not serving, from a fixed set ("probe timeout", "stalled", "refused"...);
    # None while it serves. ``last_error`` has the details.
    reason: str | None = None
    # A stalled node is not readmitted before this (monotonic seconds).
    hold_until: float = 0.0
    # What a draining node was before its drain: what undoing the drain gives it back (its
    # health is the evidence's, never the drain's).
    drained_from: State | None = None
    # And its reason then (the evidence behind an unhealthy or dead node's state).
    drained_reason: str | None = None
    # Request ids bound to this node right now (the fleet keeps this in step).
    bound: set[str] = field(default_factory=set)
    # The operator's own tags (zone, GPU type...): shown, never used to route.
    labels: dict[str, str] = field(default_factory=dict)
    # Where the node came from: "static" (the settings), "admin" (POST /admin/nodes) or the
    # DNS name that lists it ("dns:vllm-decode:8200").
    source: str = "static"
    # The models the engine serves, from its /v1/models (``fleet/models.py``); None until known,
    # and a node whose models are not known is taken to serve any.
    models: frozenset[str] | None = None
    # Their objects as the engine listed them (bounded, ``fleet/models.py``), by id: what
    # the router's ``GET /v1/models`` answers with. None until known.
    cards: dict[str, dict[str, Any]] | None = None

    @property
    def free(self) -> int:
        return self.slots - self.in_use

    @property
    def serving(self) -> bool:
        return self.state is State.SERVING

    def serves(self, model: str | None) -> bool:
        """Whether a request for ``model`` (None: no model asked) may land here."""
        return model is None or self.models is None or model in self.models

    def failed(self, failure: Failure, policy: HealthPolicy, probe: bool = False) -> State | None:
        """Count a failure (``probe``: a health probe's, else a real request's); the node's
        new state when this changed it."""
        hard = failure.evidence is not Evidence.SOFT
        self.failures += 1
        self.hard_failures += hard
        if not probe:
            self.request_failures += 1
            self.request_hard_failures += hard
        self.successes = 0
        self.last_error = failure.message
        if self.state is State.JOINING:
            self.reason = failure.kind  # why it still does not serve: no longer unprobed
        if self.state in (State.DEAD, State.JOINING, State.DRAINING):
            # A draining node takes no new work whatever its health, and what it holds is
            # let finish: an engine shutting down gracefully (a pod scaled down) refuses
            # probes while it completes its requests, and a request whose engine did die
            # learns it from its own connection. So no verdict: none that fails its
            # requests, none that a good probe would turn back into serving.
            return None
        if failure.evidence is Evidence.FATAL or self.hard_failures >= policy.unhealthy_after:
            return self._become(State.DEAD, failure.kind)
        if self.state is State.SERVING and self.failures >= policy.unhealthy_after:
            return self._become(State.UNHEALTHY, failure.kind)
        return None

    def stalled(self, seconds: float, hold_until: float) -> bool:
        """Every started stream went silent: True when this made the node unhealthy."""
        self.last_error = f"stalled {seconds:.0f} s: no byte from any of its started streams"
        self.hold_until = max(self.hold_until, hold_until)
        self.successes = 0
        if self.state is not State.SERVING:
            return False
        self._become(State.UNHEALTHY, "stalled")
        return True

    def served(self) -> None:
        """A real request succeeded: the failure streaks end (readmission is the prober's)."""
        self.failures = self.hard_failures = 0
        self.request_failures = self.request_hard_failures = 0

    def probed(self, policy: HealthPolicy, now: float) -> bool:
        """A good probe; True when this admitted a joining node or readmitted an unhealthy
        or dead one (which starts it afresh)."""
        self.failures, self.hard_failures = self.request_failures, self.request_hard_failures
        self.successes += 1
        if self.state is State.JOINING:
            # Never seen serving: nothing to be wary of, one good answer is enough.
            self.served()
            self._become(State.SERVING, None)
            return True
        if self.state not in (State.UNHEALTHY, State.DEAD):
            return False
        if self.successes < policy.healthy_after or now < self.hold_until:
            return False
        self.served()
        self._become(State.SERVING, None)
        return True

    def _become(self, state: State, reason: str | None) -> State:
        self.state = state
        self.reason = reason
        return state


@dataclass(frozen=True)
class NodeSpec:
    """A node as configured, before it has an id: URL (normalised), slots, labels."""

    url: str
    # None: the role's default (``--decode-slots``), which may come from another source.
    slots: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


# A host name as resolvers take it: labels of 1-63 letters, digits, "-" (not first or
# last) and "_" (SRV-style names), 253 characters in all; an IPv4 address is one too.
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")

# Shown as ``key=value,...`` (status table, logs): a key cannot hold "=", "," or spaces.
_LABEL_KEY = re.compile(r"[A-Za-z0-9_./-]+")


def check_labels(labels: object) -> dict[str, str]:
    """A node's labels, as given in a config file or to the admin API: strings to strings;
    ``kv_events`` and ``bootstrap_port`` port numbers (``PORT_LABELS``: the router reads
    them)."""
    if not isinstance(labels, Mapping):
        raise ValueError("labels must be a table of names to strings")
    checked = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key):
            raise ValueError(f"label name {key!r}: use letters, digits and _ . / - only")
        if not isinstance(value, str):
            raise ValueError(f"label {key!r} must be a string, got {value!r}")
        checked[key] = str(parse_port(value, key, key)) if key in PORT_LABELS else value
    return checked


# Sequences a node may take at once: far above any engine's (vLLM's --max-num-seqs is
# hundreds), and below what the shared pool's scripts count in (10^15 was accepted, and
# with --state no request could use the node).
MAX_SLOTS = 1_000_000
# Digits of a number an operator writes (``whole``): more than any port, count or id.
MAX_DIGITS = 18

# The label naming the port an engine publishes its KV cache events on (vLLM's
# ``--kv-events-config`` ZMQ endpoint), on the host of its URL: ``,kv_events=5557``.
KV_EVENTS = "kv_events"
# The label naming a prefill engine's bootstrap port, on the host of its URL (SGLang's
# ``--disaggregation-bootstrap-port``), when it is not the router's ``--bootstrap-port``.
BOOTSTRAP_PORT = "bootstrap_port"
# Labels whose value is a port number, checked wherever a label is given.
PORT_LABELS = (KV_EVENTS, BOOTSTRAP_PORT)


def parse_spec(spec: str) -> NodeSpec:
    """``URL``, ``URL,slots=N``, ``URL,kv_events=PORT``, ``URL,bootstrap_port=PORT`` ->
    NodeSpec.

    A comma is shell-safe and cannot appear in a host:port URL, so it separates options
    without quoting.
    """
    url, _, options = spec.partition(",")
    slots = None
    labels = {}
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        key = key.strip()
        if key in PORT_LABELS:
            labels[key] = str(parse_port(value, spec, key))
            continue
        if key != "slots":
            known = ", ".join(("slots", *PORT_LABELS))
            raise ValueError(f"{spec!r}: unknown node option {key!r} (known: {known})")
        slots = parse_slots(value, spec)
    return NodeSpec(normalise_url(url, spec), slots, labels)


def whole(text: str) -> int | None:
    """``text`` as a whole number, if it is ASCII digits only and at most ``MAX_DIGITS`` of
    them (a port, a count of slots, a node id, a flag's number as an operator writes it);
    else None. int() also reads "1_0", " 8", "+8" and other scripts' digits, str.isdigit()
    passes "²" (which int() refuses), and int() refuses over 4,300 digits with a
    ValueError no caller expected: an admin path's node id of 5,000 digits was a 500."""
    if text.isascii() and text.isdigit() and len(text) <= MAX_DIGITS:
        return int(text)
    return None


def parse_port(value: str, spec: str, name: str = KV_EVENTS) -> int:
    """The ``PORT`` of a ``NAME=PORT`` option of ``spec`` (``PORT_LABELS``)."""
    port = whole(value) or 0
    if not 0 < port < 65536:
        raise ValueError(f"{spec!r}: {name} must be a port number, got {value!r}")
    return port


def parse_slots(value: str, spec: str) -> int:
    """The ``N`` of a ``slots=N`` option of ``spec``."""
    slots = whole(value)
    if slots is None:
        raise ValueError(f"{spec!r}: slots must be a whole number, got {value!r}")
    return checked_slots(slots, spec)


def checked_slots(slots: int, spec: str) -> int:
    """``slots`` of ``spec``, if in range (1 to ``MAX_SLOTS``), wherever it was given."""
    if slots < 1:
        raise ValueError(f"{spec!r}: slots must be at least 1")
    if slots > MAX_SLOTS:
        raise ValueError(f"{spec!r}: slots must be at most {MAX_SLOTS}")
    return slots


_USERINFO = re.compile(r"//[^/@]*@")
DEFAULT_PORTS = {"http": 80, "https": 443}


def normalise_url(url: str, spec: str | None = None) -> str:
    """The canonical ``http(s)://host[:port][/path]`` of an engine: a node's identity, with
    its role. Anything else is refused.

    Canonical: scheme and host lower-cased, an IPv6 address in its short form
    (``[0:0::1]`` is ``[::1]``), the port without leading zeros and left out when it is the
    scheme's default (``http://e:80`` is ``http://e``), no trailing slash. A name is not
    resolved: ``localhost`` and ``127.0.0.1`` are two spellings the router cannot tell are
    one engine (a name may list several addresses, and change).

    Refused: non-ASCII, spaces and control characters (they would be sent in a request
    line), a port outside 1-65535, credentials (they would show in logs and metrics), a
    query or a fragment (the router appends the API's paths).
    """
    # Credentials are refused, and not even the refusal may print them.
    shown = _USERINFO.sub("//***@", url if spec is None else spec)
    text = url.strip()
    if not text.isascii() or not text.isprintable() or any(c.isspace() for c in text):
        raise ValueError(f"{shown!r}: a URL must be ASCII, with no spaces or control characters")
    expected = f"{shown!r}: expected an http(s)://host:port URL"
    try:
        parts = urlsplit(text)
        host = parts.hostname
    except ValueError:  # a bracketed host that is no IPv6 address
        raise ValueError(expected) from None
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(expected)
    if "@" in parts.netloc:
        raise ValueError(f"{shown!r}: credentials in an engine URL are not supported")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"{shown!r}: the port must be a whole number from 1 to 65535")
    if parts.query or parts.fragment:
        raise ValueError(f"{shown!r}: an engine URL takes no query or fragment")
    if ":" in host:
        with contextlib.suppress(ValueError):  # a zone (fe80::1%eth0) stays as written
            host = ipaddress.IPv6Address(host).compressed
        host = f"[{host}]"
    elif not _HOSTNAME.fullmatch(host):
        # No name a resolver takes ("a..b", a label over 63 characters): every probe would
        # fail inside the name's encoding, not reach an engine.
        raise ValueError(f"{shown!r}: {host!r} is no host name or address")
    if port is not None and port != DEFAULT_PORTS[parts.scheme]:
        host = f"{host}:{port}"
    return f"{parts.scheme}://{host}{parts.path.rstrip('/')}"


def parse_node(spec: str, default_slots: int) -> tuple[str, int]:
    """``URL`` or ``URL,slots=N`` -> (normalised URL, slots)."""
    node = parse_spec(spec)
    slots = default_slots if node.slots is None else node.slots
    if slots < 1:
        raise ValueError(f"{spec!r}: slots must be at least 1")
    return node.url, slots


def make_nodes(
    specs: Sequence[str | NodeSpec], default_slots: int, role: Role = "decode", first_id: int = 0
) -> list[Node]:
    """Nodes numbered from ``first_id``; strings are parsed as on the command line."""
    nodes = []
    for index, spec in enumerate(specs):
        node = parse_spec(spec) if isinstance(spec, str) else spec
        slots = default_slots if node.slots is None else node.slots
        if slots < 1:
            raise ValueError(f"{node.url!r}: slots must be at least 1")
        nodes.append(
            Node(
                id=first_id + index, url=node.url, slots=slots, role=role, labels=dict(node.labels)
            )
        )
    return nodes


def usable(nodes: Sequence[Node]) -> tuple[State, ...]:
    """The states new requests may land on: serving ones; unhealthy ones too while none is
    serving, as a slow engine serves better than a 503 (Envoy's "panic" routing)."""
    if any(node.state is State.SERVING for node in nodes):
        return (State.SERVING,)
    return (State.SERVING, State.UNHEALTHY)


# Models whose usable states are kept between refreshes (``usable_for``), at most.
MODEL_CACHE = 64


def usable_for(
    nodes: Sequence[Node], model: str, cache: dict[str, tuple[State, ...]]
) -> tuple[State, ...]:
    """``usable`` over the nodes serving ``model``: the unhealthy fallback is per model.
    Kept in ``cache``, which its owner empties whenever a node's state or models change."""
    found = cache.get(model)
    if found is None:
        found = usable([node for node in nodes if node.serves(model)])
        if len(cache) < MODEL_CACHE:
            cache[model] = found
    return found

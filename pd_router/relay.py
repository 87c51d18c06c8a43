"""One request, top to bottom: reserve a decode slot -> prefill -> decode -> stream back.

The relay is the request's ASGI response, so the one cleanup point is its own ``__call__``:
the slot, the bindings and every upstream connection are released there, in every exit
path, including a client that left before the first byte (a body generator's ``finally``
would not run). The client gets exactly one terminal outcome, sent from there too.

Cancellation contract:

* uvicorn never cancels the app when a client leaves; the router's client protocol tells
  the request's ``Departure`` (``edge/protocol.py``), which cancels the relay (another ASGI
  server: a watcher task reads ``receive()`` for the ``http.disconnect``). Queued: the
  waiter leaves the queue at once. Decode streaming: the upstream connection is closed,
  so the engine aborts. The ASGI server also reports ``http.disconnect`` once the
  response is complete; that is how the watcher ends, so it needs no task group and no
  cancellation.
* From the prefill request to the decode engine having the KV (a non-streamed answer's
  headers, a streamed answer's first bytes, since vLLM sends a stream's headers before it
  pulls the blocks) the relay is shielded: the prefill engine pins the KV as it answers
  and holds it until a decode engine pulls it or a lease runs out, so a client leaving
  there must not strand it (closing the prefill connection cannot tell an engine that
  has just answered). Once the client left, the engines get ``handoff_grace`` in all:
  a prefill answered in time goes on to a one-token "drain" decode request that pulls
  the KV; one not answered in time is closed, and the engine aborts.
* ``fail(error)`` (a node died, an operator aborted, shutdown ran out of time) cancels the
  relay from outside, shield included; ``error`` becomes the client's terminal outcome.
* A started stream is poured: the engine's events go to the client from the engine
  connection's callback while the relay waits for the stream's end (``_Pour``). A client
  gone or a ``fail`` stops the pour at once, before the cancellation reaches the relay:
  nothing more is written, then the terminal outcome as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from starlette.types import Receive, Scope, Send

from pd_router.discovery.rules import Discovery
from pd_router.edge import hops
from pd_router.edge.auth import Key
from pd_router.edge.keyfile import KeyFile
from pd_router.edge.protocol import DEPARTURE, WIRE, Departure
from pd_router.edge.stream import ClientStream
from pd_router.edge.validation import PATHS, Endpoint
from pd_router.engines import bootstrap, handshake
from pd_router.engines.client import Response, Upstream, streamed_error
from pd_router.engines.sse import EventRelay, with_usage_fixed
from pd_router.errors import (
    Evidence,
    InternalError,
    RouterError,
    ShuttingDown,
    Unavailable,
    UpstreamError,
    detached,
)
from pd_router.fleet import models
from pd_router.fleet.holdings import Prompt, describe
from pd_router.fleet.keys import KeyLimits
from pd_router.fleet.nodes import Failure, Node
from pd_router.fleet.pool import Reservation
from pd_router.fleet.prefill import Placement, prefix_key
from pd_router.fleet.registry import Binding, Fleet
from pd_router.ops import logs
from pd_router.ops.metrics import Telemetry, Timings

if TYPE_CHECKING:
    from pd_router.ops.spans import RequestTrace, Tracer

log = logging.getLogger("pd_router")
# The fields of a request line, in order (``Relay._report``, ``refused_line``).
LINE_FIELDS = (
    "request_id", "key", "endpoint", "model", "outcome", "status", "stream", "prefill_node",
    "prefix_hit", "predicted_cached", "cache_source", "local_prefill", "decode_node",
    "queued_s", "prefill_s", "ttft_s", "duration_s", "bytes",
)  # fmt: skip

# Seconds a decode engine has, after its stream's [DONE], to end its body: vLLM ends it in
# the same write. The request ends then either way.
AFTER_DONE = 1.0

# The decode engine's answer once it has taken the KV, and the bytes read to know it.
Handed = tuple[Response, bytes]


@dataclass
class Settings:
    queue_timeout: float = 0.0
    handoff_grace: float = 5.0
    # A prompt with at most this many tokens not predicted cached on its decode node is
    # computed there (no prefill engine); 0: always disaggregate.
    max_local_prefill: int = 0
    # The engines' P/D dialect: "vllm" (the prefill answers kv_transfer_params, the decode
    # pulls) or "sglang" (both get one request at once, the KV goes by its bootstrap room).
    dialect: str = "vllm"
    # SGLang: a prefill engine's bootstrap port, unless its node's label says another.
    bootstrap_port: int = bootstrap.DEFAULT_PORT


@dataclass
class Router:
    """What every request shares."""

    fleet: Fleet
    upstream: Upstream
    settings: Settings = field(default_factory=Settings)
    shutting_down: bool = False
    telemetry: Telemetry = field(init=False)
    # Set by the app's lifespan (an event needs a running loop); SIGTERM sets it.
    stopping: anyio.Event | None = None
    # The names nodes are discovered by (--prefill-dns, --decode-dns), if any.
    discovery: Discovery | None = None
    # The client keys (--api-keys-file): None, every client may use the fleet.
    keys: KeyFile | None = None
    # Requests in flight per key, for keys with a max_in_flight (the fleet's with --state).
    key_limits: KeyLimits = field(default_factory=KeyLimits)
    # What this router adds to the marks of what it sends to engines (``edge/hops.py``);
    # one for all its --workers.
    mark: str = field(default_factory=hops.new_mark)
    # Set where the router serves when tracing is on (``ops/tracing.py``); None: off, and
    # then no request does any tracing work.
    tracer: Tracer | None = None

    def begin_shutdown(self) -> None:
        """New requests get 503 from now on; queued waiters are told at once."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self.fleet.pool.fail_waiters(ShuttingDown("router shutting down"))
        if self.stopping is not None:
            self.stopping.set()

    def __post_init__(self) -> None:
        self.telemetry = Telemetry(self.fleet, self.discovery, keys=self.keys is not None)
        self.upstream.mark = self.mark.encode()


class Relay:
    # The decode slot held, set as soon as it is reserved (``_run``).
    _reservation: Reservation

    def __init__(
        self,
        router: Router,
        endpoint: Endpoint,
        body: dict[str, Any],
        request_id: str,
        via: bytes = b"",
        trace: RequestTrace | None = None,
        key: Key | None = None,
    ) -> None:
        """``via``: the marks of the routers it passed through, this one's last
        (``edge/hops.py``), sent to the engines."""
        self.router = router
        self.via = via
        # The client's key (--api-keys-file); its name, never the key, is what is shown.
        self.key = key
        self.key_name = "" if key is None else key.name
        self.endpoint = endpoint
        self.path = PATHS[endpoint]
        self.body = body
        # Validated: a non-empty string (``edge/validation.py``).
        self.model: str = body["model"]
        # SGLang's dialect: the sequences a batch asks for, one room each (bounded here,
        # before anything is admitted).
        self._sequences = (
            bootstrap.sequences(body, endpoint == "chat")
            if router.settings.dialect == "sglang"
            else None
        )
        self.request_id = router.fleet.admit(request_id, self)
        self.stream = bool(body.get("stream"))
        self.client_gone = False
        self.outcome = "rejected_busy"
        self.client = ClientStream(self.request_id)
        self._failure: RouterError | None = None
        self._scope: anyio.CancelScope | None = None
        self._handoff: anyio.CancelScope | None = None
        self._open: list[Response] = []
        self._arrived = time.perf_counter()
        self._queued: float | None = None
        self._prefill_seconds: float | None = None
        self._prefill_node: Node | None = None
        # Whether the prefill went where this prefix went last time (``RecentPrefixes``).
        self._prefix_hit: bool | None = None
        # Prompt tokens predicted cached where the prompt is computed (the cost policy's
        # prefill node, or the decode node of a local prefill).
        self._predicted_cached: int | None = None
        # Computed by the decode engine itself (``--max-local-prefill``).
        self._local = False
        # The decode node whose holdings made the prompt short enough to compute there
        # (``_computes_locally``): a request moved to another node decides again.
        self._local_on: Node | None = None
        # What ``_predicted_cached`` came from: "prediction" or "events".
        self._cache_source = "prediction"
        self._decode_node: Node | None = None
        # The engine's error event passed on in a stream the client has whole.
        self._passed_on: UpstreamError | None = None
        self.trace = trace

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = self.client
        extensions = scope.get("extensions") or {}
        client.attach(send, extensions.get(WIRE))
        error: RouterError | None = None
        departure: Departure | None = extensions.get(DEPARTURE)
        try:
            with anyio.CancelScope() as self._scope:
                if departure is None:
                    _spawn_watcher(self._watch, receive)
                else:
                    departure.on_leave(self._client_left)
                try:
                    await self._run(client)
                except RouterError as exc:
                    error = detached(exc)
                except Exception:
                    log.exception("request %s failed inside the router", self.request_id)
                    error = InternalError("internal router error")
            error = self._failure or error
            if client.answered:
                # Whatever happened after (the engine died as its stream ended), the
                # request was served, unless the engine said in it that it failed.
                passed_on = self._passed_on
                self.outcome = "ok" if passed_on is None else passed_on.outcome or "decode_error"
                error = passed_on or error
            elif error is not None and not self.client_gone:
                # (A client that left gets nothing: its outcome is its leaving, below.)
                self.outcome = error.outcome or self.outcome
                await client.fail(error)
        finally:
            # The server also reports a disconnect once a response is complete: only a
            # client that left before its answer was finished abandoned the request.
            if self.client_gone and not client.finished:
                self.outcome = "client_aborted"
            if departure is not None:
                departure.on_leave(None)
            self.router.fleet.leave(self.request_id)
            self._report(error)

    def _report(self, error: RouterError | None) -> None:
        client = self.client
        now = time.perf_counter()
        # Time to the first byte of an answer; an error body is not a first token.
        first = client.first_byte_at
        ttft = first - self._arrived if first is not None and client.status == 200 else None
        telemetry = self.router.telemetry
        telemetry.count(self.endpoint, self.outcome, self.key_name)
        telemetry.observe(Timings(self._queued, self._prefill_seconds, ttft, now - self._arrived))
        if self._predicted_cached is not None:
            telemetry.placed(self._local, self._cache_source, self._predicted_cached)
        model = self.model[: models.MAX_ID]
        fields = {
            "request_id": self.request_id,
            "key": self.key_name or None,
            "endpoint": self.endpoint,
            "model": model,
            "outcome": self.outcome,
            "status": client.status,
            "stream": self.stream,
            "prefill_node": _id(self._prefill_node),
            "prefix_hit": self._prefix_hit,
            "predicted_cached": self._predicted_cached,
            "cache_source": self._cache_source if self._predicted_cached is not None else None,
            "local_prefill": self._local,
            "decode_node": _id(self._decode_node),
            "queued_s": _rounded(self._queued),
            "prefill_s": _rounded(self._prefill_seconds),
            "ttft_s": _rounded(ttft),
            "duration_s": _rounded(now - self._arrived),
            "bytes": client.bytes_sent,
        }
        trace = self.trace
        if trace is not None:
            fields["trace_id"] = trace.trace_id
            trace.finish(
                self.request_id, self.outcome, client.status, error, ttft, model, self.stream
            )
        logs.request_finished(fields)

    def view(self, now: float) -> dict[str, Any]:
        """Where the request is now, for ``GET /admin/requests`` (``now``: ``perf_counter``):
        ``queued`` for a decode slot (or its key's share of them), in ``prefill``, with the
        ``decode`` engine (computing it, or the KV handed over and no byte of the answer
        yet), or ``answering`` (the client's answer has begun)."""
        if self.client.started:
            phase = "answering"
        elif self._decode_node is None:
            phase = "queued"
        elif self._prefill_seconds is None and not self._local:
            phase = "prefill"
        else:
            phase = "decode"
        return {
            "id": self.request_id,
            "key": self.key_name or None,
            "endpoint": self.endpoint,
            "model": self.model[: models.MAX_ID],
            "stream": self.stream,
            "phase": phase,
            "age_s": _rounded(now - self._arrived),
            "prefill_node": _id(self._prefill_node),
            "decode_node": _id(self._decode_node),
            "bytes_sent": self.client.bytes_sent,
        }

    def fail(self, error: RouterError) -> None:
        if self._failure is not None or self.client.finished:
            return
        self._failure = error
        if self._handoff is not None:
            self._handoff.cancel()
        if self._scope is not None:
            self._scope.cancel()

    def close_upstream(self) -> None:
        """Close every engine connection of this request now (the engines abort)."""
        for response in self._open:
            response.close()

    async def _watch(self, receive: Receive) -> None:
        """Reads ``receive()`` until the disconnect the ASGI server reports once the client
        left or the response is complete, whichever comes first; so it ends by itself."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_left(anyio.current_time())

    def _client_left(self, now: float) -> None:
        """The client left at ``now`` (the event loop's clock, as anyio's deadlines)."""
        if self.client.finished:
            return
        self.client_gone = True
        if self._handoff is not None:
            self._handoff.deadline = min(
                self._handoff.deadline, now + self.router.settings.handoff_grace
            )
        if self._scope is not None:
            self._scope.cancel()

    async def _run(self, client: ClientStream) -> None:
        router = self.router
        fleet = router.fleet
        # Unwound in reverse: engine connections closed, binding removed, slot released.
        # ``reserve`` puts the reservation inside the ``try`` that releases it (fleet/pool.py).
        models.check(self.model, fleet.offer)
        limit = None if self.key is None else self.key.max_in_flight
        if limit is None:
            await self._reserve(client)
            return
        await router.key_limits.enter(self.key_name, limit)
        try:
            await self._reserve(client)
        finally:
            router.key_limits.leave(self.key_name)

    async def _reserve(self, client: ClientStream) -> None:
        router = self.router
        fleet = router.fleet
        trace = self.trace
        if trace is not None:
            trace.queue()
        async with fleet.pool.reserve(router.settings.queue_timeout, self.model) as reservation:
            self._reservation = reservation
            try:
                self._queued = time.perf_counter() - self._arrived
                self._decode_node = reservation.node
                if trace is not None:
                    trace.reserved(reservation.node)
                if reservation.waited > 0.1:
                    log.info(
                        "queued %.1fs for decode node %s request_id=%s",
                        reservation.waited,
                        reservation.node.url,
                        self.request_id,
                    )
                with fleet.bind(self, reservation.node) as binding:
                    try:
                        await self._serve(client, binding)
                    finally:
                        self.close_upstream()
            finally:
                # ``_decode`` may have moved the request to another node's slot.
                self._reservation.release()

    async def _serve(self, client: ClientStream, binding: Binding) -> None:
        self.outcome = "prefill_error"
        fleet = self.router.fleet
        limit = self.router.settings.max_local_prefill
        prompt = None
        if fleet.prefill.reads_prompt or limit > 0:
            prompt = describe(self.body, fleet.kv.ratio)
        if self.router.settings.dialect == "sglang":
            await self._serve_bootstrapped(client, binding, prompt)
            return
        if not handshake.hands_over(self.body):
            # Several sequences, beam search, required tool calls (``hands_over``): the
            # decode engine computes the request whole, as one engine alone would.
            self._local = True
            prefilled = handshake.Prefilled.local()
        else:
            computed = await self._computed(binding, prompt)
            if computed is None:
                return
            prefilled = computed
        await self._hand_over(client, binding, prefilled, prompt)

    async def _serve_bootstrapped(
        self, client: ClientStream, binding: Binding, prompt: Prompt | None
    ) -> None:
        """SGLang's dialect: one request to a prefill engine and to the decode engine at
        once (``engines/bootstrap.py``). The prefill engine answers once the KV has gone
        (after the decode engine's answer began, as often as not), so the decode engine's
        answer is relayed meanwhile, and not waited for once that answer is whole. A
        prefill that fails before the client's answer began fails the attempt at once
        (the decode engine would wait for KV that never comes, until its own timeout):
        an engine's fault is tried once more, as in vLLM's dialect, on another prefill
        node, with a new room, the decode engine's first request closed."""
        prefill = self.router.fleet.prefill
        key = prefix_key(self.body)
        chooses = prompt if prefill.reads_prompt else None
        first = prefill.pick(key, model=self.model, prompt=chooses)
        if first is None:
            raise Unavailable("no live prefill node")
        failure = await self._bootstrapped_on(first, client, binding, key, prompt)
        if failure is None:
            return
        # A silence is no engine's known fault (``_unhanded``): not tried again.
        silent = failure.kind == "timeout"
        second = None if silent else self._next_prefill(first, failure, key, chooses)
        if second is None:
            raise failure
        failure = await self._bootstrapped_on(second, client, binding, key, prompt)
        if failure is not None:
            raise failure

    async def _bootstrapped_on(
        self,
        node: Node,
        client: ClientStream,
        binding: Binding,
        key: int,
        prompt: Prompt | None,
    ) -> UpstreamError | None:
        """One attempt of ``_serve_bootstrapped`` with the prefill engine of ``node``: the
        prefill engine's failure before the client's answer began, if it failed so."""
        fleet = self.router.fleet
        self.outcome = "prefill_error"
        sent = bootstrap.request(
            self.body,
            bootstrap.host_of(node.url),
            bootstrap.port(node.labels, self.router.settings.bootstrap_port),
            self._sequences,
        )
        failed: list[UpstreamError] = []
        placed = [self._place(node, binding, key, prompt)]

        def prefilled() -> None:
            """The prefill ended, however it did: once, in the task or (a task cancelled
            before it ran) after it."""
            if placed:
                fleet.prefill.release(placed.pop())
                fleet.set_prefill(binding, None)
                if self.trace is not None:
                    self.trace.beside_ended()

        url = node.url + self.path
        headers = b"" if self.trace is None else self.trace.beside(node, url, placed[0].hit)
        handed = handshake.Prefilled.bootstrapped(sent)
        error: Exception | None = None
        try:
            async with anyio.create_task_group() as beside:
                beside.start_soon(
                    self._prefill_beside,
                    node,
                    (url, headers, sent),
                    prompt,
                    prefilled,
                    beside.cancel_scope,
                    failed,
                )
                del sent  # the task's and ``handed``'s: let go once the engines have it
                try:
                    await self._hand_over(client, binding, handed, prompt)
                except Exception as exc:
                    # Raised past the task group as it is: the group would wrap it in an
                    # ExceptionGroup, which no RouterError handler takes (a 500).
                    error = exc
                    if _silent(exc) and not client.started:
                        failed.append(self._unhanded(node, self._decode_node))
                        error = None
                # The decode engine's answer is whole, or failed: the prefill engine's is not
                # needed.
                beside.cancel_scope.cancel()
        finally:
            prefilled()
        if failed:
            # First: what the decode engine did after its prefill failed (timed out waiting
            # for the KV, in the same tick) is what the prefill's failure caused. Its
            # request, waiting for KV that never comes, is closed.
            self.close_upstream()
            self.outcome = "prefill_error"
            return failed[0]
        if error is not None:
            raise error
        if self.outcome == "ok":
            # The decode engine answered from the KV the prefill engine computed: its
            # success, whether or not its own answer came before the decode's ended.
            fleet.served(node)
        return None

    def _blamed(self, prefill: Node, error: UpstreamError) -> UpstreamError:
        """SGLang's prefill engine's failure as the client is told it, counted against its
        node unless it is a silence before the answer began (``_unhanded``)."""
        if _silent(error) and not self.client.started:
            return self._unhanded(prefill, self._decode_node)
        return self._engine_failed(prefill, error)

    def _unhanded(self, prefill: Node, decode: Node | None) -> UpstreamError:
        """SGLang's dialect: no KV went from the prefill engine to the decode engine within
        the read timeout, both silent. Whose fault is not known: the prefill engine waits
        for a decode engine to take its room (one whose memory is full takes none), the
        decode engine for the prefill's KV (a prefill engine behind in its queue sends
        none). Nothing is said against either node, and no other prefill node is tried."""
        seconds = self.router.upstream.read_timeout
        to = "a decode engine" if decode is None else f"decode engine {decode.url}"
        message = f"no KV went from prefill engine {prefill.url} to {to} within {seconds:g} s"
        return UpstreamError(message, status=504, code="timeout", kind="timeout")

    async def _prefill_beside(
        self,
        node: Node,
        request: tuple[str, bytes, dict[str, Any]],
        prompt: Prompt | None,
        ended: Callable[[], None],
        beside: anyio.CancelScope,
        failed: list[UpstreamError],
    ) -> None:
        """SGLang's prefill request (url, headers, body), sent beside the decode engine's,
        and its answer read to its end (the connection goes back to the pool); ``ended``
        once it did or failed. A failure is told in ``failed``, and ends the request, if
        the client's answer has not begun."""
        fleet = self.router.fleet
        url, headers, sent = request
        del request
        started = time.perf_counter()
        try:
            try:
                answer = await self._send(node, url, sent, headers, self._blamed)
            finally:
                del sent  # written: not held while the answer streams
            try:
                if answer.status != 200:
                    raise await answer.error()
                raw = await answer.read()
            except UpstreamError as error:
                raise self._blamed(node, error) from None
            finally:
                self._open.remove(answer)
                answer.close()
        except UpstreamError as error:
            if not self.client.started:
                failed.append(error)
                beside.cancel()
            return
        finally:
            ended()
        self._prefill_seconds = time.perf_counter() - started
        fleet.served(node)
        if prompt is not None and raw.startswith(b"{"):  # not a streamed answer (SSE)
            with contextlib.suppress(orjson.JSONDecodeError):
                usage = orjson.loads(raw).get("usage")
                if isinstance(usage, dict):
                    fleet.kv.calibrate(prompt, usage.get("prompt_tokens"))

    async def _hand_over(
        self,
        client: ClientStream,
        binding: Binding,
        prefilled: handshake.Prefilled,
        prompt: Prompt | None,
    ) -> None:
        """The decode engine's part: the hand-off, then its answer relayed to the client."""
        fleet = self.router.fleet
        self.outcome = "decode_error"
        handed = await self._decode(binding, prefilled, prompt)
        if handed is None:
            return
        (answer, first), prefilled = handed
        node = binding.decode
        if 400 <= answer.status < 500 and prefilled.pins:
            await self._drain(node, prefilled)  # the client gone or not
        if self.client_gone:
            return
        if self.router.settings.dialect != "sglang":
            # In SGLang's dialect the prefill engine may yet fail before the client's
            # answer begins, and the request go to another (``_serve_bootstrapped``):
            # there it is let go only as a streamed answer begins (``_relay_events``); a
            # whole answer is read before the client gets any of it, then the request ends.
            self._let_go(prefilled)
        try:
            if answer.status != 200:
                raise await answer.error()
            if self.stream:
                binding.stream = answer  # started: the stall watch looks at it from now on
                passed_on = await self._relay_events(client, answer, prefilled, first)
                if passed_on is not None:
                    self._passed_on = self._engine_failed(node, passed_on)
                    return
            else:
                await self._relay_json(client, answer, prefilled)
        except UpstreamError as error:
            raise self._engine_failed(node, error) from None
        finally:
            if prompt is not None and client.started:
                # The decode engine holds the prompt now, pulled or computed: its answer
                # began (not an error status, nor an error as its first event).
                fleet.kv.placed(node.id, node.role, node.url, prompt)
        self.router.fleet.served(node)
        self.outcome = "ok"

    def _let_go(self, prefilled: handshake.Prefilled) -> None:
        """The engines have all they need from the request: a long prompt is not held for
        as long as its answer streams."""
        self.body = {}
        prefilled.forget()

    async def _drain(self, node: Node, prefilled: handshake.Prefilled) -> None:
        """The decode engine refused what the prefill engine computed (a ``max_tokens`` over
        its context: the prefill asked for one token): a drain has it pull, and so free,
        the blocks pinned for it, as for a client that left, instead of their staying
        pinned until the prefill engine's lease on them ends (vLLM: 480 s), which any
        client could use to fill a prefill engine's cache. Best effort, within the hand-off
        grace (shielded from the client's leaving, as a hand-off is): the client's answer
        is the refusal, whatever the drain gives."""
        body = handshake.drain_body(self.body, prefilled.kv_transfer_params)
        with self._engine_has_it(), anyio.move_on_after(self.router.settings.handoff_grace):
            with contextlib.suppress(UpstreamError):
                drained = await self.router.upstream.post(
                    node.url + self.path, body, self.request_id, self.via, b""
                )
                self._open.append(drained)
                await drained.read()

    async def _computed(
        self, binding: Binding, prompt: Prompt | None
    ) -> handshake.Prefilled | None:
        """The prompt computed by the request's decode node itself if what it lacks there is
        short (``--max-local-prefill``), else by a prefill engine. None: the client left and
        the prefill engine did not answer within the grace."""
        limit = self.router.settings.max_local_prefill
        if prompt is not None and limit > 0 and self._computes_locally(binding.decode, prompt):
            return handshake.Prefilled.local()
        self._local = False
        started = time.perf_counter()
        prefilled = await self._prefill(binding, prompt)
        if prefilled is not None:
            self._local = prefilled.is_local  # ended at its first token: computed by decode
            self._prefill_seconds = time.perf_counter() - started
        return prefilled

    def _computes_locally(self, node: Node, prompt: Prompt, limit: float | None = None) -> bool:
        """Whether the decode node computes the prompt itself: what it does not hold is
        short enough (``limit``, else ``--max-local-prefill``) that sending it to a prefill
        engine and back would not pay."""
        if limit is None:
            limit = self.router.settings.max_local_prefill
        cached = prompt.cached(self.router.fleet.kv.of(node.id).held(prompt.chunks))
        local = prompt.tokens - cached <= limit
        self._local_on = node if local else None
        if local:
            self._local = True
            self._predicted_cached = cached
        return local

    async def _decode(
        self, binding: Binding, prefilled: handshake.Prefilled, prompt: Prompt | None
    ) -> tuple[Handed, handshake.Prefilled] | None:
        """The decode engine's answer, and what it was handed (computed anew when the
        request moved to a node that decided otherwise)."""
        first = binding.decode
        try:
            handed = await self._handoff_to(first, prefilled)
            return None if handed is None else (handed, prefilled)
        except UpstreamError as error:
            if not error.undelivered:
                raise
            unreached = detached(error)
        # Nothing reached that engine and the KV still waits on the prefill engine: any
        # other decode node with a free slot can take it, now.
        pool = self.router.fleet.pool
        self._reservation.release()
        other = await pool.acquire_now(avoid=first, model=self.model)
        if other is None:
            if not pool.live:
                raise Unavailable("no live decode node")
            raise unreached
        self._reservation = other
        self.router.fleet.set_decode(binding, other.node)
        self._decode_node = other.node
        log.warning(
            "decode node %s not reached (%s), handing over to node %s request_id=%s",
            first.id,
            unreached.message,
            other.node.id,
            self.request_id,
        )
        if self._local_on is not None and prompt is not None:
            # Short for what the first node holds; this one may hold none of it.
            self.outcome = "prefill_error"
            try:
                again = await self._computed(binding, prompt)
            except Unavailable:
                # No prefill engine to take it: this node computes it, as the first was to.
                self._computes_locally(other.node, prompt, math.inf)
                again = prefilled
            if again is None:
                return None
            prefilled = again
            self.outcome = "decode_error"
        handed = await self._handoff_to(other.node, prefilled)
        return None if handed is None else (handed, prefilled)

    async def _prefill(self, binding: Binding, prompt: Prompt | None) -> handshake.Prefilled | None:
        """Prefill on the next live node; once more on another one if that engine failed.
        None: the client left and the engine did not answer within the grace."""
        prefill = self.router.fleet.prefill
        key = prefix_key(self.body)
        # Described for ``--max-local-prefill`` alone (``prefix``): calibrated all the same.
        described, prompt = prompt, (prompt if prefill.reads_prompt else None)
        first = prefill.pick(key, model=self.model, prompt=prompt)
        if first is None:
            raise Unavailable("no live prefill node")
        try:
            return await self._prefill_on(first, binding, key, prompt, described)
        except UpstreamError as error:
            second = self._next_prefill(first, error, key, prompt)
            if second is None:
                raise
            return await self._prefill_on(second, binding, key, prompt, described)

    def _next_prefill(
        self, first: Node, failure: UpstreamError, key: int, prompt: Prompt | None
    ) -> Node | None:
        """Where a prefill that failed on ``first`` is tried once more, in either dialect: an
        engine's fault, the client still there, another live node."""
        if not failure.engine_fault or self.client_gone:
            return None
        prefill = self.router.fleet.prefill
        second = prefill.pick(key, avoid=first, model=self.model, prompt=prompt)
        if second is not None:
            log.warning(
                "prefill node %s failed (%s), retrying on node %s request_id=%s",
                first.id,
                failure.message,
                second.id,
                self.request_id,
            )
        return second

    async def _prefill_on(
        self,
        node: Node,
        binding: Binding,
        key: int,
        prompt: Prompt | None,
        described: Prompt | None,
    ) -> handshake.Prefilled | None:
        """``prompt``: for the prefill policy (None if it reads none); ``described``: the
        prompt as described, if it was (it calibrates the estimate of text)."""
        fleet = self.router.fleet
        # Bound to the node until the ``finally`` below.
        placement = self._place(node, binding, key, prompt)
        url = node.url + self.path
        trace = self.trace
        headers = b"" if trace is None else trace.prefill(node, url, self._prefix_hit)
        prefilled = None
        try:
            # The engine pins the KV as it answers: a client leaving now must not strand it.
            with self._engine_has_it():
                body = handshake.prefill_body(self.body)
                if prompt is not None and prompt.chunks and node.id in fleet.kv.indexes:
                    # The prompt's token ids, for what the engines' KV events say they hold
                    # (a prompt shorter than a chunk is never linked to them).
                    body["return_token_ids"] = True
                answer = await self._send(node, url, body, headers)
                try:
                    if answer.status != 200:
                        raise await answer.error()
                    raw = await answer.read()
                    try:
                        prefilled = handshake.Prefilled(orjson.loads(raw))
                    except ValueError as exc:  # not JSON (orjson's error is one), or no KV
                        reason = (
                            "answer is not JSON" if isinstance(exc, orjson.JSONDecodeError) else exc
                        )
                        raise UpstreamError(f"{answer.url}: {reason}") from None
                except UpstreamError as error:
                    raise self._engine_failed(node, error) from None
                finally:
                    # Read to its end: the connection goes back to the pool now, not when
                    # the request ends.
                    self._open.remove(answer)
                    answer.close()
        finally:
            fleet.prefill.release(placement)
            fleet.set_prefill(binding, None)
        if prefilled is not None:
            fleet.served(node)
            if trace is not None:
                trace.prefilled(prefilled.prompt_details)
            if described is not None:
                fleet.kv.calibrate(described, prefilled.prompt_tokens)
            if prompt is not None and prefilled.prompt_token_ids is not None:
                fleet.kv.learn(node.id, prompt, prefilled.prompt_token_ids)
        return prefilled

    def _place(self, node: Node, binding: Binding, key: int, prompt: Prompt | None) -> Placement:
        """The prefill goes to ``node``: bound to it (the node's outstanding prefills, as the
        prefill policy counts them) until the caller releases the placement."""
        fleet = self.router.fleet
        fleet.set_prefill(binding, node)
        self._prefill_node = node
        placement = fleet.prefill.place(node, key, prompt)
        self._prefix_hit = placement.hit
        self._predicted_cached = placement.cached
        self._cache_source = placement.source
        self.router.telemetry.prefill_picked(fleet.prefill.name, self._prefix_hit)
        return placement

    async def _handoff_to(self, node: Node, prefilled: handshake.Prefilled) -> Handed | None:
        """Send the decode request; shielded until the decode engine has taken the KV.

        A streamed answer's headers do not say so (vLLM sends them before it pulls the
        blocks); its first bytes do, so they are read in here and returned with it. None
        when the client left and the engine did not get that far within the grace.
        """
        params = prefilled.kv_transfer_params
        url = node.url + self.path
        trace = self.trace
        # SGLang's hand-off is not shielded: a failed prefill must stop it at once, and its
        # engines let go of the KV when their requests are closed.
        with self._engine_has_it() if prefilled.sent is None else contextlib.nullcontext():
            drain = self.client_gone
            if prefilled.sent is not None:
                if drain:
                    return None
                body = prefilled.sent
            elif prefilled.is_local:
                if drain:
                    return None  # nothing waits on a prefill engine
                body = handshake.local_body(self.body)
            elif drain:
                body = handshake.drain_body(self.body, params)
            else:
                body = handshake.decode_body(self.body, params)
            headers = b"" if trace is None else trace.decode(node, url, drain)
            answer = await self._send(node, url, body, headers)
            first = b""
            if answer.status == 200:
                try:
                    if drain:
                        # The drain's one token: by then the KV has been pulled.
                        await answer.read()
                    elif self.stream:
                        first = await answer.next_chunk()
                except UpstreamError as error:
                    raise self._engine_failed(node, error) from None
                if trace is not None:
                    trace.handed()
            return answer, first
        return None

    @contextlib.contextmanager
    def _engine_has_it(self) -> Iterator[anyio.CancelScope]:
        """Shielded from the client's leaving, from the prefill request to the decode engine
        taking the KV: the prefill engine pins the KV as it answers, and only a decode
        engine's pull frees it before its lease runs out. A client that left gives the
        engines ``handoff_grace`` (``_watch``); ``fail`` cancels at once."""
        # The running backend's own scope class, as the request's scope is one: making an
        # ``anyio.CancelScope`` asks which backend runs (sniffio) every time, half its cost.
        kind = anyio.CancelScope if self._scope is None else type(self._scope)
        with kind(shield=True) as guard:
            self._handoff = guard
            if self.client_gone:
                guard.deadline = anyio.current_time() + self.router.settings.handoff_grace
            try:
                yield guard
            finally:
                self._handoff = None

    async def _send(
        self,
        node: Node,
        url: str,
        body: dict[str, Any],
        headers: bytes,
        blamed: Callable[[Node, UpstreamError], UpstreamError] | None = None,
    ) -> Response:
        """One request to ``node`` at ``url``, with ``headers`` besides those every request
        has; the answer is closed when the request ends, if not before. ``blamed``: what
        its failure is told as (``_engine_failed``, counted against the node)."""
        try:
            # Every answer's body is read next: one wake-up for its head and first bytes.
            answer = await self.router.upstream.post(
                url, body, self.request_id, self.via, headers, first_bytes=True
            )
        except UpstreamError as error:
            raise (blamed or self._engine_failed)(node, error) from None
        self._open.append(answer)
        return answer

    def _engine_failed(self, node: Node, error: UpstreamError) -> UpstreamError:
        """Count ``error`` against ``node``; returns it as the client is told, which names
        the engine's role as well as its URL."""
        # Our own hang-ups and aborts say nothing about the engine.
        if self._failure is None and not self.client_gone:
            if self.trace is not None:
                self.trace.failed(error, node)
            self.router.telemetry.upstream_error(node, error.kind)
            evidence = error.evidence
            if evidence is None and error.kind == "timeout" and node.role == "prefill":
                # A prefill is one token: silent for the whole read timeout, its engine is
                # hung or hopelessly behind, whatever its /health says (vLLM's answers
                # while its scheduler hangs). A long answer is a decode engine's, never a
                # prefill's, and a prefill's silence has no stall watch to find it.
                evidence = Evidence.SOFT
            if evidence is not None:
                failure = Failure(error.kind.replace("_", " "), error.message, evidence)
                self.router.fleet.failed(node, failure, reporter=self)
        return UpstreamError(
            f"{node.role} engine {error.message}",
            status=error.status,
            code=error.code,
            kind=error.kind,
        )

    async def _relay_events(
        self,
        client: ClientStream,
        answer: Response,
        prefilled: handshake.Prefilled,
        data: bytes,
    ) -> UpstreamError | None:
        """Stream the answer, starting with ``data``, its bytes read in the hand-off.

        Once the client's response has begun, the rest is poured: passed on from the engine
        connection's callback as each read arrives (``_Pour``), the relay waking only at
        the end of the stream; without a ``Wire`` (another ASGI server), read by read."""
        trace = self.trace
        fix = prefilled.fix_usage if trace is None else trace.watching(prefilled.fix_usage)
        events = EventRelay(fix)
        while data:
            try:
                ready = events.feed(data)
            except ValueError as exc:
                raise _event_too_large(answer, exc) from None
            if ready:
                if trace is not None:
                    # Events end with a blank line; inside one, line breaks are escaped.
                    trace.events += ready.count(b"\n\n")
                if not client.started:
                    if events.error_first:
                        # The engine failed before its first token: a real error status.
                        raise streamed_error(answer.url, events.error or b"")
                    # Headers go out with the first event, not before: the client sees
                    # both in one wake-up, and an engine failing before its first event
                    # still gets the client a real error status, not a 200 and an event.
                    # Nothing is sent again from now on.
                    self._let_go(prefilled)
                    await client.start_events()
                if events.done:
                    # End the client's response with [DONE] itself: clients (the openai
                    # SDK) hang up as soon as they see it.
                    await client.end_events(ready)
                    break
                if client.pours:
                    await self._pour(client, answer, events, ready)
                    break
                await client.write(ready)
            data = await answer.next_chunk()
        if not events.done:
            message = f"{answer.url}: decode stream ended without [DONE]"
            raise UpstreamError(message, kind="broken_stream")
        # The rest is the end of the chunked body: read so that the connection is reused.
        # The client has its whole answer: an engine that fails now, or does not end its
        # body (holds it open, or sends on), costs only the connection, not the slot until
        # the read timeout (and the node a stall verdict).
        await answer.finish(AFTER_DONE)
        # An error event passed on (the client has it, then [DONE]): the request failed.
        return None if events.error is None else streamed_error(answer.url, events.error)

    async def _pour(
        self, client: ClientStream, answer: Response, events: EventRelay, ready: bytes
    ) -> None:
        """``ready``, then the rest of the stream, poured to the client; its last events
        (``[DONE]``) go out through ``send``, which ends the response."""
        pour = _Pour(self, client, answer, events)
        try:
            pour.write(ready)
            await answer.pipe(pour.feed)
        finally:
            client.when_writable(None)
        if isinstance(pour.error, ValueError):
            raise _event_too_large(answer, pour.error)
        if pour.error is not None:
            raise pour.error
        if events.done:
            await client.end_events(pour.last)

    async def _relay_json(
        self, client: ClientStream, answer: Response, prefilled: handshake.Prefilled
    ) -> None:
        raw = await answer.read()
        try:
            document = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"{answer.url}: answer is not JSON") from None
        trace = self.trace
        fix = prefilled.fix_usage if trace is None else trace.watching(prefilled.fix_usage)
        await client.respond(200, with_usage_fixed(raw, document, fix))


class _Pour:
    """The sink of a poured stream (``Response.pipe``): each read of the engine's bytes,
    cut at event boundaries and with its usage fixed (``EventRelay``), written to the client
    (``ClientStream.pour``) from the engine connection's callback. A full client holds the
    engine back until it takes writes again; a client gone or a request failed from outside
    takes nothing more (the relay is being cancelled)."""

    __slots__ = ("_relay", "_client", "_answer", "_events", "last", "error")

    def __init__(
        self, relay: Relay, client: ClientStream, answer: Response, events: EventRelay
    ) -> None:
        self._relay = relay
        self._client = client
        self._answer = answer
        self._events = events
        # The events that end the stream, with ``[DONE]``: ``send`` ends the response with them.
        self.last = b""
        # The engine's bytes were not events (``EventRelay.feed``), or feeding them failed
        # otherwise: raised by the relay once the pipe ends (never into the loop's callback,
        # which would leave the pipe waiting for bytes that were already taken).
        self.error: Exception | None = None

    def feed(self, data: bytes) -> bool:
        """True: no more (the stream's end, an error, or the request is over)."""
        relay = self._relay
        if relay.client_gone or relay._failure is not None:
            return True
        events = self._events
        try:
            ready = events.feed(data)
        except Exception as exc:
            self.error = exc
            return True
        if not ready:
            return False
        trace = relay.trace
        if trace is not None:
            trace.events += ready.count(b"\n\n")
        if events.done:
            self.last = ready
            return True
        self.write(ready)
        return False

    def write(self, ready: bytes) -> None:
        if not self._client.pour(ready):
            self._answer.hold()
            self._client.when_writable(self._answer.resume)


def _spawn_watcher(watch: Callable[[Receive], Coroutine[Any, Any, None]], receive: Receive) -> None:
    """Start the disconnect watcher without a task group.

    A task group costs ~80 µs per request on asyncio (anyio's cancellation machinery) and
    buys nothing here: the watcher ends by itself (see ``_watch``) and owns nothing. The
    relay runs on asyncio under uvicorn; trio is there for the in-process tests.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio

        trio.lowlevel.spawn_system_task(watch, receive)
        return
    task = loop.create_task(watch(receive))
    # The loop keeps only a weak reference to its tasks.
    _watchers.add(task)
    task.add_done_callback(_watchers.discard)


_watchers: set[asyncio.Task[None]] = set()


def refused_line(
    request_id: str, key: str | None, endpoint: str, outcome: str, status: int, sent: int
) -> dict[str, Any]:
    """The request line of a request refused before a relay began (its body, its model, a
    loop, a shutdown, a client gone while sending): the fields of every request line, each
    phase that never ran ``None``."""
    fields: dict[str, Any] = dict.fromkeys(LINE_FIELDS)
    fields.update(request_id=request_id, key=key, endpoint=endpoint, outcome=outcome, status=status)
    fields["bytes"] = sent
    return fields


def _event_too_large(answer: Response, error: ValueError) -> UpstreamError:
    """An event over ``MAX_EVENT_BYTES``: what this request asked for (vLLM sends the whole
    prompt's logprobs in one event for ``echo`` with ``logprobs``), as an answer over
    ``--max-response-bytes`` is: no evidence against the engine."""
    return UpstreamError(f"{answer.url}: {error}", code="event_too_large", kind="too_large")


def _silent(error: Exception) -> bool:
    """An engine that sent nothing for the read timeout."""
    return isinstance(error, UpstreamError) and error.kind == "timeout"


def _id(node: Node | None) -> int | None:
    return None if node is None else node.id


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)

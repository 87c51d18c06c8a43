"""The router's error kinds and their OpenAI-shaped bodies.

Every failure a client can see is one of these. Raising one anywhere in the request path
is the single way to end a request with an error; the response layer turns it into a JSON
body before the headers went out, or into one SSE error event after.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

import orjson


class Evidence(Enum):
    """How much a failure says about the node (see the module docstring)."""

    SOFT = "soft"
    HARD = "hard"
    FATAL = "fatal"


class RouterError(Exception):
    """A failure with an HTTP status and an OpenAI error body."""

    status = 500
    type = "internal_error"
    code: str | None = None
    # How the request ended, for metrics and logs; None: decided by where it failed.
    outcome: str | None = None
    # Seconds a client should wait before retrying, when retrying makes sense.
    retry_after: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": self.retry_after}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def json(self) -> bytes:
        return orjson.dumps(self.body())


E = TypeVar("E", bound=BaseException)


def detached(error: E) -> E:
    """``error`` and the exceptions it chains to, without their tracebacks.

    A raised exception kept past its ``except`` block holds every frame it went through and
    so their locals (a request's body among them); the frame that keeps it closes a
    reference cycle that only the cyclic collector frees, late under the router's GC
    settings (``cli._settle_heap``). The router logs tracebacks where it catches, never later.
    """
    seen: BaseException | None = error
    while seen is not None:
        seen.__traceback__ = None
        seen = seen.__cause__ or seen.__context__
    return error


def fresh(error: E) -> E:
    """A new exception like ``error``, to raise where ``error`` itself is shared: raising
    one instance in several frames would chain all of them to it."""
    copy = type(error).__new__(type(error), *error.args)
    copy.__dict__.update(error.__dict__)
    copy.args = error.args
    return copy


class InternalError(RouterError):
    """A bug in the router: logged with its traceback where it was caught."""

    outcome = "internal_error"


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"
    outcome = "bad_request"


class PayloadTooLarge(BadRequest):
    status = 413


class NoRoute(BadRequest):
    """A path the router does not serve (404), or a method it does not take there (405)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status
        self.code = "method_not_allowed" if status == 405 else "not_found"


class AdminDisabled(BadRequest):
    """``/admin/*`` on a router started without ``--admin-token``: the path is right, the
    API is off (404, as if it were not there: it exposes nothing)."""

    status = 404
    code = "admin_disabled"

    def __init__(self, route: str) -> None:
        super().__init__(
            f"{route}: the admin API is off; start pd-router with --admin-token TOKEN (or "
            "PD_ROUTER_ADMIN_TOKEN, or admin_token in the config file) to turn it on"
        )


class ModelNotFound(BadRequest):
    """A ``model`` no prefill or no decode node serves (OpenAI's own answer to an unknown
    model is this 404)."""

    status = 404
    code = "model_not_found"
    outcome = "model_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class LoopDetected(BadRequest):
    """A request that came back to a router it already passed through (``edge/hops.py``):
    an engine URL leads back to a router. Refused before any slot is taken."""

    status = 508
    code = "loop_detected"
    outcome = "loop_detected"


class HeadTooLarge(BadRequest):
    """A request line and headers over ``--max-header-bytes`` (``edge/protocol.py``)."""

    status = 431
    code = "request_header_fields_too_large"


class Busy(RouterError):
    """No decode slot free and no queueing configured (fail fast)."""

    status = 429
    type = "rate_limit_error"
    code = "decode_nodes_busy"
    outcome = "rejected_busy"
    # A slot frees when some stream ends; a second is a sane, cheap retry interval.
    retry_after = "1"


class QueueTimeout(Busy):
    """Queued for ``--queue-timeout`` seconds and no slot came free."""

    outcome = "rejected_timeout"


class Unauthorized(RouterError):
    """No key, or a key not in ``--api-keys-file`` (``edge/auth.py``). The message never
    repeats what the client sent."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    outcome = "unauthorized"

    @property
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class RateLimited(RouterError):
    """A key with ``max_in_flight`` requests in flight already (``fleet/keys.py``): only
    that key is refused."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    outcome = "rate_limited"
    retry_after = "1"


class UpstreamError(RouterError):
    """An engine failed or answered with an error; its status is passed on when it has one.

    ``kind`` says what went wrong, for metrics and for the node's health (``evidence``):
    ``unreachable`` (connection refused: fatal, the node is dead at once),
    ``broken_stream`` and ``protocol`` (hard), ``http_5xx`` and ``connect_timeout`` (soft:
    a full accept queue also looks like a connect timeout, and the streams the engine
    already serves may be fine), and, saying nothing against the node: ``http_4xx`` (the
    request's fault), ``timeout`` (the request's own outcome, 504), ``stalled`` (the stall
    watch ended it), ``node_dead`` (another request found the engine dead) and
    ``too_large`` (an answer over ``--max-response-bytes``: the request's, not the node's);
    and ``loop`` (a 508 ``loop_detected``: the node leads back to a router the request
    passed through, so it is no engine: fatal, the node is dead at once).
    ``tls`` (a TLS handshake failed) is soft: an engine whose certificate is not trusted,
    or which refuses the router's, is routed around once unhealthy, never made dead, so
    that when every node fails so (the router's own settings are wrong) they all still
    take requests and each client is told what failed, naming the engine.
    """

    type = "upstream_error"

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        code: str | None = None,
        kind: str = "protocol",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.kind = kind
        self.outcome = _OUTCOMES.get(kind)
        if kind == "http_4xx" and code != "engine_unauthorized":
            # The engine refused the request itself (a prompt longer than its context, a
            # parameter it does not take): the client's to fix, as a 400 of the router's.
            self.outcome = "bad_request"

    @property
    def undelivered(self) -> bool:
        """No byte of the request reached the engine: it can go to another one."""
        return self.kind in ("unreachable", "connect_timeout")

    @property
    def engine_fault(self) -> bool:
        """Worth another engine (prefill retries once): not the request's fault, nor an
        answer too large (another engine would give the same)."""
        return self.kind not in ("http_4xx", "too_large")

    @property
    def evidence(self) -> Evidence | None:
        """What this says against the engine; None: nothing."""
        return _EVIDENCE.get(self.kind)


_EVIDENCE = {
    "unreachable": Evidence.FATAL,
    "loop": Evidence.FATAL,
    "broken_stream": Evidence.HARD,
    "protocol": Evidence.HARD,
    "http_5xx": Evidence.SOFT,
    "connect_timeout": Evidence.SOFT,
    "tls": Evidence.SOFT,
}
_OUTCOMES = {"timeout": "timeout", "stalled": "stalled", "node_dead": "node_dead"}


def engine_message(raw: bytes) -> str | None:
    """The message of an OpenAI/vLLM JSON error body; None for any other body.

    Only an engine's own error message goes to the client: an HTML or plain-text page (a
    proxy's, a framework's stack trace) is the operator's to read, in the router's log.
    """
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error  # vLLM's 401: {"error": "Unauthorized"}
        if isinstance(parsed.get("message"), str):
            return str(parsed["message"])
    return None


class Unavailable(RouterError):
    """The router cannot serve this request at all right now."""

    status = 503
    type = "service_unavailable"
    code = "no_live_node"
    outcome = "no_live_node"
    retry_after = "1"


class ModelsUnknown(Unavailable):
    """``GET /v1/models`` before the router has read any serving engine's list."""

    code = "models_unknown"


class ShuttingDown(Unavailable):
    code = "shutting_down"
    outcome = "shutting_down"


class StateUnavailable(Unavailable):
    """The shared state (``--state``, ``shared/pool.py``) did not answer: no slot can be
    reserved."""

    code = "shared_state_unavailable"
    outcome = "state_unavailable"


class NodeDead(UpstreamError):
    """The request's engine was found dead; it fails the requests bound to it, and only them."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=502, code="node_dead", kind="node_dead")


class Stalled(UpstreamError):
    """The stall watch found the request's decode engine hung (``fleet/stall.py``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=504, code="stalled", kind="stalled")


class Aborted(RouterError):
    """An operator aborted the request (``POST /admin/requests/{id}/abort``)."""

    status = 503
    type = "aborted"
    code = "abort"
    outcome = "aborted"


class RequestTimeout(BadRequest):
    """A request head or body that came too slowly (``--header-timeout``, ``--body-timeout``);
    ``edge/protocol.py`` answers it and closes the connection."""

    status = 408
    code = "request_timeout"


class TooManyConnections(Unavailable):
    """A connection over ``--max-connections``: ``edge/protocol.py`` answers it before
    reading a request, so it is never a request's outcome (not counted as one)."""

    code = "too_many_connections"

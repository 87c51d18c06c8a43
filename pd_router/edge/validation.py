"""Client request bodies: parsed and checked before any slot or engine is involved.

Only what the router itself relies on is checked; everything else is the engine's to
judge (and its 4xx is passed on). A bad request must never cost someone else a slot.
"""

from __future__ import annotations

import re
import secrets
from itertools import chain
from typing import Any, Literal

import orjson

from pd_router.errors import BadRequest

Endpoint = Literal["completions", "chat"]

PATHS: dict[Endpoint, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}

_SANE_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")


def request_id(header: str | None) -> str:
    """The client's id when it is safe to log and forward, else a fresh one."""
    if header is not None and _SANE_ID.fullmatch(header):
        return header
    return secrets.token_hex(16)


# Deeper than any real request (a tool's JSON schema is a few tens of levels), and below
# the 255 levels that the JSON encoder writes back (orjson reads 1,024).
MAX_DEPTH = 128
# orjson reads an integer outside 64 bits as a float, which the engine would get instead.
_NUMBER_LIMIT = 2.0**63


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    if not raw.strip():
        raise BadRequest("request body is empty: expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        if "depth" in exc.msg:
            raise BadRequest(f"request body is nested deeper than {MAX_DEPTH} levels") from None
        raise BadRequest(f"request body is not valid JSON (error at {where})") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    _check_model(body)
    if endpoint == "completions":
        _check_prompt(body)
    else:
        _check_messages(body)
    _check_structure(body)
    _check_optional(body, "stream", bool, "a boolean")
    _check_optional(body, "stream_options", dict, "an object")
    if body.get("stream_options") and not body.get("stream"):
        # vLLM's own rule, checked by the decode engine only after the prefill engine had
        # computed the prompt and pinned its KV for it.
        raise BadRequest(
            "'stream_options' can only be given with 'stream': true", param="stream_options"
        )
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(key)
        if value is None or (value == 0 and key == "max_tokens" and _echoes(endpoint, body)):
            continue
        if not _is_int(value) or value < 1:
            raise BadRequest(f"'{key}' must be a positive integer, got {_got(value)}", param=key)
    # Never let a client steer a decode engine to an arbitrary host.
    body.pop("kv_transfer_params", None)
    # The other endpoint's prompt field, which the engine ignores: the router would take it
    # for the prompt (its key, its length for --max-local-prefill).
    body.pop("messages" if endpoint == "completions" else "prompt", None)
    return body


def _echoes(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """A completion that echoes its prompt: with ``max_tokens`` 0, vLLM answers the prompt
    alone (with ``logprobs``, its tokens' log-probabilities: scoring a text)."""
    return endpoint == "completions" and body.get("echo") is True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _got(value: Any) -> str:
    """What a client sent in a field of the wrong type or value, short: a number as it
    was written, any other value by its kind (a prompt may be megabytes)."""
    if value is None or isinstance(value, bool | int | float):
        return orjson.dumps(value).decode()
    if isinstance(value, str | list):
        kind = "a string" if isinstance(value, str) else "a list"
        return kind if value else kind.replace("a ", "an empty ", 1)
    return "an object"


def _required(body: dict[str, Any], key: str) -> Any:
    """The field, which must be there: a field with a wrong value is told so instead."""
    if key not in body:
        raise BadRequest(f"'{key}' is required", param=key)
    return body[key]


def _check_model(body: dict[str, Any]) -> None:
    model = _required(body, "model")
    if not isinstance(model, str) or not model:
        raise BadRequest(f"'model' must be a non-empty string, got {_got(model)}", param="model")


def _check_optional(body: dict[str, Any], key: str, kind: type, what: str) -> None:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and _is_int(value))):
        raise BadRequest(f"'{key}' must be {what}, got {_got(value)}", param=key)


def _check_prompt(body: dict[str, Any]) -> None:
    prompt = _required(body, "prompt")
    if isinstance(prompt, str):
        return
    got = _got(prompt)
    if isinstance(prompt, list) and prompt:
        # The element types are collected in C (``map(type)``): a 16M-token prompt costs
        # ~0.2 s of the event loop this way, ~1 s with a Python loop over it.
        kinds = _kinds(prompt)
        if kinds == {str} or kinds == {int}:
            return
        if kinds == {list} and all(item and _kinds(item) == {int} for item in prompt):
            return
        got = "a list of lists, not all of token ids" if kinds == {list} else _list_of(kinds)
    raise BadRequest(
        "'prompt' must be a string, a list of strings, a list of token ids (integers) "
        f"or a list of such lists, got {got}",
        param="prompt",
    )


_PLURALS = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}


def _list_of(kinds: set[type]) -> str:
    names = sorted(_PLURALS.get(kind, "other values") for kind in kinds)
    return "a list of " + " and ".join(dict.fromkeys(names))


def _kinds(items: list[Any]) -> set[type]:
    """The exact types of ``items`` (a bool is not an int here, as ``type`` says)."""
    return set(map(type, items))


def _check_messages(body: dict[str, Any]) -> None:
    messages = _required(body, "messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            f"'messages' must be a non-empty list of messages, got {_got(messages)}",
            param="messages",
        )
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(
                f"'messages[{index}]' must be an object, got {_got(message)}", param="messages"
            )
        role = message.get("role")
        if not isinstance(role, str):
            what = "is required" if "role" not in message else f"must be a string, got {_got(role)}"
            raise BadRequest(f"'messages[{index}].role' {what}", param="messages")


def _check_structure(body: dict[str, Any]) -> None:
    """Nesting and numbers the router could not send on as they came.

    The body is walked a level at a time, each level one flat list that C code builds and
    types (``chain``, ``map``): a million messages cost ~0.2 s of the event loop, where a
    walk object by object cost over 1 s. The prompt is skipped (its shape is checked)."""
    level: list[Any] = [value for key, value in body.items() if key != "prompt"]
    depth = 1
    while level:
        kinds = _kinds(level)
        if float in kinds and any(type(v) is float and abs(v) >= _NUMBER_LIMIT for v in level):
            raise BadRequest("a number in the request body is out of range (beyond ±2^63)")
        dicts = _only(level, kinds, dict)
        lists = _only(level, kinds, list)
        if not dicts and not lists:
            return
        depth += 1
        if depth > MAX_DEPTH:
            raise BadRequest(f"request body is nested deeper than {MAX_DEPTH} levels")
        level = [*chain.from_iterable(map(dict.values, dicts)), *chain.from_iterable(lists)]


def _only(level: list[Any], kinds: set[type], kind: type) -> list[Any]:
    if kind not in kinds:
        return []
    return level if len(kinds) == 1 else [value for value in level if type(value) is kind]

"""OpenAI-compatible response bodies, shaped the way vLLM's API server shapes them."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

JSON = dict[str, Any]


def token_text(token: str) -> str:
    """Every output token, the first included, is its word with one leading space."""
    return " " + token


def error_body(status: int, message: str, param: str | None = None) -> JSON:
    # vLLM names the error type after the status phrase, e.g. "BadRequestError".
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    kind = phrase.replace(" ", "").replace("-", "")
    if not kind.endswith("Error"):
        kind += "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> JSON:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response_id(request_id: str, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def full_response(
    *,
    request_id: str,
    chat: bool,
    model: str,
    created: int,
    text: str,
    usage_body: JSON,
    kv_transfer_params: JSON | None,
) -> JSON:
    """A non-streaming completion or chat completion that stopped on its length limit."""
    choice: JSON
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    return {
        "id": response_id(request_id, chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_body,
        "kv_transfer_params": kv_transfer_params,
    }


def chunk(
    *,
    request_id: str,
    chat: bool,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    role: bool = False,
) -> JSON:
    """One streamed event; ``role`` makes the opening chat event that only names the role."""
    choice: JSON
    if chat:
        delta: JSON = {"role": "assistant", "content": ""} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
    return {
        "id": response_id(request_id, chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(*, request_id: str, chat: bool, model: str, created: int, usage_body: JSON) -> JSON:
    """The closing event that ``stream_options.include_usage`` asks for."""
    return {
        "id": response_id(request_id, chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body,
    }

"""Deterministic tokenization of OpenAI request bodies.

The sim has no tokenizer: a token is a whitespace-separated word, or ``str(n)`` for
token ids. Using words keeps every prompt readable in test assertions.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping


class PromptError(ValueError):
    """The body's prompt or messages cannot be tokenized; answered with a 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but true/false are not token ids.
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[object]) -> list[str]:
    if not all(_is_int(v) for v in values):
        raise PromptError("prompt token ids must be integers", "prompt")
    return [str(v) for v in values]


def completion_tokens(body: Mapping[str, object]) -> list[str]:
    """Tokens of a /v1/completions body's ``prompt``."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.split()
    if not isinstance(prompt, list) or not prompt:
        raise PromptError("prompt must be a string or a list of token ids", "prompt")
    if all(_is_int(v) for v in prompt):
        return [str(v) for v in prompt]
    if len(prompt) != 1:
        raise PromptError("batched prompts not supported by the sim", "prompt")
    only = prompt[0]
    if isinstance(only, str):
        return only.split()
    if isinstance(only, list) and only:
        return _token_ids(only)
    raise PromptError("prompt must be a string or a list of token ids", "prompt")


def _message_text(content: object) -> str:
    if content is None:
        # Assistant turns that only carry tool calls have no content.
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError("message content must be a string or a list of parts", "messages")
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise PromptError("only text content parts are supported by the sim", "messages")
        text = part.get("text")
        if not isinstance(text, str):
            raise PromptError("a text content part needs a string 'text'", "messages")
        texts.append(text)
    # vLLM joins the text parts of one message with newlines.
    return "\n".join(texts)


def chat_tokens(body: Mapping[str, object]) -> list[str]:
    """Tokens of a /v1/chat/completions body's ``messages``, rendered as ``role: content``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list", "messages")
    lines: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise PromptError("each message must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise PromptError("each message needs a string 'role'", "messages")
        lines.append(f"{role}: {_message_text(message.get('content'))}")
    return "\n".join(lines).split()


def request_tokens(body: Mapping[str, object], chat: bool, max_model_len: int) -> list[str]:
    """Tokenize a generation body and apply the engine's context-length limit."""
    tokens = chat_tokens(body) if chat else completion_tokens(body)
    param = "messages" if chat else "prompt"
    if not tokens:
        raise PromptError("the prompt is empty", param)
    if len(tokens) > max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, your request has {len(tokens)} input tokens.",
            param,
        )
    return tokens


def token_id(token: str) -> int:
    """A token's id, as KV events and ``return_token_ids`` give it: the word if it is a
    number (a prompt given as token ids), else its CRC-32."""
    return int(token) if token.isdigit() else zlib.crc32(token.encode())

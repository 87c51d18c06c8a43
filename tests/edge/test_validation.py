"""Request bodies as the router checks them before any slot or engine is involved
(``edge/validation.py``): where vLLM's own rules differ from a plain positive integer, what
an engine would refuse or misread, and the request ids kept."""

from __future__ import annotations

import pytest

from pd_router.edge.validation import parse_body, request_id
from pd_router.errors import BadRequest


def test_max_tokens_0_is_taken_only_for_a_completion_that_echoes_its_prompt() -> None:
    """vLLM answers ``echo`` with ``max_tokens`` 0 with the prompt alone (scoring a text
    with ``logprobs``); anywhere else 0 tokens is no request."""
    echo = parse_body(
        b'{"model": "m", "prompt": "x", "max_tokens": 0, "echo": true}', "completions"
    )
    assert echo["max_tokens"] == 0
    refused = [
        (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "completions"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 0, "echo": 1}', "completions"),
        (b'{"model": "m", "prompt": "x", "max_tokens": -1, "echo": true}', "completions"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0, '
            b'"echo": true}',
            "chat",
        ),
    ]
    for raw, endpoint in refused:
        with pytest.raises(BadRequest, match="'max_tokens' must be a positive integer"):
            parse_body(raw, endpoint)


DEEP = b"[" * 128 + b"1" + b"]" * 128


@pytest.mark.parametrize(
    ("raw", "endpoint", "param", "message"),
    [
        # Counts the engine takes as max_tokens is taken: a positive integer.
        (
            b'{"model": "m", "prompt": "x", "n": 0}',
            "completions",
            "n",
            "'n' must be a positive integer, got 0",
        ),
        (b'{"model": "m", "prompt": "x", "n": "2"}', "completions", "n", "got a string"),
        (
            b'{"model": "m", "messages": [{"role": "user"}], "max_completion_tokens": -1}',
            "chat",
            "max_completion_tokens",
            "'max_completion_tokens' must be a positive integer, got -1",
        ),
        # Only max_tokens takes 0 with echo (the prompt alone): not max_completion_tokens.
        (
            b'{"model": "m", "prompt": "x", "max_completion_tokens": 0, "echo": true}',
            "completions",
            "max_completion_tokens",
            "'max_completion_tokens' must be a positive integer, got 0",
        ),
        (
            b'{"model": "", "prompt": "x"}',
            "completions",
            "model",
            "non-empty string, got an empty string",
        ),
        # Lists of token-id lists: every one non-empty and of integers only.
        (
            b'{"model": "m", "prompt": [[1, 2], []]}',
            "completions",
            "prompt",
            "not all of token ids",
        ),
        (b'{"model": "m", "prompt": [[1, "a"]]}', "completions", "prompt", "not all of token ids"),
        (b'{"model": "m", "prompt": [[1, true]]}', "completions", "prompt", "not all of token ids"),
        (b'{"model": "m", "prompt": []}', "completions", "prompt", "got an empty list"),
        (
            b'{"model": "m", "messages": [{"role": 5, "content": "x"}]}',
            "chat",
            "messages",
            "'messages[0].role' must be a string, got 5",
        ),
        # -2^63 - 1 is read as the float -2^63: the engine would get a float.
        (
            b'{"model": "m", "prompt": "x", "seed": -9223372036854775809}',
            "completions",
            None,
            "out of range",
        ),
        # The messages are checked as the rest of the body is (only the prompt is not).
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x", "w": 1e19}]}',
            "chat",
            None,
            "out of range",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": ' + DEEP + b"}]}",
            "chat",
            None,
            "deeper",
        ),
    ],
)
def test_what_an_engine_would_refuse_or_misread_is_a_400_before_any_slot(
    raw: bytes, endpoint: str, param: str | None, message: str
) -> None:
    """README, Errors and Limits: wrong types, and numbers or nesting the router could not
    send on as they came, are 400 naming the field, before the prefill engine computes
    anything for a request the decode engine would refuse."""
    with pytest.raises(BadRequest) as caught:
        parse_body(raw, endpoint)  # type: ignore[arg-type]
    assert caught.value.status == 400 and caught.value.param == param
    assert message in caught.value.message


def test_the_other_endpoints_prompt_field_is_dropped() -> None:
    """The engine ignores it, and the router would take it for the prompt (its prefix key,
    its length for --max-local-prefill)."""
    messages = b'[{"role": "user", "content": "y"}]'
    completion = parse_body(
        b'{"model": "m", "prompt": "x", "messages": ' + messages + b"}", "completions"
    )
    assert completion == {"model": "m", "prompt": "x"}
    chat = parse_body(b'{"model": "m", "prompt": "x", "messages": ' + messages + b"}", "chat")
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "y"}]}


def test_request_ids_are_exactly_the_characters_readme_lists() -> None:
    """README, Limits: at most 128 of ``A-Za-z0-9._:@-``; anything else gets a fresh id."""
    kept = "AZaz09._:@-" + "x" * 117
    assert len(kept) == 128 and request_id(kept) == kept
    for char in "/\\%+=?#&;,'\"<>()[]{}|!$*~^`é\t\x00":
        bad = f"a{char}b"
        assert request_id(bad) != bad, repr(char)

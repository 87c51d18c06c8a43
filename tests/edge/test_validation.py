"""Request bodies as the router checks them before any slot or engine is involved
(``edge/validation.py``), where vLLM's own rules differ from a plain positive integer."""

from __future__ import annotations

import pytest

from pd_router.edge.validation import parse_body
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

"""The decisions with no I/O: request checks, the vLLM handshake, SSE pass-through."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pd_router.edge.validation import parse_body, request_id
from pd_router.engines import handshake
from pd_router.engines.sse import DONE, EventRelay, patch_usage
from pd_router.errors import BadRequest, engine_message


def test_prefill_body_is_a_one_token_non_streaming_request() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
        "temperature": 0,
    }
    out = handshake.prefill_body(body)
    assert out == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert body["max_tokens"] == 50, "the client's body is not modified"
    assert "max_completion_tokens" not in handshake.prefill_body({"model": "m", "prompt": "x"})


def test_decode_body_is_the_original_plus_exactly_the_prefill_params() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2]}
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 9}
    assert handshake.decode_body(body, params) == {**body, "kv_transfer_params": params}
    drain = handshake.drain_body(body, params)
    assert drain["max_tokens"] == 1 and drain["stream"] is False
    assert drain["kv_transfer_params"] is params


def test_only_what_a_prefill_can_hand_over_is_handed_over() -> None:
    """vLLM's prefill answers one ``kv_transfer_params`` per request: a batch of prompts or
    ``n`` samples cannot be handed over (the relay has the decode engine compute them);
    neither can beam search (vLLM's prefill answers no ``kv_transfer_params``) nor required
    tool calls (one token parsed as their list: a 400)."""
    one = [
        {"prompt": "x"},
        {"prompt": ["x"]},
        {"prompt": [1, 2, 3]},
        {"prompt": [[1, 2, 3]]},
        {"prompt": "x", "n": 1},
        {"messages": [{"role": "user", "content": "x"}]},
        {"prompt": "x", "use_beam_search": False},
        {"prompt": "x", "echo": True, "max_tokens": 4},
        {"prompt": "x", "logprobs": 1},
        {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "auto"},
    ]
    several = [
        {"prompt": ["x", "y"]},
        {"prompt": [[1, 2], [3]]},
        {"prompt": "x", "n": 2},
        {"messages": [{"role": "user", "content": "x"}], "n": 3},
        {"prompt": "x", "use_beam_search": True},
        {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "required"},
        {"prompt": "x", "echo": True, "max_tokens": 0},
        {"prompt": "x", "echo": True, "logprobs": 1},
        {"prompt": "x", "prompt_logprobs": 1},
    ]
    assert [handshake.hands_over(body) for body in one] == [True] * len(one)
    assert [handshake.hands_over(body) for body in several] == [False] * len(several)


def test_prefill_answer_without_kv_params_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_transfer_params"):
        handshake.Prefilled({"choices": []})


def test_usage_takes_cached_tokens_from_prefill() -> None:
    prefilled = handshake.Prefilled(
        {"kv_transfer_params": {}, "usage": {"prompt_tokens_details": {"cached_tokens": 16}}}
    )
    usage = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 40}}
    prefilled.fix_usage(usage)
    assert usage == {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 16}}
    unknown = handshake.Prefilled({"kv_transfer_params": {}, "usage": {"prompt_tokens": 40}})
    unknown.fix_usage(usage)
    assert usage == {"prompt_tokens": 40}, "a decode-side 100% cache hit is never reported"


def fix(usage: dict[str, object]) -> None:
    usage["prompt_tokens_details"] = {"cached_tokens": 3}


def test_event_relay_passes_bytes_through_at_event_boundaries() -> None:
    relay = EventRelay(fix)
    first = b'data: {"choices":[{"text":" a"}]}\n\n'
    second = b'data: {"choices":[{"text":" b"}]}\n\n'
    stream = first + second + DONE
    out = [relay.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)]
    assert b"".join(out) == stream
    assert all(chunk == b"" or chunk.endswith(b"\n\n") for chunk in out)
    assert relay.done


def test_event_relay_rewrites_only_the_usage_event() -> None:
    relay = EventRelay(fix)
    token = b'data: {"choices":[{"text":" a"}]}\n\n'
    usage = (
        b'data: {"choices":[],"usage":{"prompt_tokens":5,'
        b'"prompt_tokens_details":{"cached_tokens":5}}}\n\n'
    )
    out = relay.feed(token + usage + DONE)
    assert out.startswith(token) and out.endswith(DONE)
    patched = orjson.loads(out[len(token) + 6 : -len(DONE) - 2])
    assert patched["usage"] == {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}


def test_event_relay_takes_crlf_events_byte_for_byte_and_patches_their_usage() -> None:
    relay = EventRelay(fix)
    token = b'data: {"choices":[{"text":" a"}]}\r\n\r\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5}}\r\n\r\n'
    done = b"data: [DONE]\r\n\r\n"
    stream = token + usage + done
    out = [relay.feed(stream[i : i + 5]) for i in range(0, len(stream), 5)]
    joined = b"".join(out)
    assert relay.done and joined.startswith(token) and joined.endswith(done)
    assert all(chunk == b"" or chunk.endswith(b"\r\n\r\n") for chunk in out)
    patched = orjson.loads(joined[len(token) + 6 : -len(done) - 4])
    assert patched["usage"] == {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}


def test_event_relay_takes_data_fields_without_the_space() -> None:
    """``data:x`` is ``data: x`` (SSE drops one space after the colon, if there is one):
    its [DONE] ends the stream, its usage is fixed, its error is the request's."""
    relay = EventRelay(fix)
    usage = b'data:{"choices":[],"usage":{"prompt_tokens":5}}\n\n'
    out = relay.feed(usage + b"data:[DONE]\n\n" + b'data:{"choices":[]}\n\n')
    assert relay.done and out.startswith(b"data:{") and out.endswith(b"data:[DONE]\n\n")
    assert orjson.loads(out[5 : out.index(b"\n")])["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 3
    }
    failed = EventRelay(fix)
    failed.feed(b'data:{"error":{"message":"boom","code":500}}\r\n\r\ndata:[DONE]\r\n\r\n')
    assert failed.done and failed.error_first
    assert failed.error == b'{"error":{"message":"boom","code":500}}'


def test_event_relay_sends_nothing_after_done() -> None:
    relay = EventRelay(fix)
    token = b'data: {"choices":[{"text":" a"}]}\n\n'
    late = b'data: {"choices":[{"text":" late"}]}\n\n'
    assert relay.feed(token + DONE + late) == token + DONE
    assert relay.done


def test_event_relay_bounds_an_event_that_never_ends() -> None:
    relay = EventRelay(fix)
    with pytest.raises(ValueError, match="exceeded"):
        for _ in range(300):
            relay.feed(b"x" * 4096)


def test_a_usage_nested_deeper_than_json_is_written_back_goes_on_as_it_came() -> None:
    """orjson reads 1,024 levels and writes 254: a lying engine's answer (or a prefill
    engine's usage details, copied into the decode engine's) is not fixed, not failed."""
    deep = b"[" * 300 + b"]" * 300
    raw = b'{"usage": {"prompt_tokens": 3}, "x": ' + deep + b"}"
    assert patch_usage(raw, fix) is raw

    def deep_details(usage: dict[str, Any]) -> None:
        usage["prompt_tokens_details"] = orjson.loads(deep)

    raw = b'{"usage": {"prompt_tokens": 3}}'
    assert patch_usage(raw, deep_details) is raw
    stream = b"data: " + raw + b"\n\n" + DONE
    assert EventRelay(deep_details).feed(stream) == stream


def test_patch_usage_leaves_documents_without_usage_untouched() -> None:
    raw = b'{"choices": [1]}'
    assert patch_usage(raw, fix) is raw
    assert patch_usage(b"not json", fix) == b"not json"


@pytest.mark.parametrize(
    "raw, endpoint, param",
    [
        (b"{not json", "completions", None),
        (b"[1, 2]", "completions", None),
        (b'{"prompt": "x"}', "completions", "model"),
        (b'{"model": 3, "prompt": "x"}', "completions", "model"),
        (b'{"model": "m"}', "completions", "prompt"),
        (b'{"model": "m", "prompt": [1, "a"]}', "completions", "prompt"),
        (b'{"model": "m", "prompt": []}', "completions", "prompt"),
        (b'{"model": "m"}', "chat", "messages"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "chat", "messages"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', "completions", "stream"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "completions", "max_tokens"),
        (b'{"model": "m", "prompt": "x", "max_tokens": true}', "completions", "max_tokens"),
        (b'{"model": "m", "prompt": "x", "stream_options": 1}', "completions", "stream_options"),
        (
            b'{"model": "m", "prompt": "x", "stream_options": {"include_usage": true}}',
            "completions",
            "stream_options",
        ),
    ],
)
def test_bad_requests_are_400_with_the_offending_param(
    raw: bytes, endpoint: str, param: str | None
) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_body(raw, endpoint)  # type: ignore[arg-type]
    assert caught.value.status == 400
    assert caught.value.param == param
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_client_kv_transfer_params_are_dropped() -> None:
    raw = b'{"model": "m", "prompt": [[1, 2]], "kv_transfer_params": {"remote_host": "evil"}}'
    assert "kv_transfer_params" not in parse_body(raw, "completions")


def test_request_ids_are_kept_when_sane_and_replaced_otherwise() -> None:
    assert request_id("abc-123_x.y:z") == "abc-123_x.y:z"
    for bad in [None, "", "has space", "x" * 129, "new\nline"]:
        fresh = request_id(bad)
        assert fresh != bad and len(fresh) == 32


def test_engine_messages_are_taken_from_openai_and_vllm_json_bodies_only() -> None:
    assert engine_message(b'{"error": {"message": "too long"}}') == "too long"
    assert engine_message(b'{"message": "bad", "object": "error"}') == "bad"
    # A page (a proxy's, a stack trace) is for the router's log, never for the client.
    assert engine_message(b"<html>gateway</html>") is None
    assert engine_message(b"Traceback (most recent call last):") is None
    assert engine_message(b'{"detail": "not found"}') is None
    assert engine_message(b"") is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "request body is empty: expected a JSON object"),
        (b"notjson", "request body is not valid JSON (error at line 1, column 1)"),
        (b'{"model": "m", "prompt": 123}', "'prompt' must be a string, a list of strings"),
        (b'{"model": "m"}', "'prompt' is required"),
        (b'{"model": "m", "prompt": [1, 18446744073709551616]}', "'prompt' must be"),
        (b'{"model": "m", "prompt": "x", "seed": 18446744073709551616}', "out of range"),
        (b'{"model": "m", "prompt": "x", "x": {"y": [1.5, -1e19]}}', "out of range"),
        (b'{"model": "m", "prompt": "x", "x": ' + b"[" * 128 + b"]" * 128 + b"}", "deeper"),
        (
            b'{"model": "m", "prompt": "x", "x": ' + b'[{"a":' * 64 + b"1" + b"}]" * 64 + b"}",
            "deeper",
        ),
        (b'{"model": "m", "prompt": "x", "x": ' + b"[" * 1100 + b"]" * 1100 + b"}", "deeper"),
    ],
)
def test_odd_bodies_get_a_message_that_says_what_is_wrong(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_body(raw, "completions")
    assert caught.value.status == 400 and message in caught.value.message


def test_deep_but_forwardable_bodies_and_large_unsigned_integers_pass() -> None:
    deep = b'{"model": "m", "prompt": "x", "x": ' + b"[" * 127 + b"]" * 127 + b"}"
    body = parse_body(deep, "completions")
    assert orjson.loads(orjson.dumps(body)) == body
    raw = b'{"model": "m", "prompt": "x", "seed": 18446744073709551615, "t": 0.5}'
    assert orjson.dumps(parse_body(raw, "completions")) == raw.replace(b": ", b":").replace(
        b", ", b","
    )
